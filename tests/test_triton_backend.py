"""The Triton backend's real kernel code under the CPU interpreter (TRITON_INTERPRET=1), small sizes.

TRITON_INTERPRET is read when a Triton function is decorated, i.e. when triton (and jfa) are first
imported. This module sets it before importing them; if another module of the same pytest process imported
triton first (without the interpreter), the in-process tests skip with that reason and
`test_in_subprocess` runs this module again in a fresh interpreter-enabled Python instead. A
tests/conftest.py that sets `os.environ.setdefault("TRITON_INTERPRET", "1")` before any import (CPU runs)
makes the in-process path the normal one.

Accuracy is judged against the float64 reference (reference.exact) with its componentwise bound: the max
over elements of |error| / bound must be <= MAX_BOUND_RATIO for out, lse, dq, dk and dv. Exact properties
(empty rows, unseen keys, NaN tails, batch invariance, determinism, schedules) are checked bitwise.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

_TRITON_WAS_IMPORTED = "triton" in sys.modules
if not _TRITON_WAS_IMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import jfa  # noqa: E402
from jfa import tile_scheduler as ts  # noqa: E402
from jfa.block_info import kv_block_range, kv_block_range_np, q_block_range, q_block_range_np  # noqa: E402
from jfa.mask import visible_torch  # noqa: E402
from jfa.tile_scheduler import tile_at  # noqa: E402
from jfa.triton import backend as triton_backend  # noqa: E402
from jfa.triton.backend import ISOLATION_GRAD_GAP  # noqa: E402
from jfa.triton.forward import packed_visible  # noqa: E402
from reference.exact import reference  # noqa: E402
from tests.helpers import interpreter_unavailable, offsets, problem_of  # noqa: E402

SKIP_REASON = interpreter_unavailable()
needs_interpreter = pytest.mark.skipif(SKIP_REASON is not None, reason=f"{SKIP_REASON}; see test_in_subprocess")

# The bound of reference.exact is first-order in u (the input dtype's unit roundoff) and models the
# rounding points this kernel shares with the bf16 model (P and dS rounded to the input dtype before their
# products, D from the rounded output, outputs rounded once); the bf16 model sits at <= ~0.9 of it on such
# cases. What the kernel does differently is fp32-level only: other summation orders (tree sums, blocked
# online softmax with its alpha rescaling), exp2 with c = fp32(|scale|·log2 e), 1/l multiplies. Each
# perturbs a result by O(n·u32) relative (n <= a few hundred here: < 1e-4, i.e. < 3% of u = 2^-8 for
# bf16 and < 20% of u = 2^-11 for fp16), and the second-order terms the model drops are O(n·u²). Together
# they stay well inside a factor 2, while a missing rescale, an off-by-one mask or a wrong head mapping
# gives ratios of 10 to 1e6.
MAX_BOUND_RATIO = 2.0

NAMES = ("out", "lse", "dq", "dk", "dv")


@pytest.fixture(autouse=True)
def small_blocks():
    """16/32 blocks: many block boundaries at these sizes (the shipped 64-128 blocks cover most of them in
    one block; the verify suite runs those)."""
    if SKIP_REASON is not None:
        yield
        return
    from jfa.triton import backend

    backend.set_config(backend.SMALL_BLOCKS)
    yield
    backend.set_config(None)


# ---------------------------------------------------------------------------------------------------------
# Helpers


def make_inputs(q_lens, kv_lens, hq, hkv, d, dv, dtype=torch.bfloat16, broadcast_q=False, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q_rows = q_lens[0] if broadcast_q and q_lens else sum(q_lens)
    out_rows = sum(q_lens)
    tk = sum(kv_lens)

    def draw(*shape):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    q, k, v = draw(q_rows, hq, d), draw(tk, hkv, d), draw(tk, hkv, dv)
    dout = torch.randn(out_rows, hq, dv, generator=gen).to(dtype)
    q_off = None if broadcast_q else offsets(q_lens)
    return q, k, v, q_off, offsets(kv_lens), dout


def run_triton(q, k, v, q_off, kv_off, dout, **kwargs):
    """out, lse, dq, dk, dv from jfa.attention(backend='triton')."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = jfa.attention(*leaves, q_off, kv_off, backend="triton", return_lse=True, **kwargs)
    out.backward(dout)
    return {"out": out.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def visibility(q_lens, kv_lens, window, causal, broadcast_q):
    """(row has a visible key, per output row) and (key seen by some query, per kv row), brute force."""
    rows_any, keys_seen = [], []
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        i = torch.arange(q_len).view(-1, 1)
        j = torch.arange(kv_len).view(1, -1)
        mask = visible_torch(i, j, q_len, kv_len, window, causal).expand(q_len, kv_len)
        rows_any.append(mask.any(1) if kv_len else torch.zeros(q_len, dtype=torch.bool))
        keys_seen.append(mask.any(0) if q_len else torch.zeros(kv_len, dtype=torch.bool))
    return torch.cat(rows_any) if rows_any else torch.zeros(0, dtype=torch.bool), \
        torch.cat(keys_seen) if keys_seen else torch.zeros(0, dtype=torch.bool)


def bound_ratio(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    got, want, bound = got.double(), want.double(), bound.double()
    assert not torch.isnan(got).any(), "NaN in a result"
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]), "an infinite reference value (empty row) is not matched exactly"
    assert torch.isfinite(got[~inf]).all(), "a non-finite result where the reference is finite"
    err = (got[~inf] - want[~inf]).abs()
    if err.numel() == 0:
        return 0.0
    b = bound[~inf]
    assert (err[b == 0] == 0).all(), "nonzero error where the bound is 0"
    return float((err[b > 0] / b[b > 0]).max()) if (b > 0).any() else 0.0


