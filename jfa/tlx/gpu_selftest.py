"""Self-test and benchmark of the TLX forward on an H100/H200: `python -m jfa.tlx.gpu_selftest`.

Needs fbtriton on the path (on the lent H200: unpack the carried bundle to /tmp/fbt and
`export PYTHONPATH=/tmp/fbt:$PWD`). For ~20 varied cases (jagged, empty sequences, causal with q != kv,
window, GQA, broadcast_q, logits of 133120, D 64/128, fp16 with a negative scale, long 4096 and GEM-like
batches, mixed tiny/long batches, layouts) it runs the TLX backend's forward and prints one line per case:
the path taken (`config`), max |err|/bound of out and lse against the float64 reference (reference.exact;
pass <= 2, the CPU tests' threshold), max |tlx - triton| of out and lse, and exact checks (empty rows out 0 /
lse -inf, bitwise reproducibility, the expected path). Some cases also run the backward (the tlx backend's:
the Triton backward fed the TLX residuals, with the TLX dK/dV pass where it covers the head dims) against the
reference, and print max |tlx - triton| of dq, dk and dv (0 where the TLX pass reproduces the Triton one's
bits, as it did on jfa.bench's rows; informative, not a pass criterion).

Cases run in --jobs worker processes (their compilations overlap). Every case catches its own exceptions; a
CUDA error ends its worker (the context is lost), and a case still running after --hang-after seconds is
reported as a hang (a barrier deadlock never returns) and ends its worker. Then, unless --no-bench, the
forward of tlx, triton and torch's varlen_attn is timed alone on the GPU with triton.testing.do_bench on long
(8 × 4096, H 16) and GEM-like (1024 × U[400, 1000), H 4), D 128, bf16, and TFLOP/s printed (4·pairs·D per
head, visible pairs only). Exits 0 only if every case passes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import threading
import time
import traceback

from jfa.selftest_workers import run_workers

MAX_BOUND_RATIO = 2.0


def _u(rng, n, lo, hi):
    return [int(x) for x in rng.integers(lo, hi, n)]


def case_list():
    """(name, builder(rng) -> spec) pairs; spec: lengths, heads, dims, dtype, values, kwargs, checks."""
    import torch

    def c(q, kv, hq=4, hkv=4, d=128, dv=None, dtype=torch.bfloat16, values="normal", path="tlx",
          backward=False, check=None, **kwargs):
        return dict(q_lens=q, kv_lens=kv, hq=hq, hkv=hkv, d=d, dv=dv or d, dtype=dtype, values=values, path=path,
                    backward=backward, check=check, kwargs=kwargs)

    return [
        ("smoke_one_tile", lambda r: c([128], [128])),
        ("gem_like", lambda r: c(*(2 * [_u(r, 24, 400, 1000)]), backward=True)),
        ("block_edges", lambda r: c([127, 128, 129, 255, 256, 257, 65, 383], [129, 128, 127, 257, 256, 255, 66, 385])),
        ("jagged_empty_causal_gqa", lambda r: c([0, 5, 200, 0, 130, 1, 77, 300], [3, 0, 190, 0, 400, 1, 0, 260], 4, 2,
                                                causal=True, backward=True)),
        ("causal_q_gt_kv", lambda r: c([300, 500, 129], [100, 60, 128], causal=True)),
        ("causal_q_lt_kv", lambda r: c([100, 300, 257], [500, 700, 300], causal=True)),
        ("window", lambda r: c(*(2 * [_u(r, 8, 65, 500)]), window=37)),
        ("window_causal_q_ne_kv", lambda r: c(_u(r, 8, 65, 600), _u(r, 8, 65, 600), window=100, causal=True,
                                              backward=True)),
        ("gqa8_d64_causal", lambda r: c(_u(r, 10, 65, 700), _u(r, 10, 65, 700), 8, 1, 64, causal=True,
                                        backward=True)),
        ("broadcast_q", lambda r: c([128] * 12, _u(r, 12, 100, 700), broadcast_q=True, backward=True)),
        ("broadcast_q_causal_empty", lambda r: c([100] * 9, [0, 50, 100, 3, 0, 700, 64, 1, 129], causal=True,
                                                 broadcast_q=True)),
        ("huge_logits_133120", lambda r: c(*(2 * [_u(r, 6, 65, 400)]), values="huge", backward=True)),
        ("logits_below_-5e4_d64", lambda r: c(*(2 * [_u(r, 6, 65, 400)]), 2, 2, 64, values="very_negative")),
        ("fp16_negative_scale", lambda r: c(*(2 * [_u(r, 8, 65, 500)]), dtype=torch.float16, sm_scale=-0.06,
                                            backward=True)),
        ("fp16_d64_window_causal", lambda r: c(*(2 * [_u(r, 8, 65, 500)]), 4, 2, 64, dtype=torch.float16,
                                               window=64, causal=True, backward=True)),
        ("long_4096_causal", lambda r: c([4096, 4096], [4096, 4096], 8, 8, causal=True)),
        ("long_4096_d64", lambda r: c([4096, 3000], [4096, 4500], 4, 2, 64)),
        ("skew_mixed_tiny", lambda r: c([2048] + _u(r, 200, 1, 65), [2048] + _u(r, 200, 1, 65), 4, 4, causal=True,
                                        backward=True)),
        ("no_keys_fill", lambda r: c([300, 200], [0, 0], path="fill")),
        ("q_empty_kv_long", lambda r: c([0, 100, 0], [500, 0, 70], backward=True)),
        ("all_tiny_routes_triton", lambda r: c(*(2 * [_u(r, 2000, 1, 33)]), path="triton")),
        ("d80_routes_triton", lambda r: c(*(2 * [_u(r, 6, 1, 300)]), 4, 2, 80, path="triton")),
        ("layouts_in_place_and_copied", lambda r: c(_u(r, 7, 0, 400), _u(r, 7, 0, 400), 4, 2, check="layouts",
                                                    causal=True)),
        ("batch_invariance", lambda r: c([700, 20, 0, 333, 9, 64, 130], [650, 31, 5, 333, 60, 65, 129], 4, 2,
                                         check="invariance", window=300, causal=True)),
    ]


# ---------------------------------------------------------------------------------------------------------
# One case


def _offsets(lens, device):
    import torch

    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out.to(device)


def _inputs(spec, seed, device):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = spec["q_lens"], spec["kv_lens"]
    broadcast = spec["kwargs"].get("broadcast_q", False)
    q_rows = q_lens[0] if broadcast else sum(q_lens)
    shapes = [(q_rows, spec["hq"], spec["d"]), (sum(kv_lens), spec["hkv"], spec["d"]),
              (sum(kv_lens), spec["hkv"], spec["dv"]), (sum(q_lens), spec["hq"], spec["dv"])]
    q, k, v, dout = (torch.randn(*s, generator=gen) for s in shapes)
    if spec["values"] == "huge":
        q, k, v = (torch.full_like(x, 133120.0) for x in (q, k, v))
    elif spec["values"] == "very_negative":
        q, k = (q.abs() + 4) * 32, -(k.abs() + 4) * 32
    q, k, v, dout = (x.to(spec["dtype"]).to(device) for x in (q, k, v, dout))
    return q, k, v, None if broadcast else _offsets(q_lens, device), _offsets(kv_lens, device), dout


def _problem(q, k, v, q_off, kv_off, kw):
    from jfa.validation import validate

    return validate(q, k, v, q_off, kv_off, max_q_len=None, max_kv_len=None, sm_scale=kw.get("sm_scale"),
                    window=kw.get("window"), causal=kw.get("causal", False),
                    broadcast_q=kw.get("broadcast_q", False), deterministic=False)


def bound_ratio(got, want, bound):
    """(max |got - want| / bound, why not finite): -inf entries of `want` must be matched exactly."""
    import torch

    got, want, bound = got.double(), want.double(), bound.double()
    if torch.isnan(got).any():
        return math.inf, "NaN"
    inf = torch.isinf(want)
    if not torch.equal(got[inf], want[inf]):
        return math.inf, "-inf not matched"
    if not torch.isfinite(got[~inf]).all():
        return math.inf, "non-finite"
    err, b = (got[~inf] - want[~inf]).abs(), bound[~inf]
    if (err[b == 0] > 0).any():
        return math.inf, "error where the bound is 0"
    return (float((err[b > 0] / b[b > 0]).max()) if (b > 0).any() else 0.0), ""


def _max_diff(a, b):
    import torch

    a, b = a.double(), b.double()
    both = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return math.inf
    return float((a[both] - b[both]).abs().max()) if both.any() else 0.0


def _empty_rows(spec, device):
    """bool [out_rows]: rows with no visible key."""
    import torch

    from jfa.mask import visible_torch

    kw = spec["kwargs"]
    parts = []
    for q_len, kv_len in zip(spec["q_lens"], spec["kv_lens"], strict=True):
        i, j = torch.arange(q_len).view(-1, 1), torch.arange(kv_len).view(1, -1)
        parts.append(~visible_torch(i, j, q_len, kv_len, kw.get("window"), kw.get("causal", False))
                     .expand(q_len, kv_len).any(1))
    return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.bool, device=device)


def run_case(name, spec, seed, device):
    """Returns (line, ok)."""
    import torch

    import jfa
    from jfa.tlx.backend import BACKEND
    from jfa.triton.backend import BACKEND as TRITON
    from reference.exact import reference

    start = time.perf_counter()
    kw = spec["kwargs"]
    q, k, v, q_off, kv_off, dout = _inputs(spec, seed, device)
    problem = _problem(q, k, v, q_off, kv_off, kw)
    path = BACKEND.config(problem)["path"]
    problems = [] if path == spec["path"] else [f"path {path}, expected {spec['path']}"]
    out, lse, _ = BACKEND.forward(q, k, v, problem)
    torch.cuda.synchronize()
    cells = []
    # reference.exact cannot take a batch without key rows; every row is then empty, checked exactly below.
    ref = reference(q, k, v, problem, dout if spec["backward"] else None).tensors() if problem.kv_rows else {}
    for n, got in (("out", out), ("lse", lse)) if ref else ():
        ratio, why = bound_ratio(got, ref[n][0], ref[n][1])
        cells.append(f"{n}={ratio:.2f}")
        if why or ratio > MAX_BOUND_RATIO:
            problems.append(f"{n}: {why or f'bound ratio {ratio:.3g}'}")
    t_out, t_lse, _ = TRITON.forward(q, k, v, problem)
    cells.append(f"|tlx-triton| out {_max_diff(out, t_out):.1e} lse {_max_diff(lse, t_lse):.1e}")
    empty = _empty_rows(spec, device)
    if not ((out[empty] == 0).all() and torch.isneginf(lse[:, empty]).all()):
        problems.append("empty rows not out=0/lse=-inf")
    again, again_lse, _ = BACKEND.forward(q, k, v, problem)
    if not (torch.equal(again, out) and torch.equal(again_lse, lse)):
        problems.append("not bitwise reproducible")
    if spec["backward"]:
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = jfa.attention(*leaves, q_off, kv_off, backend="tlx", **kw)
        o.backward(dout)
        t_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        jfa.attention(*t_leaves, q_off, kv_off, backend="triton", **kw).backward(dout)
        diffs = []
        for n, leaf, t_leaf in zip(("dq", "dk", "dv"), leaves, t_leaves, strict=True):
            ratio, why = bound_ratio(leaf.grad, ref[n][0], ref[n][1])
            cells.append(f"{n}={ratio:.2f}")
            diffs.append(f"{n} {_max_diff(leaf.grad, t_leaf.grad):.1e}")
            if why or ratio > MAX_BOUND_RATIO:
                problems.append(f"{n}: {why or f'bound ratio {ratio:.3g}'}")
        cells.append("|tlx-triton| " + " ".join(diffs))
    if spec["check"] == "layouts":
        problems += _check_layouts(q, k, v, problem, out, lse)
    elif spec["check"] == "invariance":
        problems += _check_invariance(spec, q, k, v, kw, out, lse, device)
    line = f"{name:30s} [{path:6s}] " + " ".join(cells)
    return _finish(line, problems, start)


def _finish(line, problems, start):
    ok = not problems
    line = f"{'ok  ' if ok else 'FAIL'} {line}  ({time.perf_counter() - start:.1f}s)"
    if problems:
        line += "\n       " + "; ".join(problems)
    return line, ok


def _check_layouts(q, k, v, problem, out, lse):
    """Bitwise the same from fused-QKV slices with NaN tails and a padded q head stride (read in place by
    TMA) and from a q whose head dim is strided (copied)."""
    import torch

    from jfa.tlx.backend import BACKEND, descriptor_layout

    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    nan = float("nan")
    fused = torch.full((tk + 9, 3, hkv, d), nan, dtype=q.dtype, device=q.device)
    fused[:tk, 1], fused[:tk, 2] = k, v
    padded = torch.full((tq + 5, hq, d + 40), nan, dtype=q.dtype, device=q.device)
    padded[:tq, :, 8:8 + d] = q
    strided = torch.full((tq, hq, 2 * d), nan, dtype=q.dtype, device=q.device)
    strided[:, :, ::2] = q
    found = []
    views = (padded[:tq, :, 8:8 + d], fused[:tk, 1], fused[:tk, 2])
    if any(descriptor_layout(x) is None for x in views):
        found.append("a TMA-readable layout was not read in place")
    for label, (qq, kk, vv) in (("fused/padded", views), ("strided head dim", (strided[:, :, ::2], k, v))):
        got, got_lse, _ = BACKEND.forward(qq, kk, vv, problem)
        if not (torch.equal(got, out) and torch.equal(got_lse, lse)):
            found.append(f"{label} layout changes the results")
    return found


def _check_invariance(spec, q, k, v, kw, out, lse, device):
    """A sequence alone, in the batch and in the reversed batch: bitwise equal out and lse."""
    import torch

    from jfa.tlx.backend import BACKEND

    q_lens, kv_lens = spec["q_lens"], spec["kv_lens"]

    def starts(lens):
        return [sum(lens[:i]) for i in range(len(lens))]

    qs, ks = starts(q_lens), starts(kv_lens)

    def run(order):
        lq, lk = [q_lens[i] for i in order], [kv_lens[i] for i in order]
        qq = torch.cat([q[qs[i]:qs[i] + q_lens[i]] for i in order])
        kk = torch.cat([k[ks[i]:ks[i] + kv_lens[i]] for i in order])
        vv = torch.cat([v[ks[i]:ks[i] + kv_lens[i]] for i in order])
        qo, ko = _offsets(lq, device), _offsets(lk, device)
        o, l_, _ = BACKEND.forward(qq, kk, vv, _problem(qq, kk, vv, qo, ko, kw))
        pos = starts(lq)
        return {b: (o[pos[p]:pos[p] + q_lens[b]], l_[:, pos[p]:pos[p] + q_lens[b]]) for p, b in enumerate(order)}

    whole = {b: (out[qs[b]:qs[b] + q_lens[b]], lse[:, qs[b]:qs[b] + q_lens[b]]) for b in range(len(q_lens))}
    permuted = run(list(range(len(q_lens)))[::-1])
    found = []
    for b in range(len(q_lens)):
        alone = run([b])[b]
        for label, other in (("alone", alone), ("reversed batch", permuted[b])):
            if not all(torch.equal(x, y) for x, y in zip(other, whole[b], strict=True)):
                found.append(f"seq {b}: {label} != batch")
    return found


# ---------------------------------------------------------------------------------------------------------
# Benchmark


def bench(device, seed: int = 0) -> None:
    import numpy as np
    import torch
    from triton.testing import do_bench

    from jfa.peers import TORCH_VARLEN
    from jfa.tlx.backend import BACKEND
    from jfa.triton.backend import BACKEND as TRITON

    rng = np.random.default_rng(seed)
    rows = (("long 8x4096 H16", [4096] * 8, 16), ("gem 1024xU[400,1000) H4", _u(rng, 1024, 400, 1000), 4))
    print("forward, bf16, D 128, non-causal; TFLOP/s = 4·pairs·D·H / time (do_bench mean)")
    for label, lens, heads in rows:
        spec = dict(q_lens=lens, kv_lens=lens, hq=heads, hkv=heads, d=128, dv=128, dtype=torch.bfloat16,
                    values="normal", kwargs={})
        q, k, v, q_off, kv_off, _ = _inputs(spec, seed, device)
        problem = _problem(q, k, v, q_off, kv_off, {})
        flops = 4 * sum(n * n for n in lens) * 128 * heads
        cells = []
        for name, fn in (("tlx", BACKEND.forward), ("triton", TRITON.forward), ("torch-varlen", TORCH_VARLEN)):
            try:
                ms = do_bench(functools.partial(fn, q, k, v, problem))
                cells.append(f"{name} {flops / ms / 1e9:6.1f} TFLOP/s ({ms:.3f} ms)")
            except Exception as error:  # noqa: BLE001 - a failing peer is reported, not fatal
                cells.append(f"{name} failed: {type(error).__name__}: {str(error)[:200]}")
        print(f"  {label:26s} " + " | ".join(cells), flush=True)


# ---------------------------------------------------------------------------------------------------------
# Driver: cases run in worker processes (their kernel compilations overlap); the parent prints their lines
# as they come and then runs the benchmark alone on the GPU.


def _worker(index: int, jobs: int, only: list[str] | None, hang_after: float) -> int:
    """Runs cases index, index + jobs, ... and prints one JSON line per case."""
    import numpy as np
    import torch

    device = torch.device("cuda")
    failures = 0
    for position, (name, build) in enumerate(case_list()):
        if position % jobs != index or (only and name not in only):
            continue

        def hang(name=name):
            print(json.dumps({"line": f"FAIL {name:30s} no result after {hang_after:.0f}s: hang (barrier "
                                      f"deadlock?); worker stopped", "ok": False}), flush=True)
            os._exit(3)

        timer = threading.Timer(hang_after, hang)
        timer.daemon = True
        timer.start()
        try:
            line, ok = run_case(name, build(np.random.default_rng(position)), position, device)
        except Exception as error:  # noqa: BLE001 - a crash is a failed case
            line, ok = f"FAIL {name:30s} crashed: {type(error).__name__}: {error}\n{traceback.format_exc()}", False
            if "CUDA" in str(error):
                print(json.dumps({"line": line + "\n       CUDA error: context lost, worker stopped", "ok": False}),
                      flush=True)
                return 1
        finally:
            timer.cancel()
        failures += not ok
        print(json.dumps({"line": line, "ok": ok}), flush=True)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--no-bench", action="store_true", help="skip the timings")
    parser.add_argument("--hang-after", type=float, default=100.0, help="seconds before a case counts as hung")
    parser.add_argument("--autotune", action="store_true", help="let the Triton backend autotune (slower)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.autotune:
        os.environ.setdefault("JFA_TRITON_AUTOTUNE", "0")
    if args.worker:
        index, jobs = (int(x) for x in args.worker.split("/"))
        return _worker(index, jobs, args.case, args.hang_after)

    import torch
    import triton

    from jfa.tlx.backend import BACKEND

    if not torch.cuda.is_available():
        print("no CUDA device: the GPU self-test needs one (python -m jfa.tlx.compile_check needs none)")
        return 2
    device = torch.device("cuda")
    reason = BACKEND.unavailable(device)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"tlx: {reason or 'available'}; {args.jobs} worker processes; ratios are max |err|/bound, pass <= "
          f"{MAX_BOUND_RATIO}", flush=True)
    if reason:
        return 2
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "jfa.tlx.gpu_selftest", "--hang-after", str(args.hang_after)]
    cmd += [a for c in (args.case or []) for a in ("--case", c)]
    passed, failed = run_workers(cmd, args.jobs, expected_exit=(0, 1, 3))  # 3: a hang, already reported
    verdict = "PASS" if failed == 0 and passed else "FAIL"
    print(f"{verdict}: {passed} passed, {failed} failed in {time.perf_counter() - start:.0f}s", flush=True)
    if not args.no_bench:
        try:
            bench(device)
        except Exception as error:  # noqa: BLE001 - report, keep the verdict
            print(f"benchmark crashed: {type(error).__name__}: {error}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
