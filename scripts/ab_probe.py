"""A/B of the Triton kernels of two trees (or more) on one GPU (the `ab` stage of scripts/gpu_session.sh).

    PYTHONPATH=TREE python scripts/ab_probe.py measure TAG OUT.jsonl ROW [ROW ...]
    python scripts/ab_probe.py summary OUT.jsonl [--kernel NAME]

`measure` runs the `triton` op (or, with the row option `tlx`, the `tlx` one: fbtriton must come first on
the path) of the tree first on PYTHONPATH on jfa.bench's rows (bf16, D 128, seed 0), forward and
forward+backward, as `python -m jfa.triton.tune` times the shipped op: do_bench ms of the op and the
profiler's device ms of each jfa kernel (Triton's and TLX's) over five calls; then a SHA-1 per pass, of the
forward's outputs and of the gradients (without dq for a backend that adds it in no fixed order, the tlx
backend's default mode: its bits differ between runs of one tree). One JSON line per (row, pass), tagged
`SIDE:ROUND` (e.g. base:1, mine:1). ROW is a bench row with options after colons: `causal`, `wN` (window N),
`grid`/`static`/`dynamic` (the Triton tile schedule), `tlx`, e.g. gem:causal, gem:w256, tiny:grid, long:tlx.

`summary` prints per row and pass the jfa kernels' device ms of each side (mean over rounds), their ratio
(mine / base; below 1 is faster), the same ratio of all the device's work (torch's kernels and copies too) and of
the op's do_bench ms, and whether the two sides' outputs (fwd) and gradients (fwd+bwd) are bitwise
the same ("not comparable" where one side's backend leaves dq out of its digest and the other's does not).
With sides beyond base and mine (candidate trees, tagged by name), one such table per side against base, each
under a line naming it. `--kernel NAME` compares only the device ms of the jfa kernels whose name contains NAME
(e.g. short_ws_kernel), where one kernel's change would drown in the sum of all.

The stage alternates the sides round by round on one machine (run-to-run spread on the H200 is several
percent between machines and up to ±8% between runs): the figures of docs/performance-log.md's "Causal and
window" section came from this script (2026-11-30, two rounds).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import defaultdict

PASSES = (("fwd", "fwd"), ("fwd+bwd", "dq"))  # (pass, the jfa.triton.tune role whose call runs it)


def row_options(spec: str) -> dict:
    """'gem:causal:w256:grid' -> {'row': 'gem', 'causal': True, 'window': 256, 'schedule': 'grid',
    'backend': 'triton'}."""
    row, *opts = spec.split(":")
    parsed = dict(row=row, causal=False, window=None, schedule=None, backend="triton")
    for opt in opts:
        if opt == "causal":
            parsed["causal"] = True
        elif opt == "tlx":
            parsed["backend"] = "tlx"
        elif opt in ("grid", "static", "dynamic"):
            parsed["schedule"] = opt
        elif opt.startswith("w") and opt[1:].isdigit():
            parsed["window"] = int(opt[1:])
        else:
            raise ValueError(f"row option {opt!r} of {spec!r}: causal, wN, grid/static/dynamic or tlx")
    return parsed


def measure(tag: str, out: str, specs: list[str]) -> None:
    import torch

    from jfa.bench import row_inputs
    from jfa.triton import tune
    from jfa.triton.backend import set_schedule
    from verify.checks import invariance_waivers

    for spec in specs:
        opts = row_options(spec)
        set_schedule(opts["schedule"])
        inputs, kwargs, _ = row_inputs(opts["row"], torch.bfloat16, 128, 0, torch.device("cuda"),
                                       causal=opts["causal"], window=opts["window"])
        calls = tune._calls(inputs, kwargs, opts["backend"])
        unordered_dq = "dq_order" in invariance_waivers(opts["backend"], torch.device("cuda"))
        bits = pass_digests(calls["fwd"](), calls["dq"](), unordered_dq)
        with open(out, "a") as f:
            for name, role in PASSES:
                record = dict(tune._time_op(spec, name, calls[role], 5), tag=tag, bits=bits[name],
                              dq_compared=name == "fwd" or not unordered_dq)
                print(f"{tag:8s} {spec:16s} {name:8s} op {record['op_ms']:8.3f} kernels {record['kernels_ms']:8.3f}",
                      flush=True)
                f.write(json.dumps(record) + "\n")
        set_schedule(None)
        del inputs, calls
        torch.cuda.empty_cache()


def pass_digests(outputs, grads, unordered_dq: bool) -> dict[str, str]:
    """SHA-1 per pass: the forward's outputs for "fwd", the gradients (dq, dk, dv) for "fwd+bwd", leaving dq out
    when the backend adds it in no fixed order (it declares the `dq_order` waiver: then dq's bits differ from run
    to run of one tree, and would hide whether dk and dv moved)."""

    import torch

    def digest(tensors) -> str:
        sha = hashlib.sha1()
        for t in tensors:
            sha.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return sha.hexdigest()

    return {"fwd": digest(outputs), "fwd+bwd": digest(grads[1:] if unordered_dq else grads)}


def _side(record: dict) -> str:
    """The side a record was measured on: its tag's part before the colon (base:1 -> base)."""
    return record["tag"].split(":")[0]