def check_against_reference(q_lens, kv_lens, hq, hkv, d, dv, *, dtype=torch.bfloat16, seed=0, scale=1.0,
                            broadcast_q=False, window=None, causal=False, sm_scale=None):
    q, k, v, q_off, kv_off, dout = make_inputs(q_lens, kv_lens, hq, hkv, d, dv, dtype, broadcast_q, seed, scale)
    kwargs = dict(window=window, causal=causal, broadcast_q=broadcast_q, sm_scale=sm_scale)
    got = run_triton(q, k, v, q_off, kv_off, dout, **kwargs)
    problem = problem_of(q, k, v, q_off, kv_off, **kwargs)
    ref = reference(q, k, v, problem, dout)
    ratios = {}
    for name in NAMES:
        want, bound = ref.tensors()[name][:2]
        assert got[name].shape == want.shape, name
        ratios[name] = bound_ratio(got[name], want, bound)
    worst = max(ratios.values())
    assert worst <= MAX_BOUND_RATIO, f"bound ratios {ratios}"

    # Exact values: rows with no visible key, keys no query sees.
    rows_any, keys_seen = visibility(q_lens, kv_lens, window, causal, broadcast_q)
    empty = ~rows_any
    assert (got["out"][empty] == 0).all() and torch.isneginf(got["lse"][:, empty]).all()
    if broadcast_q:
        never = ~rows_any.view(len(q_lens), -1).any(0) if q_lens else torch.zeros(0, dtype=torch.bool)
        assert (got["dq"][never] == 0).all()
    else:
        assert (got["dq"][empty] == 0).all()
    assert (got["dk"][~keys_seen] == 0).all() and (got["dv"][~keys_seen] == 0).all()
    return ratios, got


def random_lengths(rng: np.random.Generator, batch: int, longest: int, empty_fraction: float = 0.2):
    lens = rng.integers(1, longest + 1, size=batch)
    lens[rng.random(batch) < empty_fraction] = 0
    return [int(x) for x in lens]


# ---------------------------------------------------------------------------------------------------------
# Accuracy against the float64 reference


# (seed, batch, longest q, longest kv, heads q/kv, D, Dv, dtype, mask, broadcast, sm_scale, value scale)
CASES = [
    (1, 4, 40, 40, (2, 1), 16, 16, torch.bfloat16, {}, False, None, 1.0),
    (2, 3, 70, 50, (2, 2), 32, 24, torch.bfloat16, {"causal": True}, False, None, 1.0),
    (3, 5, 30, 60, (4, 2), 24, 40, torch.float16, {"window": 5}, False, None, 1.0),
    (4, 3, 50, 50, (3, 1), 16, 16, torch.bfloat16, {"causal": True, "window": 7}, False, -0.4, 1.0),
    (5, 4, 20, 70, (2, 1), 16, 8, torch.bfloat16, {}, True, None, 1.0),
    (6, 3, 45, 40, (2, 2), 16, 16, torch.bfloat16, {"causal": True}, True, None, 1.0),
    (7, 6, 12, 12, (2, 1), 8, 16, torch.bfloat16, {}, False, None, 3.0),
    (8, 2, 90, 20, (2, 1), 16, 16, torch.float16, {"causal": True}, False, 0.3, 1.0),
    (9, 3, 40, 40, (2, 1), 80, 80, torch.bfloat16, {"window": 0}, False, None, 1.0),
    # Sharp softmax: logits with standard deviation ~64, probabilities and some dk, dv subnormal.
    (10, 3, 40, 40, (2, 2), 128, 128, torch.bfloat16, {"causal": True}, False, None, 8.0),
]


@needs_interpreter
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{c[0]}" for c in CASES])
def test_matches_reference(case):
    seed, batch, lq, lkv, (hq, hkv), d, dv, dtype, mask, broadcast, sm_scale, scale = CASES[case]
    rng = np.random.default_rng(seed)
    kv_lens = random_lengths(rng, batch, lkv)
    q_lens = [int(rng.integers(1, lq + 1))] * batch if broadcast else random_lengths(rng, batch, lq)
    check_against_reference(q_lens, kv_lens, hq, hkv, d, dv, dtype=dtype, seed=seed, scale=scale,
                            broadcast_q=broadcast, sm_scale=sm_scale, **mask)


