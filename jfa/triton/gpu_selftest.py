"""Self-test of the Triton backend on a CUDA GPU: `python -m jfa.triton.gpu_selftest`.

Runs jfa.attention(backend="triton") forward and backward on a few dozen varied small and medium cases
(jagged, empty sequences, broadcast_q, GQA, window, causal, huge logits, head dims 64-256, fp16, > 65,535
sequences, NaN tails, fused-QKV and large-stride layouts) and compares with the float64 reference
(reference.exact, componentwise bound) and the bf16 model (reference.bf16_model, the same-dtype
baseline). One line per case: max |err|/bound of out, lse, dq, dk, dv for the kernel (and for the bf16
model, as context), then exact checks (empty rows, unseen keys, bitwise invariances, a NaN in one packed
sequence's inputs leaving the others' outputs). Prints PASS/FAIL
and exits 0 only if every case passes. Cases run in parallel worker processes (--jobs) so that Triton's
compilations overlap; autotuning is off unless --autotune (it would add a benchmark per kernel variant).

`--compile-only` needs no GPU: it compiles every kernel variant for sm_90 with the installed triton and
prints ptxas registers, spill bytes, shared memory and SASS size per kernel (a CPU-side check that the kernel
source compiles on the GPU machine's triton version and keeps its register budget, and of what a change does to
its loops); `--head-dims 256 192/128` limits it to those head dims (the config class just retuned).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from jfa.selftest_workers import run_workers
from jfa.triton import compiled

MAX_BOUND_RATIO = 2.0  # the CPU tests' threshold (tests/test_triton_backend.py says why)
NAMES = ("out", "lse", "dq", "dk", "dv")


# ---------------------------------------------------------------------------------------------------------
# Cases


def _u(rng, n, lo, hi):
    return [int(x) for x in rng.integers(lo, hi, n)]


INV_Q = [700, 20, 0, 333, 9, 64, 12, 30, 5, 16]
INV_KV = [650, 31, 5, 333, 60, 65, 14, 28, 16, 7]


def case_list():
    """(name, builder) pairs; builder(rng) -> dict(q_lens, kv_lens, hq, hkv, d, dv, dtype, kwargs, ...)."""
    import torch

    bf16, fp16 = torch.bfloat16, torch.float16

    def c(q, kv, hq=4, hkv=4, d=128, dv=None, dtype=bf16, values="normal", check="reference", **kwargs):
        return dict(q_lens=q, kv_lens=kv, hq=hq, hkv=hkv, d=d, dv=dv or d, dtype=dtype, values=values,
                    check=check, kwargs=kwargs)

    cases = [
        ("gem_like", lambda r: c(*(2 * [_u(r, 24, 400, 1000)]))),
        ("jagged_empty_causal_gqa", lambda r: c([0, 5, 200, 0, 130, 1, 77], [3, 0, 190, 0, 400, 1, 0], 4, 2,
                                                causal=True)),
        ("causal_q_gt_kv", lambda r: c([300, 50, 129], [100, 60, 128], causal=True)),
        ("window", lambda r: c(*(2 * [_u(r, 8, 50, 500)]), window=37)),
        ("window_causal", lambda r: c(_u(r, 8, 50, 500), _u(r, 8, 50, 500), window=100, causal=True)),
        ("broadcast_q", lambda r: c([128] * 12, _u(r, 12, 100, 700), broadcast_q=True)),
        ("broadcast_q_causal_empty", lambda r: c([100] * 9, [0, 50, 100, 3, 0, 700, 64, 1, 129], causal=True,
                                                 broadcast_q=True)),
        ("gqa8_d64_causal", lambda r: c(_u(r, 10, 1, 600), _u(r, 10, 1, 600), 8, 1, 64, causal=True)),
        ("d80_window", lambda r: c(*(2 * [_u(r, 10, 1, 300)]), 4, 2, 80, window=20)),
        ("d96_fp16_causal", lambda r: c(*(2 * [_u(r, 10, 1, 300)]), 2, 2, 96, dtype=fp16, causal=True)),
        ("d192", lambda r: c(*(2 * [_u(r, 6, 1, 300)]), 2, 1, 192)),
        ("d256_causal", lambda r: c(*(2 * [_u(r, 6, 1, 300)]), 2, 2, 256, causal=True)),
        ("d128_dv64", lambda r: c(*(2 * [_u(r, 10, 1, 400)]), 4, 2, 128, 64)),
        ("d8_dv24", lambda r: c(*(2 * [_u(r, 10, 1, 200)]), 2, 1, 8, 24)),
        ("fp16_negative_scale", lambda r: c(*(2 * [_u(r, 8, 1, 500)]), dtype=fp16, sm_scale=-0.06)),
        ("huge_logits_133120", lambda r: c(*(2 * [_u(r, 6, 1, 400)]), values="huge")),
        ("logits_below_-5e4", lambda r: c(*(2 * [_u(r, 6, 1, 400)]), 2, 2, 64, values="very_negative")),
        ("values_x8", lambda r: c(*(2 * [_u(r, 8, 1, 400)]), values="x8", causal=True)),
        ("tiny_packed", lambda r: c(*(2 * [_u(r, 3000, 1, 33)]))),
        ("tiny_packed_causal_gqa", lambda r: c(_u(r, 3000, 0, 65), _u(r, 3000, 0, 65), 4, 2, causal=True)),
        ("skew", lambda r: c([4096] + _u(r, 300, 1, 65), [4096] + _u(r, 300, 1, 65), 8, 8, causal=True)),
        ("many_sequences_70000", lambda r: c(*(2 * [_u(r, 70000, 0, 100)]), 4, 2, 64)),
        ("nan_tails_and_strides", lambda r: c(*(2 * [_u(r, 7, 0, 300)]), 4, 2, check="layouts", causal=True)),
        ("rows_times_stride_over_2^31", lambda r: c([600, 1], [700, 5], 1, 1, 64, check="big_strides")),
        ("schedules_and_determinism", lambda r: c(_u(r, 30, 0, 700), _u(r, 30, 0, 700), 4, 2,
                                                  check="schedules", causal=True)),
        # Ordinary sequences and packed ones of every slot class; reversing the batch moves the packed
        # sequences to other slots of their tiles (class 16: sequences 2, 6, 8, 9; class 32: 1, 7).
        ("batch_invariance", lambda r: c(INV_Q, INV_KV, 4, 2, check="invariance")),
        ("batch_invariance_window", lambda r: c(INV_Q, INV_KV, 4, 2, check="invariance", window=40,
                                                causal=True)),
        ("empty_batches", lambda r: c([], [], check="empty")),
        # Packed tiles of 2-4 sequences (and a causal GQA variant): the forward's redo per poisoned tensor.
        ("nan_isolation_packed", lambda r: c(*(2 * [_u(r, 400, 1, 33)]), check="isolation")),
        ("nan_isolation_packed_causal_gqa", lambda r: c(*(2 * [_u(r, 400, 1, 65)]), 4, 2, check="isolation",
                                                        causal=True)),
    ]
    return cases


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

    gen = torch.Generator(device="cpu").manual_seed(seed)
    q_lens, kv_lens = spec["q_lens"], spec["kv_lens"]
    broadcast = spec["kwargs"].get("broadcast_q", False)
    q_rows = (q_lens[0] if q_lens else 0) if broadcast else sum(q_lens)
    shapes = [(q_rows, spec["hq"], spec["d"]), (sum(kv_lens), spec["hkv"], spec["d"]),
              (sum(kv_lens), spec["hkv"], spec["dv"]), (sum(q_lens), spec["hq"], spec["dv"])]
    q, k, v, dout = (torch.randn(*s, generator=gen) for s in shapes)
    values = spec["values"]
    if values == "huge":
        q, k, v = (torch.full_like(x, 133120.0) for x in (q, k, v))
    elif values == "very_negative":
        q, k = (q.abs() + 4) * 32, -(k.abs() + 4) * 32
    elif values == "x8":
        q, k = q * 8, k * 8
    q, k, v, dout = (x.to(spec["dtype"]).to(device) for x in (q, k, v, dout))
    q_off = None if broadcast else _offsets(q_lens, device)
    return q, k, v, q_off, _offsets(kv_lens, device), dout


def _run(q, k, v, q_off, kv_off, dout, **kwargs):
    import jfa

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = jfa.attention(*leaves, q_off, kv_off, backend="triton", return_lse=True, **kwargs)
    out.backward(dout)
    return {"out": out.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def _ratio(got, want, bound):
    import torch

    got, want, bound = got.double(), want.double(), bound.double()
    if torch.isnan(got).any():
        return math.inf, math.inf, "NaN"
    inf = torch.isinf(want)
    if not torch.equal(got[inf], want[inf]):
        return math.inf, math.inf, "-inf lse not matched"
    if not torch.isfinite(got[~inf]).all():
        return math.inf, math.inf, "non-finite"
    err = (got[~inf] - want[~inf]).abs()
    if err.numel() == 0:
        return 0.0, 0.0, ""
    b = bound[~inf]
    if (err[b == 0] > 0).any():
        return math.inf, float(err.max()), "error where the bound is 0"
    ratio = float((err[b > 0] / b[b > 0]).max()) if (b > 0).any() else 0.0
    return ratio, float(err.max()), ""


def _exact_checks(spec, got):
    """Empty rows: out 0, lse -inf, dq 0; keys no query sees: dk = dv = 0."""
    import torch

    from jfa.mask import visible_torch

    kw = spec["kwargs"]
    window, causal, broadcast = kw.get("window"), kw.get("causal", False), kw.get("broadcast_q", False)
    rows_any, keys_seen = [], []
    for q_len, kv_len in zip(spec["q_lens"], spec["kv_lens"], strict=True):
        i = torch.arange(q_len).view(-1, 1)
        j = torch.arange(kv_len).view(1, -1)
        mask = visible_torch(i, j, q_len, kv_len, window, causal).expand(q_len, kv_len)
        rows_any.append(mask.any(1))
        keys_seen.append(mask.any(0))
    if not rows_any:
        return []
    rows_any, keys_seen = torch.cat(rows_any).to(got["out"].device), torch.cat(keys_seen).to(got["out"].device)
    problems = []
    empty = ~rows_any
    if not ((got["out"][empty] == 0).all() and torch.isneginf(got["lse"][:, empty]).all()):
        problems.append("empty rows not out=0/lse=-inf")
    if broadcast:
        never = ~rows_any.view(len(spec["q_lens"]), -1).any(0)
        if not (got["dq"][never] == 0).all():
            problems.append("dq of never-attending rows not 0")
    elif not (got["dq"][empty] == 0).all():
        problems.append("dq of empty rows not 0")
    if not ((got["dk"][~keys_seen] == 0).all() and (got["dv"][~keys_seen] == 0).all()):
        problems.append("dk/dv of unseen keys not 0")
    return problems


def _bitwise(a, b):
    import torch

    return all(torch.equal(a[n], b[n]) for n in NAMES)


def run_case(name, spec, seed, device):
    """Returns (line, ok)."""
    import torch

    from jfa.problem import Problem  # noqa: F401
    from jfa.triton import backend
    from jfa.validation import validate
    from reference import bf16_model
    from reference.exact import reference

    start = time.perf_counter()
    kw = dict(spec["kwargs"])
    q, k, v, q_off, kv_off, dout = _inputs(spec, seed, device)
    check = spec["check"]
    problems = []
    if check == "empty":
        for lens_q, lens_kv, bq in (([], [], False), ([0, 0], [3, 40], False), ([4, 70], [0, 0], False),
                                    ([5, 5], [0, 0], True), ([], [], True)):
            sp = dict(spec, q_lens=lens_q, kv_lens=lens_kv, kwargs={"broadcast_q": bq})
            if bq and not lens_q:
                sp["q_lens"] = []
            qq, kk, vv, qo, ko, do = _inputs(sp, seed, device)
            if bq and not lens_q:
                qq = torch.randn(5, spec["hq"], spec["d"], device=device).to(spec["dtype"])
            got = _run(qq, kk, vv, qo, ko, do, broadcast_q=bq)
            if got["dq"].shape != qq.shape or got["dk"].shape != kk.shape:
                problems.append(f"shapes for {lens_q}/{lens_kv}")
            for n in NAMES:
                if torch.isnan(got[n]).any():
                    problems.append(f"NaN in {n} for {lens_q}/{lens_kv}")
            if sum(lens_q) == 0 and not ((got["dk"] == 0).all() and (got["dv"] == 0).all() and
                                         (got["dq"] == 0).all()):
                problems.append("gradients of a call without query rows are not 0")
        line = f"{name:34s} {'shapes/zeros':>60s}"
        return _finish(line, problems, start)

    got = _run(q, k, v, q_off, kv_off, dout, **kw)
    problem = validate(q, k, v, q_off, kv_off, max_q_len=None, max_kv_len=None, window=kw.get("window"),
                       causal=kw.get("causal", False), broadcast_q=kw.get("broadcast_q", False),
                       sm_scale=kw.get("sm_scale"), deterministic=False)
    ref = reference(q, k, v, problem, dout)
    tensors = ref.tensors()
    ratios, errors = {}, {}
    for n in NAMES:
        want, bound = tensors[n][0], tensors[n][1]
        ratios[n], errors[n], why = _ratio(got[n], want, bound)
        if why:
            problems.append(f"{n}: {why}")
        elif ratios[n] > MAX_BOUND_RATIO:
            problems.append(f"{n} bound ratio {ratios[n]:.3g}")
    problems += _exact_checks(spec, got)

    # The bf16 model (FlashAttention-2 rounding points) on the same case, for context.
    model_ratio = {}
    if sum(spec["q_lens"]) * max(spec["kv_lens"] or [0]) < 3e7:
        with torch.no_grad():
            out_m, lse_m, res_m = bf16_model.BACKEND.forward(q, k, v, problem)
            dq_m, dk_m, dv_m = bf16_model.BACKEND.backward(dout, q, k, v, out_m, lse_m, res_m, problem)
        model = {"out": out_m, "lse": lse_m, "dq": dq_m, "dk": dk_m, "dv": dv_m}
        for n in NAMES:
            model_ratio[n] = _ratio(model[n], tensors[n][0], tensors[n][1])[0]

    if check == "layouts":
        problems += _check_layouts(q, k, v, q_off, kv_off, dout, kw, got)
    elif check == "big_strides":
        problems += _check_big_strides(q, k, v, q_off, kv_off, dout, kw, got)
    elif check == "schedules":
        for mode, programs in (("static", None), ("static", 7), ("grid", None), ("dynamic", 3), ("dynamic", None)):
            backend.set_schedule(mode, programs)
            try:
                again = _run(q, k, v, q_off, kv_off, dout, deterministic=True, **kw)
            finally:
                backend.set_schedule(None)
            if not _bitwise(again, got):
                problems.append(f"schedule {mode}/{programs} differs bitwise")
    elif check == "invariance":
        problems += _check_invariance(spec, q, k, v, dout, kw, got, device)
    elif check == "isolation":
        problems += _check_isolation(spec, q, k, v, q_off, kv_off, dout, kw, got)
    if spec["q_lens"] and max(spec["q_lens"]) > 0 and check == "reference":
        again = _run(q, k, v, q_off, kv_off, dout, **kw)
        if not _bitwise(again, got):
            problems.append("not bitwise reproducible")

    cells = " ".join(f"{n}={ratios[n]:.2f}" + (f"/{model_ratio[n]:.2f}" if n in model_ratio else "") for n in NAMES)
    err = max(errors.values())
    line = f"{name:34s} {cells}  max|err|={err:.2e}"
    return _finish(line, problems, start)


def _finish(line, problems, start):
    ok = not problems
    line = f"{'ok  ' if ok else 'FAIL'} {line}  ({time.perf_counter() - start:.1f}s)"
    if problems:
        line += "\n       " + "; ".join(problems)
    return line, ok


def _check_layouts(q, k, v, q_off, kv_off, dout, kw, plain):
    """NaN rows past offsets[-1], fused-QKV slices and a non-contiguous dout: bitwise the same."""
    import torch

    tq, tk = q.shape[0], k.shape[0]
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    nan = float("nan")
    fused = torch.full((tk + 9, 3, hkv, d), nan, dtype=q.dtype, device=q.device)
    fused[:tk, 1], fused[:tk, 2] = k, v
    big_q = torch.full((tq + 5, hq, d + 40), nan, dtype=q.dtype, device=q.device)
    big_q[:tq, :, 8:8 + d] = q
    big_do = torch.full((tq + 3, hq, 3, dout.shape[2]), nan, dtype=q.dtype, device=q.device)
    big_do[:tq, :, 2] = dout
    odd = _run(big_q[:tq, :, 8:8 + d], fused[:tk, 1], fused[:tk, 2], q_off, kv_off, big_do[:tq, :, 2], **kw)
    return [] if _bitwise(odd, plain) else ["strided / NaN-tailed inputs change the results"]


def _check_big_strides(q, k, v, q_off, kv_off, dout, kw, plain):
    """q and dout as views whose rows × stride pass 2^31 elements (int64 addressing)."""
    import torch

    stride = (1 << 22) - 64  # just below the host's copy-to-contiguous threshold
    tq = q.shape[0]
    if tq * stride < 2**31:
        return ["case too small to pass 2^31"]
    out = []
    for name, x in (("q", q), ("dout", dout)):
        big = torch.empty(tq * stride, dtype=x.dtype, device=x.device)
        view = big.as_strided(x.shape, (stride, x.shape[2], 1))
        view.copy_(x)
        args = dict(q=q, dout=dout)
        args[name] = view
        got = _run(args["q"], k, v, q_off, kv_off, args["dout"], **kw)
        del big, view
        if not _bitwise(got, plain):
            out.append(f"{name} with rows x stride > 2^31 differs")
    return out


def _check_isolation(spec, q, k, v, q_off, kv_off, dout, kw, plain):
    """A NaN in one row of the q, k, v or dout of the middle sequence (or the next with query and key rows), one
    tensor at a time: every other sequence's out and lse bitwise as in `plain` (the packed forward redoes a tile
    with a non-finite output, each row summed over its own slot). The gradients are not compared: the packed
    backward's known gap (README)."""
    import torch

    lengths = list(zip(spec["q_lens"], spec["kv_lens"], strict=True))
    middle = len(lengths) // 2
    b = next((i for i in [*range(middle, len(lengths)), *range(middle)] if min(lengths[i]) > 0), None)
    if b is None:
        return ["the isolation check needs a sequence with query and key rows"]
    others = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    others[int(q_off[b]):int(q_off[b + 1])] = False
    problems = []
    for name in ("q", "k", "v", "dout"):
        inputs = dict(q=q, k=k, v=v, dout=dout)
        x = inputs[name] = inputs[name].clone()
        x[int((kv_off if name in ("k", "v") else q_off)[b]), :, 0] = float("nan")
        got = _run(inputs["q"], inputs["k"], inputs["v"], q_off, kv_off, inputs["dout"], **kw)
        if not (torch.equal(got["out"][others], plain["out"][others])
                and torch.equal(got["lse"][:, others], plain["lse"][:, others])):
            problems.append(f"a NaN in sequence {b}'s {name} changed other sequences' out or lse")
    return problems