def sides(records: list[dict]) -> list[str]:
    """The sides compared with base, in the order they were first measured."""
    return list(dict.fromkeys(_side(r) for r in records if _side(r) != "base"))


def summary(records: list[dict], side: str = "mine", kernel: str | None = None) -> list[str]:
    """Table lines: per (row, pass), base's and `side`'s mean kernel ms over their rounds (only of the kernels whose
    name contains `kernel`, when given), side/base, the same ratio of all the device's work (`device`: torch's
    kernels too, e.g. the zero-fills a change may add or remove) and of the op's do_bench time (`op`; "-" where a
    side's records lack it), and the bits."""
    ms, bits, compared = defaultdict(list), defaultdict(set), defaultdict(set)
    for r in records:
        name = _side(r)
        if name not in ("base", side):
            continue
        if kernel is not None:  # None where the record has no such kernel
            r = dict(r, kernels_ms=sum(v for k, v in r.get("by_kernel", {}).items() if kernel in k) or None)
        for key in ("kernels_ms", "device_ms", "op_ms"):
            ms[r["row"], r["op"], name, key].append(r.get(key))
        bits[r["row"], r["op"]].add(r["bits"])
        compared[r["row"], r["op"]].add(r.get("dq_compared", True))

    def mean(row, op, name, key):
        values = ms.get((row, op, name, key))
        return None if not values or None in values else sum(values) / len(values)

    def ratio(row, op, key):
        base, mine = mean(row, op, "base", key), mean(row, op, side, key)
        return "-" if base is None or mine is None or not base else f"{mine / base:.3f}"

    lines = [f"{'row':16s} {'pass':8s} {'base ms':>9s} {side + ' ms':>9s} {side + '/base':>9s} {'device':>7s} "
             f"{'op':>7s}  bits"]
    for row, op in bits:  # the (row, pass) pairs of base's and side's records, in record order
        b, m = mean(row, op, "base", "kernels_ms"), mean(row, op, side, "kernels_ms")
        if b is None or m is None:
            missing = "(one side only)" if kernel is None else f"(one side only, or no {kernel} kernel)"
            lines.append(f"{row:16s} {op:8s} {missing:>29s}")
            continue
        if len(compared[row, op]) > 1:  # one side's backend waives dq_order, the other's not: other tensors digested
            same = "not comparable (dq in one side's digests only)"
        else:
            same = "same" if len(bits[row, op]) == 1 else "DIFFER"
            if compared[row, op] == {False}:
                same += " (dk, dv; dq is added in no fixed order)"
        lines.append(f"{row:16s} {op:8s} {b:9.3f} {m:9.3f} {m / b:9.3f} {ratio(row, op, 'device_ms'):>7s} "
                     f"{ratio(row, op, 'op_ms'):>7s}  {same}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "measure":
        measure(argv[1], argv[2], argv[3:])
        return 0
    if len(argv) in (2, 4) and argv[0] == "summary" and argv[2:3] in ([], ["--kernel"]):
        with open(argv[1]) as f:
            records = [json.loads(line) for line in f if line.strip()]
        kernel = argv[3] if len(argv) == 4 else None
        candidates = sides(records)
        for side in candidates:
            if len(candidates) > 1:
                print(f"{side} against base" + (f" ({kernel} only)" if kernel else ""))
            print("\n".join(summary(records, side, kernel)))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