@needs_interpreter
@pytest.mark.parametrize("seed", [12, 13])
def test_packed_tiles_of_64_rows(seed, monkeypatch):
    """Packed tiles of 64 rows, as the H200's packed forward and its D <= 64 packed backward have them: eight
    slots of 8, four of 16, two of 32, one of 64, so a tile's slot entries and its 8-row entries differ
    (`PackTable.row_seqs`, which the forward reads; the backward reads the slot entries), unlike SMALL_BLOCKS'
    32-row tiles, where a backward given the row table would read the same sequences. Both against the
    reference, on lengths drawn over every slot class (a few of each, so most tiles hold several)."""
    from jfa.triton import backend

    tile = backend.KernelConfig(64, 64, 4, (1,))
    monkeypatch.setattr(backend, "_config_override",
                        dataclasses.replace(backend.SMALL_BLOCKS, packed_fwd=tile, packed_bwd=tile))
    rng = np.random.default_rng(seed)
    # The slot classes, four sequences each: q_len in the class, kv_len <= it.
    longest = np.repeat([n for n in (8, 16, 32, 64) if n >= ts.PACK_ALIGN], 4)
    q_lens = [int(rng.integers(n // 2 + 1 if n > ts.PACK_ALIGN else 1, n + 1)) for n in longest]
    kv_lens = [int(rng.integers(1, n + 1)) for n in longest]
    check_against_reference(q_lens, kv_lens, 2, 1, 16, 16, seed=seed, causal=True)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_edge_lengths(dtype):
    """Zero-length sequences on either side, kv = 0 with q > 0, causal q > kv (leading empty rows),
    lengths at block edges (16 ± 1, 32 ± 1) and longer than the packed tiles."""
    q_lens = [0, 17, 5, 0, 33, 15, 3, 31]
    kv_lens = [4, 0, 16, 0, 15, 33, 1, 47]
    check_against_reference(q_lens, kv_lens, 2, 1, 16, 16, dtype=dtype, seed=11, causal=True)


@needs_interpreter
def test_huge_logits():
    """q = k = v = 133120 (logits ~2e11): finite and right; an FMA-contracted qk·scale - m·scale fails."""
    lens = [5, 40, 17]
    q, k, v, q_off, kv_off, dout = make_inputs(lens, lens, 2, 1, 32, 32, seed=3)
    q, k, v = (torch.full_like(x, 133120.0) for x in (q, k, v))
    got = run_triton(q, k, v, q_off, kv_off, dout)
    assert (got["out"] == 133120.0).all()
    problem = problem_of(q, k, v, q_off, kv_off)
    ref = reference(q, k, v, problem, dout)
    for name in NAMES:
        want, bound = ref.tensors()[name][:2]
        assert bound_ratio(got[name], want, bound) <= MAX_BOUND_RATIO, name


@needs_interpreter
def test_logits_below_minus_5e4():
    """Every logit < -5e4 (a finite -5e4 initial max would zero these rows)."""
    lens_q, lens_kv = [9, 33], [20, 40]
    q, k, v, q_off, kv_off, dout = make_inputs(lens_q, lens_kv, 2, 1, 16, 16, seed=4)
    q = ((q.float().abs() + 4.0) * 32).to(q.dtype)
    k = (-(k.float().abs() + 4.0) * 32).to(k.dtype)  # every logit <= -16 · 128 · 128 / 4 = -65536
    problem = problem_of(q, k, v, q_off, kv_off)
    ref = reference(q, k, v, problem, dout)
    assert float(ref.tensors()["lse"][0].max()) < -5e4
    got = run_triton(q, k, v, q_off, kv_off, dout)
    for name in NAMES:
        want, bound = ref.tensors()[name][:2]
        assert bound_ratio(got[name], want, bound) <= MAX_BOUND_RATIO, name


@needs_interpreter
def test_empty_batches():
    # B = 0
    q = torch.randn(0, 2, 16).bfloat16()
    k = torch.randn(0, 1, 16).bfloat16()
    got = run_triton(q, k, k, offsets([]), offsets([]), torch.zeros(0, 2, 16).bfloat16())
    assert got["out"].shape == (0, 2, 16) and got["lse"].shape == (2, 0)
    assert got["dq"].shape == q.shape and got["dk"].shape == k.shape
    # All sequences empty on the query side: nothing to compute, dk = dv = 0.
    q, k, v, q_off, kv_off, dout = make_inputs([0, 0], [3, 40], 2, 1, 16, 16, seed=5)
    got = run_triton(q, k, v, q_off, kv_off, dout)
    assert got["out"].shape == (0, 2, 16) and (got["dk"] == 0).all() and (got["dv"] == 0).all()
    # No keys anywhere: out 0, lse -inf, dq 0.
    q, k, v, q_off, kv_off, dout = make_inputs([4, 70], [0, 0], 2, 1, 16, 16, seed=6)
    got = run_triton(q, k, v, q_off, kv_off, dout)
    assert (got["out"] == 0).all() and torch.isneginf(got["lse"]).all() and (got["dq"] == 0).all()
    # broadcast_q with B = 0: out is empty and dq of the shared queries is 0.
    q = torch.randn(5, 2, 16).bfloat16()
    got = run_triton(q, k[:0], v[:0], None, offsets([]), torch.zeros(0, 2, 16).bfloat16(), broadcast_q=True)
    assert got["out"].shape == (0, 2, 16) and (got["dq"] == 0).all() and got["dq"].shape == q.shape


# ---------------------------------------------------------------------------------------------------------
# Exact properties


def _slices(lens):
    starts = np.concatenate([[0], np.cumsum(lens)])
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]


@needs_interpreter
@pytest.mark.parametrize("mask", [{}, {"causal": True, "window": 9}])
def test_batch_invariance(mask):
    """A sequence's results are bitwise the same alone, inside a batch, and inside the permuted batch —
    for sequences of the ordinary path and of the packed path (in different slots)."""
    q_lens = [37, 5, 12, 0, 20, 3, 9]
    kv_lens = [41, 7, 12, 6, 3, 30, 9]
    q, k, v, q_off, kv_off, dout = make_inputs(q_lens, kv_lens, 4, 2, 16, 16, seed=7)
    qs, ks = _slices(q_lens), _slices(kv_lens)

    def run(order):
        lq, lk = [q_lens[i] for i in order], [kv_lens[i] for i in order]
        res = run_triton(torch.cat([q[qs[i]] for i in order]), torch.cat([k[ks[i]] for i in order]),
                         torch.cat([v[ks[i]] for i in order]), offsets(lq), offsets(lk),
                         torch.cat([dout[qs[i]] for i in order]), **mask)
        sq, sk = _slices(lq), _slices(lk)
        parts = {}
        for pos, b in enumerate(order):
            parts[b] = {"out": res["out"][sq[pos]], "lse": res["lse"][:, sq[pos]], "dq": res["dq"][sq[pos]],
                        "dk": res["dk"][sk[pos]], "dv": res["dv"][sk[pos]]}
        return parts

    batch = run(list(range(len(q_lens))))
    permuted = run([4, 2, 6, 0, 5, 1, 3])
    # Ordinary path (37 x 41) and packed slots of size 16 (sequence 2 sits in slot 1 of its tile in the
    # batch, slot 0 when permuted and alone) and 32.
    for b in (0, 1, 2, 5):
        alone = run([b])[b]
        for name in NAMES:
            assert torch.equal(alone[name], batch[b][name]), (b, name, "alone")
            assert torch.equal(permuted[b][name], batch[b][name]), (b, name, "permuted")


@needs_interpreter
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("tiles", "names", "flag_per_head"), [
    ("ordinary", NAMES, False), ("packed", ("out", "lse"), False), ("packed", ("out", "lse"), True),
    pytest.param("packed", ("dq", "dk", "dv"), False, marks=pytest.mark.xfail(
        strict=True, raises=AssertionError, reason=ISOLATION_GRAD_GAP))])
def test_a_nan_inside_one_sequence_stays_in_it(tiles, names, flag_per_head, seed, monkeypatch):
    """A NaN inside one sequence's q, k, v or dout leaves every other sequence's out, lse, dq, dk and dv
    bitwise as they were (and finite). Ordinary tiles load only their own sequence's rows. Packed tiles sum over
    their slots at weight 0: the forward redoes a tile whose output is not finite with the products isolated per
    slot (`jfa.triton.forward.slot_mma`), found by either form of its flag (`FLAG_PER_HEAD`: fbtriton's, which
    only this test runs on a CPU); the backward does not yet (strict xfail: it fails once it does).
    The verify suite's `isolation` and `isolation_grad` invariants check the same on the fuzzer's cases."""
    monkeypatch.setattr(triton_backend, "FLAG_PER_HEAD", flag_per_head)
    gen = torch.Generator().manual_seed(seed)
    # Packed: 3-5 sequences of one slot size (<= PACK_ALIGN rows), several per 32-row tile (SMALL_BLOCKS);
    # ordinary: longer than 32.
    low, high = (1, ts.PACK_ALIGN + 1) if tiles == "packed" else (33, 70)
    lens = torch.randint(low, high, (int(torch.randint(3, 6, (1,), generator=gen)),), generator=gen).tolist()
    q, k, v, q_off, kv_off, dout = make_inputs(lens, lens, 2, 2, 16, 16, seed=seed)
    base = run_triton(q, k, v, q_off, kv_off, dout)
    rows = _slices(lens)
    poisoned_seq = 1  # shares a packed tile with sequence 0
    for name in ("q", "k", "v", "dout"):
        inputs = dict(q=q, k=k, v=v, dout=dout)
        x = inputs[name] = inputs[name].clone()
        row = rows[poisoned_seq].start + int(torch.randint(lens[poisoned_seq], (1,), generator=gen))
        x[row, int(torch.randint(2, (1,), generator=gen)), int(torch.randint(16, (1,), generator=gen))] = float("nan")
        got = run_triton(inputs["q"], inputs["k"], inputs["v"], q_off, kv_off, inputs["dout"])
        for b, part in enumerate(rows):
            if b == poisoned_seq:
                continue
            for out_name in names:
                want = base[out_name][:, part] if out_name == "lse" else base[out_name][part]
                have = got[out_name][:, part] if out_name == "lse" else got[out_name][part]
                assert torch.equal(have, want) and torch.isfinite(have).all(), \
                    f"a NaN in sequence {poisoned_seq}'s {name} changed sequence {b}'s {out_name} (lengths {lens})"


@needs_interpreter
def test_gpu_selftest_isolation_check_at_interpreter_size():
    """The GPU self-test's NaN-isolation cases (`jfa.triton.gpu_selftest`), shrunk to interpreter size: every
    poisoned tensor leaves the other sequences' out and lse as they were."""
    import numpy as np

    from jfa.triton import gpu_selftest

    cases = dict(gpu_selftest.case_list())
    for name in ("nan_isolation_packed", "nan_isolation_packed_causal_gqa"):
        spec = gpu_selftest.shrink(cases[name](np.random.default_rng(0)))
        line, ok = gpu_selftest.run_case(name, dict(spec, d=16, dv=16), 0, "cpu")
        assert ok, line


@pytest.fixture
def nan_filled_allocations():
    """torch.empty returns NaN-filled memory (the verify suite's `verify.runner.nan_filled_allocations`), so
    an unwritten element shows."""
    from verify.runner import nan_filled_allocations

    with nan_filled_allocations():
        yield


@needs_interpreter
@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window": 6}, {"causal": True, "window": 4}])
@pytest.mark.parametrize("lengths", ["jagged", "broadcast_q", "no_visible_key"])
def test_short_query_backward(mask, lengths):
    """Sequences with 1 <= q_len <= the short block (32 here) and more keys than a packed tile hold, without
    GQA, take the one-pass backward (`_bwd_short_kernel`): right against the reference, exact zeros for keys
    no query sees (after the visited blocks with a window; before them when causal leaves every query
    without a key: no_visible_key's 60 x 20, with a 64-row short block), and bitwise the same alone as inside
    the batch. The lengths include a single query row, exactly the block, a longer sequence (two passes),
    packed ones (12 x 12; 30 queries without keys) and keys without queries (two passes)."""

    from jfa.triton import backend

    broadcast = lengths == "broadcast_q"
    if broadcast:
        q_lens, kv_lens, short = [23] * 5, [70, 0, 41, 33, 90], {0, 2, 3, 4}
    elif lengths == "jagged":
        q_lens, kv_lens, short = [23, 1, 32, 0, 40, 12, 30], [70, 90, 33, 45, 50, 12, 0], {0, 1, 2}
    else:
        backend.set_config(dataclasses.replace(backend.SMALL_BLOCKS, short_bwd=backend.KernelConfig(64, 16, 4, (1,))))
        q_lens, kv_lens, short = [60, 45], [20, 50], {0, 1}
    q, k, v, q_off, kv_off, dout = make_inputs(q_lens, kv_lens, 2, 2, 16, 24, broadcast_q=broadcast, seed=13)
    problem = problem_of(q, k, v, q_off, kv_off, broadcast_q=broadcast, **mask)
    routed = backend.device_schedule(problem, backend.config_for(problem)).host.short_bwd
    assert set(routed.entries[:, 0].tolist()) == short, "the premise: these sequences take the short path"
    _, got = check_against_reference(q_lens, kv_lens, 2, 2, 16, 24, broadcast_q=broadcast, seed=13, **mask)
    if broadcast:
        return  # dq sums over the batch: a sequence alone has another dq
    qs, ks = _slices(q_lens), _slices(kv_lens)
    for b in sorted(short)[::2]:
        alone = run_triton(q[qs[b]], k[ks[b]], v[ks[b]], offsets([q_lens[b]]), offsets([kv_lens[b]]), dout[qs[b]],
                           **mask)
        for name, part in (("out", qs[b]), ("dq", qs[b]), ("dk", ks[b]), ("dv", ks[b])):
            assert torch.equal(alone[name], got[name][part]), (b, name)
        assert torch.equal(alone["lse"], got["lse"][:, qs[b]]), (b, "lse")


@needs_interpreter
def test_offsets_written_in_place_between_calls():
    """A loop that reuses one offsets buffer, written in place with other lengths of the same totals between
    two calls: the second call's speculative problem (the remembered lengths) is found stale before its
    first launch and the call runs on the new lengths, as their float64 reference confirms."""
    q, k, v, q_off, kv_off, dout = make_inputs([5, 20, 9], [12, 3, 30], 2, 1, 16, 16, seed=21)
    run_triton(q, k, v, q_off, kv_off, dout)
    q_off.copy_(offsets([20, 5, 9]))
    kv_off.copy_(offsets([3, 30, 12]))
    got = run_triton(q, k, v, q_off, kv_off, dout)
    problem = problem_of(q, k, v, q_off, kv_off)
    assert problem.q_lens.tolist() == [20, 5, 9] and problem.kv_lens.tolist() == [3, 30, 12]
    ref = reference(q, k, v, problem, dout)
    ratios = {name: bound_ratio(got[name], *ref.tensors()[name][:2]) for name in NAMES}
    assert max(ratios.values()) <= MAX_BOUND_RATIO, f"bound ratios {ratios}"


@needs_interpreter
def test_offsets_made_invalid_in_place_launch_nothing(monkeypatch):
    """Offsets validated once, then written in place with values that break a rule: the call raises before
    any kernel is launched, also on the speculative problem the remembered values give."""
    from jfa.triton import forward as fwd_kernels

    q, k, v, q_off, kv_off, dout = make_inputs([5, 20, 9], [12, 3, 30], 2, 1, 16, 16, seed=22)
    run_triton(q, k, v, q_off, kv_off, dout)
    launched = []

    class Spy(type(fwd_kernels._fwd_kernel)):  # still an interpreted kernel to the backend's checks
        def __init__(self):  # noqa: D107 - nothing of the real kernel is needed
            pass

        def __getitem__(self, grid):
            launched.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(fwd_kernels, "_fwd_kernel", Spy())
    monkeypatch.setattr(fwd_kernels, "_fwd_packed_kernel", Spy())
    q_off.copy_(torch.tensor([0, 20, 15, 34], dtype=torch.int32))
    with pytest.raises(ValueError, match="q_offsets must be non-decreasing"):
        jfa.attention(q, k, v, q_off, kv_off, backend="triton")
    assert launched == []


@needs_interpreter
def test_schedules_and_determinism():
    """Static zigzag, dynamic and one-program-per-tile scheduling (with several grid sizes) give bitwise
    identical results, and repeated runs are bitwise identical."""
    from jfa.triton import backend

    q_lens, kv_lens = [45, 3, 0, 28, 60], [50, 64, 5, 28, 17]
    q, k, v, q_off, kv_off, dout = make_inputs(q_lens, kv_lens, 2, 1, 16, 16, seed=8)
    results = []
    try:
        for name, programs in (("dynamic", None), ("dynamic", 2), ("static", 1), ("static", 5), ("grid", None)):
            backend.set_schedule(name, programs)
            results.append(run_triton(q, k, v, q_off, kv_off, dout, causal=True, deterministic=True))
    finally:
        backend.set_schedule(None)
    results.append(run_triton(q, k, v, q_off, kv_off, dout, causal=True, deterministic=True))
    for res in results[1:]:
        for name in NAMES:
            assert torch.equal(res[name], results[0][name]), name


@needs_interpreter
@pytest.mark.parametrize("broadcast_q", [False, True])
def test_a_retained_graph_gives_its_gradients_again(broadcast_q):
    """backward(retain_graph=True) and a second backward over the same graph (as `jfa.bench` times the backward
    alone): the second call's gradients are the first's, bit for bit, and a fresh forward+backward's, so the
    backward leaves the tensors it saved as it found them."""
    rng = np.random.default_rng(21 + broadcast_q)
    kv_lens = random_lengths(rng, 4, 60)
    q_lens = [int(rng.integers(1, 40))] * 4 if broadcast_q else random_lengths(rng, 4, 60)
    q, k, v, q_off, kv_off, dout = make_inputs(q_lens, kv_lens, 2, 1, 16, 16, broadcast_q=broadcast_q,
                                               seed=int(rng.integers(1 << 30)))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = jfa.attention(*leaves, q_off, kv_off, backend="triton", broadcast_q=broadcast_q)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    second = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    fresh = run_triton(q, k, v, q_off, kv_off, dout, broadcast_q=broadcast_q)
    for name, a, b in zip(("dq", "dk", "dv"), first, second, strict=True):
        assert torch.equal(a, b) and torch.equal(a, fresh[name]), name


@needs_interpreter
def test_nan_tails_and_strided_layouts():
    """Inputs that are views into larger NaN-filled allocations (rows past offsets[-1]), a fused-QKV
    slice, and a non-contiguous dout with large strides give bitwise the same results as contiguous ones."""
    q_lens, kv_lens = [30, 4, 0, 19], [25, 9, 3, 40]
    hq, hkv, d = 2, 2, 16
    q, k, v, q_off, kv_off, dout = make_inputs(q_lens, kv_lens, hq, hkv, d, d, seed=9)
    plain = run_triton(q, k, v, q_off, kv_off, dout, causal=True)

    tq, tk = q.shape[0], k.shape[0]
    fused = torch.full((tk + 7, 3, hkv, d), float("nan"), dtype=q.dtype)  # fused K/V buffer with a NaN tail
    fused[:tk, 1], fused[:tk, 2] = k, v
    big_q = torch.full((tq + 5, hq, d + 8), float("nan"), dtype=q.dtype)
    big_q[:tq, :, :d] = q
    big_do = torch.full((tq + 3, hq, 4, d), float("nan"), dtype=q.dtype)
    big_do[:tq, :, 1] = dout
    odd = run_triton(big_q[:tq, :, :d], fused[:tk, 1], fused[:tk, 2], q_off, kv_off, big_do[:tq, :, 1], causal=True)
    for name in NAMES:
        assert torch.equal(odd[name], plain[name]), name


@needs_interpreter
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["gqa", "mha"])
def test_every_element_written_and_no_stray_writes(monkeypatch, kv_heads):
    """Fresh allocations are NaN and surrounded by guard words: every output element is written, and
    nothing is written outside the allocations (outputs, residuals and scratch alike); with one query head
    per key/value head the 12 x 50 sequence takes the short-query backward."""
    from jfa.triton import backend

    guard = 64
    sentinel = 1234.5
    allocations = []
    real_empty = torch.empty

    def guarded_empty(*shape, dtype=None, device=None, **kwargs):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        dtype = dtype or torch.get_default_dtype()
        n = math.prod(shape)
        buf = real_empty(n + 2 * guard, dtype=dtype, device=device)
        if dtype.is_floating_point:
            buf.fill_(float("nan"))
            buf[:guard] = sentinel
            buf[-guard:] = sentinel
            allocations.append(buf)
        return buf[guard:guard + n].view(shape)

    monkeypatch.setattr(backend.torch, "empty", guarded_empty)
    q_lens, kv_lens = [22, 0, 7, 40, 12], [18, 5, 0, 33, 50]
    q, k, v, q_off, kv_off, dout = make_inputs(q_lens, kv_lens, 2, kv_heads, 24, 8, seed=10)
    got = run_triton(q, k, v, q_off, kv_off, dout, causal=True)
    monkeypatch.undo()
    assert allocations
    for buf in allocations:
        assert (buf[:guard] == sentinel).all() and (buf[-guard:] == sentinel).all(), "stray write"
    for name in NAMES:
        assert not torch.isnan(got[name]).any(), f"{name} has unwritten (NaN) elements"


