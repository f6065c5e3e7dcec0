"""Repeat a backend many times on chosen cases and require bitwise-identical outputs: races in persistent
schedulers (tiles skipped or run twice under perturbed timing, FAILURES.md) show up as run-to-run
differences, which a single comparison against the reference can miss.

    python -m verify.repeat --backend triton --runs 200 [--deterministic] [--perturb] [--case ID ...]

On an idle GPU every run starts alike, so a race may take the same turn each time. With --perturb (CUDA only),
each run after the first starts while a second stream's matrix products of a random size and count hold the
SMs, after a random delay: a persistent kernel's programs then begin as those products' blocks retire, at other
moments from run to run, so a tile counter deals its tiles in other orders and atomics interleave otherwise
(flashinfer #5252 was wrong only under perturbed timing).
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


class Contention:
    """Before each call (`__call__`): matrix products on a second stream, 1 to 4 of a size from 512 to 4096
    (bf16; at most about 0.2 ms each at the H200's 709 TFLOP/s), then a wait of 0 to 2·10⁶ cycles (up to about a
    millisecond) on the call's stream, all drawn from `seed`, so that the call's kernels start at a random point
    of them."""

    def __init__(self, device: torch.device, seed: int):
        if device.type != "cuda":
            raise ValueError(f"--perturb needs a CUDA device (the runs are on {device})")
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.generator = torch.Generator().manual_seed(seed)

    def _draw(self, low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=self.generator))

    def __call__(self) -> None:
        with torch.cuda.stream(self.stream):
            size = self._draw(512, 4096)
            a = torch.ones(size, size, dtype=torch.bfloat16, device=self.device)
            for _ in range(self._draw(1, 4)):
                a = (a @ a).mul_(1 / size)  # stays near one: no overflow, however many products
        torch.cuda._sleep(self._draw(0, 2_000_000))


def repeat(backend: str, case_id: str, runs: int, deterministic: bool, device: torch.device,
           perturb=None) -> list[str]:
    """Differences between the first run and each later one (empty when all are bitwise equal); `perturb`,
    when given, is called before each later run (`Contention`)."""
    fn, _ = backend_fn(backend)
    inputs = make_inputs(case_from_id(case_id), device)
    args = (inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, inputs.dout, inputs.kwargs)
    first = run(fn, *args, backward=True, deterministic=deterministic)
    names = ("out", "lse", "dq", "dk", "dv") if deterministic else ("out", "lse", "dk", "dv")
    problems = []
    for index in range(1, runs):
        if perturb is not None:
            perturb()
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
    parser.add_argument("--perturb", action="store_true",
                        help="start each later run amid other work on the GPU (CUDA only; the module's docstring)")
    parser.add_argument("--seed", type=int, default=0, help="of --perturb's draws (default 0)")
    parser.add_argument("--case", action="append", default=[], help=f"default: {', '.join(SCHEDULING_CASES)}")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        perturb = Contention(device, args.seed) if args.perturb else None
    except ValueError as error:
        parser.error(str(error))
    modes = "".join(f" ({mode})" for mode, on in (("deterministic", args.deterministic), ("perturbed", args.perturb))
                    if on)
    failed = 0
    for case_id in args.case or SCHEDULING_CASES:
        problems = repeat(args.backend, case_id, args.runs, args.deterministic, device, perturb)
        failed += bool(problems)
        verdict = "identical" if not problems else "DIFFERS: " + problems[0]
        print(f"{args.backend} {case_id}: {args.runs} runs{modes} {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