def _check_invariance(spec, q, k, v, dout, kw, batch, device):
    """A sequence alone, in the batch and in the permuted batch: bitwise equal."""
    import torch

    q_lens, kv_lens = spec["q_lens"], spec["kv_lens"]

    def slices(lens):
        s, out = 0, []
        for n in lens:
            out.append(slice(s, s + n))
            s += n
        return out

    qs, ks = slices(q_lens), slices(kv_lens)

    def run(order):
        lq, lk = [q_lens[i] for i in order], [kv_lens[i] for i in order]
        res = _run(torch.cat([q[qs[i]] for i in order]), torch.cat([k[ks[i]] for i in order]),
                   torch.cat([v[ks[i]] for i in order]), _offsets(lq, device), _offsets(lk, device),
                   torch.cat([dout[qs[i]] for i in order]), **kw)
        sq, sk = slices(lq), slices(lk)
        return {b: {"out": res["out"][sq[p]], "lse": res["lse"][:, sq[p]], "dq": res["dq"][sq[p]],
                    "dk": res["dk"][sk[p]], "dv": res["dv"][sk[p]]} for p, b in enumerate(order)}

    whole = run(list(range(len(q_lens))))
    perm = list(range(len(q_lens)))[::-1]
    permuted = run(perm)
    problems = []
    for b in range(len(q_lens)):
        alone = run([b])[b]
        for n in NAMES:
            if not torch.equal(alone[n], whole[b][n]):
                problems.append(f"seq {b} {n}: alone != batch")
            if not torch.equal(permuted[b][n], whole[b][n]):
                problems.append(f"seq {b} {n}: permuted != batch")
    return problems