@needs_interpreter
def test_row_records_after_a_given_dq_pass_match_the_dq_kernels():
    """After a given dq_pass (another backend's; here one storing D by `_delta_kernel`, whose D has the dQ
    kernel's bits) the Triton dK/dV kernel reads records packed by `_row_stats_kernel`: every gradient has
    the usual backward's bits. dq_in_dkv without a dK/dV pass is refused before any kernel runs."""
    from jfa.triton import backend

    # 50 and 70 query rows: beyond the small short-query and packed blocks, so the two passes run.
    q, k, v, q_off, kv_off, dout = make_inputs([50, 9, 70], [60, 12, 40], 2, 2, 16, 16, seed=3)
    problem = problem_of(q, k, v, q_off, kv_off, causal=True)
    out, lse, residuals = backend.forward(q, k, v, problem)
    want = backend.backward(dout, q, k, v, out, lse, residuals, problem)
    calls = []

    def dq_pass(q, k, v, out, dout, dq, row_max, row_sum, delta, table, problem):
        calls.append(table)
        backend._delta(out, dout, delta, problem)
        dq.copy_(want[0])

    got = backend.backward(dout, q, k, v, out, lse, residuals, problem, dq_pass=dq_pass)
    assert len(calls) == 1
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(g, w), name

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran")

    with pytest.raises(ValueError, match="dq_in_dkv needs a dkv_pass"):
        backend.backward(dout, q, k, v, out, lse, residuals, problem, dq_in_dkv=True, dq_pass=no_pass,
                         short_pass=no_pass)


