"""Repeat a backend many times on chosen cases and require bitwise-identical outputs: races in persistent
schedulers (tiles skipped or run twice under perturbed timing, FAILURES.md) show up as run-to-run
differences, which a single comparison against the reference can miss.

    python -m verify.repeat --backend triton --runs 200 [--deterministic] [--case ID ...]
"""

from __future__ import annotations

import argparse
import sys

import torch

from fixtures import case_from_id, make_inputs
from verify.checks import backend_fn
from verify.invariants import bitwise_equal, first_difference
from verify.runner import run

# Cases whose tiles differ most in cost or count: one huge sequence among tiny ones, power-law lengths,
# > 65,535 sequences, many tiny ones (packed tiles), broadcast-Q (dq reduced over sequences), causal q != kv.
SCHEDULING_CASES = ("one_huge_many_tiny:100", "power_law:100", "many_tiny:100", "grid_limit:200",
                    "broadcast_q:100", "causal_q_ne_kv:100", "gem_like:100")


def repeat(backend: str, case_id: str, runs: int, deterministic: bool, device: torch.device) -> list[str]:
    """Differences between the first run and each later one (empty when all are bitwise equal)."""
    fn, _ = backend_fn(backend)
    inputs = make_inputs(case_from_id(case_id), device)
    args = (inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, inputs.dout, inputs.kwargs)
    first = run(fn, *args, backward=True, deterministic=deterministic)
    names = ("out", "lse", "dq", "dk", "dv") if deterministic else ("out", "lse", "dk", "dv")
    problems = []
    for index in range(1, runs):
        again = run(fn, *args, backward=True, deterministic=deterministic)
        problems += [f"run {index}: {name}: {first_difference(getattr(first, name), getattr(again, name))}"
                     for name in names if not bitwise_equal(getattr(first, name), getattr(again, name))]
        if problems:
            break
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--deterministic", action="store_true", help="also require dq bitwise (deterministic=True)")
    parser.add_argument("--case", action="append", default=[], help=f"default: {', '.join(SCHEDULING_CASES)}")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    failed = 0
    for case_id in args.case or SCHEDULING_CASES:
        problems = repeat(args.backend, case_id, args.runs, args.deterministic, device)
        failed += bool(problems)
        verdict = "identical" if not problems else "DIFFERS: " + problems[0]
        print(f"{args.backend} {case_id}: {args.runs} runs{' (deterministic)' if args.deterministic else ''} {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