# ---------------------------------------------------------------------------------------------------------
# Compile-only check (no GPU)


def compile_check(quick: bool = False, arch: int = 90, head_dims: list[tuple[int, int]] | None = None) -> bool:
    """Compiles every kernel variant (`jfa.triton.compiled.variants`) for sm_<arch> with this triton; prints
    ptxas registers and spills, shared memory and SASS size (`jfa.triton.compiled.Usage`). head_dims: only these
    (D, Dv) pairs (e.g. the config class just retuned)."""
    from jfa.triton import backend
    from jfa.triton.compiled import ptxas_usage, variants

    if backend.interpreting():
        print("unset TRITON_INTERPRET to compile the kernels")
        return False
    ok = True
    for variant in variants(quick, head_dims):
        start = time.perf_counter()
        try:
            usage = ptxas_usage(variant, arch)
        except Exception as error:  # noqa: BLE001 - report every failure
            print(f"FAIL {variant.label}: {type(error).__name__}: {str(error)[:1500]}")
            ok = False
            continue
        print(f"ok   {variant.label:60s} {usage}  ({time.perf_counter() - start:.1f}s)")
    print("COMPILE PASS" if ok else "COMPILE FAIL")
    return ok


def shrink(spec):
    """The same case at interpreter size (--small, for checking this script on a CPU): at most 10
    sequences of at most 40 rows."""
    spec = dict(spec)
    q, kv = spec["q_lens"][:10], spec["kv_lens"][:10]
    spec["q_lens"] = [min(x, 40) for x in q]
    spec["kv_lens"] = [min(x, 40) for x in kv]
    return spec