@pytest.mark.parametrize("heads, head_dim, wide", [(1, 32, False), (64, 256, False), (16383, 256, False),
                                                   (16384, 256, True), (32768, 128, True), (65535, 256, True)])
def test_dq_reduction_finds_a_column_in_int32_only_where_it_fits(heads, head_dim, wide):
    """`_dq_reduce_kernel`'s int32 form computes (pid mod W)·BLOCK, W = heads·head_dim: it serves every head
    count whose products stay below 2^31, and the int64 form the rest."""
    from jfa.triton import backend

    assert backend.wide_rows(heads, head_dim) == wide
    assert wide or (heads * head_dim - 1) * backend.DQ_REDUCE_BLOCK < 2**31


@needs_interpreter
@pytest.mark.parametrize("listed", [False, True])  # one partial per sequence; per head, a list of them
@pytest.mark.parametrize("partials", [1, 5, 33])  # the three loads-per-step regimes of dq_reduce_unroll
@pytest.mark.parametrize("wide_rows", [False, True])  # the column in a row found in int32, or in int64
def test_dq_reduction_adds_the_partials_in_order(partials, listed, wide_rows):
    """`_dq_reduce_kernel` with the backward's unroll: each element the fp32 sum of its partials in order (a
    tail step's masked loads add nothing), bitwise, whatever the number of loads in flight: every sequence's
    in sequence order, or (`listed`) those its head's row of Sources names, in that order, -1 adding
    nothing (the partials not named are NaN: reading one would show). Stored as fp32 here (the op's bf16
    rounding would hide the order); values of mixed signs and magnitudes, so that another order sums
    differently. Both ways of finding an element's head (`WIDE_ROWS`) give the same."""
    from jfa.triton import backend
    from jfa.triton import backward as kernels

    heads, head_dim = 3, 16
    n_elem = 11 * heads * head_dim  # [rows, heads, head_dim]: a second, partly masked program
    gen = torch.Generator().manual_seed(partials)
    n_seqs = 2 * partials + 1 if listed else partials
    parts = torch.randn(n_seqs, n_elem, generator=gen) * torch.exp2(torch.randint(-12, 12, (n_seqs, n_elem),
                                                                                  generator=gen).float())
    order = torch.arange(n_seqs).expand(heads, n_seqs)[:, :partials]
    sources = None
    if listed:
        order = torch.stack([torch.randperm(n_seqs, generator=gen)[:partials] for _ in range(heads)])
        sources = order.clone().to(torch.int32)
        sources[-1, partials // 2:] = -1  # the last head lists fewer
        unlisted = torch.ones(n_seqs, heads, dtype=torch.bool)
        for h in range(heads):
            unlisted[sources[h][sources[h] >= 0].long(), h] = False
        parts.view(n_seqs, -1, heads, head_dim).transpose(1, 2)[unlisted] = float("nan")
    per_head = parts.view(n_seqs, -1, heads, head_dim)
    want = torch.zeros(per_head.shape[1:])
    for h in range(heads):  # fp32 additions in the order listed
        for b in (sources[h] if listed else order[h]).tolist():
            if b >= 0:
                want[:, h] += per_head[b, :, h]
    got = torch.empty(n_elem)
    kernels._dq_reduce_kernel[(triton.cdiv(n_elem, backend.DQ_REDUCE_BLOCK),)](
        parts.reshape(-1), got, sources, partials, n_elem, heads, head_dim, BLOCK=backend.DQ_REDUCE_BLOCK,
        UNROLL=backend.dq_reduce_unroll(partials), WIDE_ROWS=wide_rows, INTERPRET=True, num_warps=4)
    torch.testing.assert_close(got, want.reshape(-1), rtol=0, atol=0)
    if partials > 1:  # the check can tell orders apart: the reversed order's sum differs somewhere
        reversed_sum = torch.zeros(per_head.shape[1:])
        for h in range(heads):
            for b in (sources[h] if listed else order[h]).flip(0).tolist():
                if b >= 0:
                    reversed_sum[:, h] += per_head[b, :, h]
        assert not torch.equal(reversed_sum, want)


@triton.jit
def _block_ranges_kernel(args, out, n, window, BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         CAUSAL: tl.constexpr):
    for t in range(n):
        a0 = tl.load(args + 4 * t)
        a1 = tl.load(args + 4 * t + 1)
        q_len = tl.load(args + 4 * t + 2)
        kv_len = tl.load(args + 4 * t + 3)
        r0, r1, r2, r3 = kv_block_range(a0, a1, q_len, kv_len, window, BLOCK, HAS_WINDOW, CAUSAL)
        s0, s1, s2, s3 = q_block_range(a0, a1, q_len, kv_len, window, BLOCK, HAS_WINDOW, CAUSAL)
        tl.store(out + 8 * t + 0, r0)
        tl.store(out + 8 * t + 1, r1)
        tl.store(out + 8 * t + 2, r2)
        tl.store(out + 8 * t + 3, r3)
        tl.store(out + 8 * t + 4, s0)
        tl.store(out + 8 * t + 5, s1)
        tl.store(out + 8 * t + 6, s2)
        tl.store(out + 8 * t + 7, s3)


@needs_interpreter
def test_block_ranges_match_host_twin():
    """The @triton.jit block-range functions agree with their numpy twins (which tests/test_block_info.py
    checks against brute force over the visibility rule)."""
    rng = np.random.default_rng(12)
    n = 96
    q_len = rng.integers(1, 60, n)
    kv_len = rng.integers(0, 60, n)
    a0 = rng.integers(0, 60, n) % np.maximum(q_len, 1)
    a1 = np.minimum(a0 + rng.integers(1, 20, n), q_len)
    args = torch.tensor(np.stack([a0, a1, q_len, kv_len], 1), dtype=torch.int32).contiguous()
    for window, causal, block in ((None, False, 16), (None, True, 16), (5, False, 32), (3, True, 16)):
        out = torch.zeros(n, 8, dtype=torch.int32)
        _block_ranges_kernel[(1,)](args, out, n, 0 if window is None else window, BLOCK=block,
                                   HAS_WINDOW=window is not None, CAUSAL=causal)
        want_kv = np.stack(kv_block_range_np(a0, a1, q_len, kv_len, window, block, causal), 1)
        want_q = np.stack(q_block_range_np(a0, a1, q_len, kv_len, window, block, causal), 1)
        np.testing.assert_array_equal(out[:, :4].numpy(), want_kv)
        np.testing.assert_array_equal(out[:, 4:].numpy(), want_q)


@triton.jit
def _packed_visible_kernel(layout, out, window, BLOCK: tl.constexpr, SHIFT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                           CAUSAL: tl.constexpr, BY_INTERVAL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    loc = tl.load(layout + offs)
    q_len = tl.load(layout + BLOCK + offs)
    kv_len = tl.load(layout + 2 * BLOCK + offs)
    seen = packed_visible(offs >> SHIFT, loc, q_len, kv_len, loc < q_len, loc < kv_len, window, HAS_WINDOW, CAUSAL,
                          BY_INTERVAL)
    tl.store(out + offs[:, None] * BLOCK + offs[None, :], seen.to(tl.int32))


@needs_interpreter
@pytest.mark.parametrize("by_interval", [True, False], ids=["interval", "pairs"])
@pytest.mark.parametrize("shift", [2, 3, 5])
def test_packed_visible_is_the_rule_per_slot(shift, by_interval):
    """A packed tile's mask (`packed_visible` in either form: each row's interval of keys from
    `jfa.mask.visible_keys`, the forward's, or the rule per pair, the backward's) is the contract's rule applied
    slot by slot: row i sees key j iff they share a slot, i is below its slot's q_len, j below its kv_len and
    `visible` holds for their local indices. Lengths from 0 to the slot size (q > kv, q < kv, empty slots), every
    window from 0 to past the slot, causal or not."""
    block, size = 32, 1 << shift
    rng = np.random.default_rng(shift)
    offs = np.arange(block)
    slot, loc = offs >> shift, offs & (size - 1)
    same = slot[:, None] == slot[None, :]
    seen_in_slot = []
    for _ in range(4):
        q_len, kv_len = (rng.integers(0, size + 1, block // size)[slot] for _ in range(2))
        layout = torch.from_numpy(np.concatenate([loc, q_len, kv_len]).astype(np.int32))
        for window in (None, 0, 1, int(rng.integers(2, size + 2))):
            for causal in (False, True):
                got = torch.empty(block, block, dtype=torch.int32)
                _packed_visible_kernel[(1,)](layout, got, 0 if window is None else window, BLOCK=block,
                                             SHIFT=shift, HAS_WINDOW=window is not None, CAUSAL=causal,
                                             BY_INTERVAL=by_interval)
                rule = visible_torch(torch.from_numpy(loc)[:, None], torch.from_numpy(loc)[None, :],
                                     torch.from_numpy(q_len)[:, None], torch.from_numpy(kv_len)[:, None], window,
                                     causal).numpy()
                in_slot = same & (loc < q_len)[:, None] & (loc < kv_len)[None, :]
                want = in_slot & rule
                seen_in_slot.append(want[in_slot])
                np.testing.assert_array_equal(got.numpy().astype(bool), want,
                                              err_msg=f"slot size {size}, q {q_len[::size]}, kv {kv_len[::size]}, "
                                                      f"window {window}, causal {causal}")
    seen_in_slot = np.concatenate(seen_in_slot)
    assert seen_in_slot.any() and not seen_in_slot.all()  # the draws reach keys of both kinds inside slots


@triton.jit
def _tile_at_kernel(tiles, out, n_tiles, n_heads, RUNS: tl.constexpr):
    for t in range(n_tiles):
        seq, start, head = tile_at(tiles, t, n_heads, RUNS)
        tl.store(out + 3 * t, seq)
        tl.store(out + 3 * t + 1, start)
        tl.store(out + 3 * t + 2, head)


@needs_interpreter
@pytest.mark.parametrize("runs", [False, True])
def test_tile_at_matches_host_twin(runs):
    """The kernels' tile decode (jfa.tile_scheduler.tile_at) deals the tiles TileTable.tile says, over a table
    with runs of many blocks and single entries (tests/test_tile_scheduler.py checks the twin)."""
    q_lens = np.array([40, 0, 700, 90, 17, 520, 3])
    table = ts.query_tiles(q_lens, q_lens, np.flatnonzero(q_lens), 32, 32, None, False, heads=3)
    assert (table.run_rows[:, 3] > 1).any() and (table.run_rows[:, 3] == 1).any()
    rows = torch.from_numpy(table.run_rows if runs else table.entries).contiguous()
    out = torch.full((table.n_tiles, 3), -1, dtype=torch.int32)
    _tile_at_kernel[(1,)](rows, out, table.n_tiles, table.heads, RUNS=runs)
    want = [table.tile(t, runs=runs) for t in range(table.n_tiles)]
    assert [tuple(r) for r in out.tolist()] == want


# ---------------------------------------------------------------------------------------------------------
# Fallback: run this module in a fresh interpreter-enabled process.


@needs_interpreter
def test_interpreter_skips_overflow_arithmetic_that_it_would_discard():
    """jfa's Triton backend turns off the interpreter's int32 overflow arithmetic, which only asserts with
    debug on (jfa/triton/interpreter.py); a triton that changes either option shows up here."""
    from triton.runtime import interpreter

    import jfa.triton.backend  # noqa: F401  (installs the interpreter's fast paths)

    options = interpreter.interpreter_builder.options
    assert options.debug is False and options.sanitize_overflow is False, options


@pytest.mark.skipif(SKIP_REASON is None, reason="the interpreter is active in this process; tests ran in-process")
def test_in_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        cwd=root, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_compile_check_head_dims_option():
    """`gpu_selftest --compile-only --head-dims` compiles only the classes named, as (D, Dv) pairs."""
    from jfa.triton.compiled import parse_head_dims

    assert parse_head_dims([]) is None
    assert parse_head_dims(["256", "192/128"]) == [(256, 256), (192, 128)]
    for bad in ("256/128/64", "d256", "128/"):
        with pytest.raises(ValueError, match="D or D/DV"):
            parse_head_dims([bad])


# The fewest registers per thread ptxas reports for an ordinary (fwd, dq, dkv, short_bwd) kernel of the shipped configs
# at any head-dim class (`python -m jfa.triton.gpu_selftest --compile-only`, triton 3.9, 2026-11-30: 145-255).
# Fewer registers would only let more programs fit, so the bound never rejects a config that fits. Packed
# kernels use fewer at small head dims, so they are not bound here.
MIN_ORDINARY_REGISTERS = 145


@pytest.mark.parametrize("block_d", [16, 32, 64, 128, 256])
def test_shipped_configs_are_well_formed(block_d):
    """Every shipped config: power-of-two blocks of at least 16 (tl.dot's smallest tile), square packed tiles
    (a slot's rows and keys are the same tile indices), and, for the ordinary kernels, no more programs per SM
    than its 65,536 registers hold: static zigzag dealing assumes every program of the persistent grid runs at
    once."""
    from jfa.triton.backend import gpu_config

    config = gpu_config(block_d)
    for role in ("fwd", "dq", "dkv", "short_bwd", "packed_fwd", "packed_bwd"):
        cfg = getattr(config, role)
        if cfg is None:  # only the short-query path may be absent, and only above head dim 128
            assert role == "short_bwd" and block_d > 128, (role, block_d)
            continue
        for block in (cfg.block_m, cfg.block_n):
            assert block >= 16 and block & (block - 1) == 0, (role, cfg)
        assert cfg.stages and all(s >= 1 for s in cfg.stages), (role, cfg)
        if role.startswith("packed"):
            assert cfg.block_m == cfg.block_n, (role, cfg)
        else:
            assert cfg.resident <= 65536 // (cfg.num_warps * 32 * MIN_ORDINARY_REGISTERS), (role, cfg)