def _worker(index: int, jobs: int, only: list[str] | None, device_name: str, small: bool) -> int:
    import torch

    device = torch.device(device_name)
    failures = 0
    for position, (name, build) in enumerate(case_list()):
        if position % jobs != index or (only and name not in only):
            continue
        if small and name == "rows_times_stride_over_2^31":
            continue
        import numpy as np

        rng = np.random.default_rng(position)
        try:
            spec = build(rng)
            line, ok = run_case(name, shrink(spec) if small else spec, position, device)
        except Exception as error:  # noqa: BLE001 - a crash is a failed case
            import traceback

            line, ok = f"FAIL {name:34s} crashed: {type(error).__name__}: {error}\n{traceback.format_exc()}", False
        failures += not ok
        print(json.dumps({"line": line, "ok": ok}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="with --compile-only: head dim 128 only")
    parser.add_argument("--head-dims", nargs="+", metavar="D[/DV]",
                        help="with --compile-only: only these head dims (e.g. 192 256/128)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--autotune", action="store_true", help="keep triton.autotune on (slower)")
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: check this script
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # interpreter-size cases
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.compile_only:
        try:
            dims = compiled.parse_head_dims(args.head_dims or [])
        except ValueError as error:
            parser.error(str(error))
        return 0 if compile_check(args.quick, head_dims=dims) else 1
    if not args.autotune:
        os.environ.setdefault("JFA_TRITON_AUTOTUNE", "0")
    if args.worker:
        index, jobs = (int(x) for x in args.worker.split("/"))
        return 1 if _worker(index, jobs, args.case, args.device, args.small) else 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the GPU self-test needs one (use --compile-only for a CPU-side compile check)")
        return 2
    import triton

    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{where}  torch {torch.__version__}  triton {triton.__version__}  "
          f"cases run in {args.jobs} processes; ratios are max |err|/bound (kernel/bf16 model), pass <= "
          f"{MAX_BOUND_RATIO}", flush=True)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "jfa.triton.gpu_selftest"]
    cmd += [a for c in (args.case or []) for a in ("--case", c)] + ["--device", args.device]
    cmd += ["--small"] if args.small else []
    passed, failed = run_workers(cmd, args.jobs)
    total = time.perf_counter() - start
    verdict = "PASS" if failed == 0 and passed > 0 else "FAIL"
    print(f"{verdict}: {passed} passed, {failed} failed in {total:.0f}s")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
