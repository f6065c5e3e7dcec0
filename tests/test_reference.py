"""The float64 reference checked against independent computations: float64 autograd of an unfused
implementation, mpmath at 50 digits, scipy, and finite differences (gradcheck)."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import scipy.special
import torch

from jfa.mask import visible_torch
from reference.exact import reference
from tests.helpers import jagged_inputs, problem_of

CASES = [
    # (q_lens, kv_lens, heads q/kv, mask kwargs, broadcast_q)
    ([3, 0, 5, 2], [4, 2, 0, 6], (4, 2), dict(causal=True), False),
    ([7, 1, 4], [3, 9, 4], (2, 2), dict(window=2), False),
    ([6, 6], [2, 9], (3, 1), dict(window=1, causal=True, sm_scale=0.7), False),
    ([5, 5, 5], [4, 0, 7], (2, 1), dict(), True),
]


def unfused(q, k, v, problem, q_lens, kv_lens):
    """Per-sequence, per-head dense float64 attention: the obvious implementation, for autograd."""
    outs, lses = [], []
    q_start = kv_start = 0
    group = problem.group_size
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        qs = q[: q_len] if problem.broadcast_q else q[q_start:q_start + q_len]
        ks, vs = k[kv_start:kv_start + kv_len], v[kv_start:kv_start + kv_len]
        i = torch.arange(q_len).view(-1, 1)
        j = torch.arange(kv_len).view(1, -1)
        mask = visible_torch(i, j, q_len, kv_len, problem.window, problem.causal)
        head_out, head_lse = [], []
        for h in range(problem.q_heads):
            s = problem.sm_scale * qs[:, h] @ ks[:, h // group].T
            s = s.masked_fill(~mask, -math.inf)
            lse = torch.logsumexp(s, -1) if kv_len else torch.full((q_len,), -math.inf, dtype=q.dtype)
            p = torch.where(mask, torch.exp(s - lse.unsqueeze(-1)), 0.0) if kv_len else s.new_zeros(q_len, 0)
            head_out.append(p @ vs[:, h // group])
            head_lse.append(lse)
        outs.append(torch.stack(head_out, 1))
        lses.append(torch.stack(head_lse, 0))
        q_start += q_len
        kv_start += kv_len
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_float64_autograd(case):
    q_lens, kv_lens, (hq, hkv), mask, broadcast = CASES[case]
    q, k, v, q_off, kv_off, dout = jagged_inputs(q_lens, kv_lens, hq, hkv, 16, 24, broadcast_q=broadcast, seed=case)
    problem = problem_of(q, k, v, q_off, kv_off, broadcast_q=broadcast, **mask)
    ref = reference(q, k, v, problem, dout)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = unfused(q64, k64, v64, problem, q_lens, kv_lens)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    torch.testing.assert_close(ref.out, out.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(ref.lse, lse.detach(), rtol=1e-12, atol=1e-13)
    for name, mine, theirs in (("dq", ref.dq, dq), ("dk", ref.dk, dk), ("dv", ref.dv, dv)):
        torch.testing.assert_close(mine, theirs, rtol=1e-11, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_chunked_equals_unchunked(monkeypatch):
    """Tiny chunks (many query and key chunks, many buckets) give the same result as one block."""
    import reference.buckets as buckets_module

    q, k, v, q_off, kv_off, dout = jagged_inputs([37, 1, 64, 5], [70, 3, 33, 0], 4, 2, 16, 16, seed=3)
    problem = problem_of(q, k, v, q_off, kv_off, causal=True)
    whole = reference(q, k, v, problem, dout)
    monkeypatch.setattr(buckets_module, "DEFAULT_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr("reference.exact.chunk_sizes", lambda b: buckets_module.chunk_sizes(b, 64))
    monkeypatch.setattr("reference.exact.buckets", lambda p, d: buckets_module.buckets(p, d, 64))
    parts = reference(q, k, v, problem, dout)
    for name, (tensor, bound, _) in whole.tensors().items():
        other, other_bound, _ = parts.tensors()[name]
        torch.testing.assert_close(other, tensor, rtol=1e-12, atol=1e-13, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(other_bound, bound, rtol=1e-5, atol=1e-30, msg=lambda m, n=name: f"{n}: {m}")


def _mp_reference(q, k, v, dout, scale, mask):
    """One sequence, one head, in mpmath at 50 digits: out, lse, dq, dk, dv."""
    mpmath.mp.dps = 50
    m = lambda x: mpmath.matrix([[mpmath.mpf(float(e)) for e in row] for row in x.tolist()])
    Q, K, V, dO = m(q), m(k), m(v), m(dout)
    n_q, n_k = Q.rows, K.rows
    S = scale * Q * K.T
    lse = [mpmath.log(mpmath.fsum(mpmath.exp(S[i, j]) for j in range(n_k) if mask[i][j])) for i in range(n_q)]
    P = mpmath.matrix(n_q, n_k)
    for i in range(n_q):
        for j in range(n_k):
            P[i, j] = mpmath.exp(S[i, j] - lse[i]) if mask[i][j] else 0
    O = P * V
    dP = dO * V.T
    D = [mpmath.fsum(dO[i, c] * O[i, c] for c in range(O.cols)) for i in range(n_q)]
    dS = mpmath.matrix(n_q, n_k)
    for i in range(n_q):
        for j in range(n_k):
            dS[i, j] = P[i, j] * (dP[i, j] - D[i])
    return O, lse, scale * dS * K, scale * dS.T * Q, P.T * dO


def _as_tensor(mp) -> torch.Tensor:
    """An mpmath matrix, or a list of mpf, as a float64 tensor."""
    if isinstance(mp, list):
        return torch.tensor([float(e) for e in mp], dtype=torch.float64)
    return torch.tensor([[float(mp[r, c]) for c in range(mp.cols)] for r in range(mp.rows)], dtype=torch.float64)


def _max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs() / want.abs()).max())


def test_matches_mpmath_50_digits():
    q_lens, kv_lens, scale = [3, 4], [5, 2], 0.37
    q, k, v, q_off, kv_off, dout = jagged_inputs(q_lens, kv_lens, 2, 1, 8, 8, seed=11)
    problem = problem_of(q, k, v, q_off, kv_off, causal=True, sm_scale=scale)
    ref = reference(q, k, v, problem, dout)
    worst = 0.0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        qs = slice(int(q_off[b]), int(q_off[b + 1]))
        ks = slice(int(kv_off[b]), int(kv_off[b + 1]))
        mask = [[bool(visible_torch(i, j, q_len, kv_len, None, True)) for j in range(kv_len)] for i in range(q_len)]
        for h in range(2):
            out, lse, dq, _, _ = _mp_reference(q[qs, h], k[ks, 0], v[ks, 0], dout[qs, h], mpmath.mpf(scale), mask)
            for got, want in ((ref.out[qs, h], out), (ref.lse[h, qs], lse), (ref.dq[qs, h], dq)):
                worst = max(worst, _max_relative_error(got, _as_tensor(want)))
    assert worst < 1e-12, worst


def test_dk_dv_match_mpmath_with_gqa_sum():
    """dk and dv of a kv head are sums over its query heads: checked against mpmath per head, summed."""
    q, k, v, q_off, kv_off, dout = jagged_inputs([4], [6], 2, 1, 8, 8, seed=5)
    problem = problem_of(q, k, v, q_off, kv_off, window=2)
    ref = reference(q, k, v, problem, dout)
    mask = [[bool(visible_torch(i, j, 4, 6, 2, False)) for j in range(6)] for i in range(4)]
    dk = dv = 0
    for h in range(2):
        _, _, _, dk_h, dv_h = _mp_reference(q[:, h], k[:, 0], v[:, 0], dout[:, h], 1 / mpmath.sqrt(8), mask)
        dk, dv = dk + dk_h, dv + dv_h
    assert _max_relative_error(ref.dk[:, 0], _as_tensor(dk)) < 1e-12
    assert _max_relative_error(ref.dv[:, 0], _as_tensor(dv)) < 1e-12


def test_lse_and_softmax_match_scipy():
    q, k, v, q_off, kv_off, _ = jagged_inputs([5, 3], [6, 4], 1, 1, 8, 8, seed=2)
    problem = problem_of(q, k, v, q_off, kv_off)
    ref = reference(q, k, v, problem)
    scale = 1 / math.sqrt(8)
    for (q0, q1), (k0, k1) in (((0, 5), (0, 6)), ((5, 8), (6, 10))):
        s = scale * q[q0:q1, 0].double().numpy() @ k[k0:k1, 0].double().numpy().T
        np.testing.assert_allclose(ref.lse[0, q0:q1].numpy(), scipy.special.logsumexp(s, axis=-1), rtol=1e-13)
        out = scipy.special.softmax(s, axis=-1) @ v[k0:k1, 0].double().numpy()
        np.testing.assert_allclose(ref.out[q0:q1, 0].numpy(), out, rtol=1e-12, atol=1e-14)


def test_empty_rows_and_unseen_keys_are_exact():
    """causal with q > kv: the first rows see nothing (out 0, lse -inf, dq 0); unseen keys: dk = dv = 0."""
    q, k, v, q_off, kv_off, dout = jagged_inputs([6, 0, 3], [2, 5, 0], 2, 2, 8, 8, seed=4)
    problem = problem_of(q, k, v, q_off, kv_off, causal=True)
    ref = reference(q, k, v, problem, dout)
    assert torch.equal(ref.lse[:, :4], torch.full((2, 4), -math.inf, dtype=torch.float64))
    assert (ref.out[:4] == 0).all() and (ref.dq[:4] == 0).all()
    assert (ref.out[6:] == 0).all() and torch.isinf(ref.lse[:, 6:]).all()
    assert (ref.dk[2:] == 0).all() and (ref.dv[2:] == 0).all()  # sequence 1 has no queries
    assert ref.key_seen[:2].all() and not ref.key_seen[2:].any()
    assert (ref.out[4:6] != 0).all() and (ref.dk[:2] != 0).all()


def test_gradcheck_against_finite_differences():
    q, k, v, q_off, kv_off, _ = jagged_inputs([3, 2], [4, 3], 2, 1, 8, 8, seed=9)
    problem = problem_of(q, k, v, q_off, kv_off, window=2, causal=True)

    class Exact(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q64, k64, v64):
            ctx.save_for_backward(q64, k64, v64)
            return reference(q64, k64, v64, problem).out

        @staticmethod
        def backward(ctx, dout):
            ref = reference(*ctx.saved_tensors, problem, dout)
            return ref.dq, ref.dk, ref.dv

    inputs = tuple(x.double().requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(Exact.apply, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_accumulating_scatters_name_each_row_once(monkeypatch):
    """index_add_ of a repeated row is atomic on CUDA, so its sum depends on the run: every accumulating
    scatter of the reference and of the bf16 model must name each row once, so that both are bitwise
    reproducible on a GPU. Broadcast-Q's dq is the case that repeats rows (every sequence reads the same
    query rows); GQA's dk/dv sum over a group's heads."""
    import jfa
    import reference.bf16_model
    import reference.exact
    from reference import buckets

    scattered = []

    def checked(scatter):
        def scatter_once(target, rows, valid, values, accumulate):
            if accumulate:
                named = rows[valid]
                assert named.unique().numel() == named.numel(), f"{scatter.__name__} repeats rows: {named.tolist()}"
                scattered.append(scatter.__name__)
            return scatter(target, rows, valid, values, accumulate)
        return scatter_once

    for module in (reference.exact, reference.bf16_model):
        for name in ("scatter_rows", "scatter_row_heads"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, checked(getattr(buckets, name)))
    q, k, v, _, kv_off, dout = jagged_inputs([6, 6, 6, 6], [5, 9, 0, 7], 4, 2, 16, 16, broadcast_q=True, seed=11)
    reference.exact.reference(q, k, v, problem_of(q, k, v, None, kv_off, broadcast_q=True), dout)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    jfa.attention(*leaves, None, kv_off, broadcast_q=True, backend="bf16-model").backward(dout)
    assert scattered.count("scatter_rows") >= 8 and "scatter_row_heads" in scattered  # the checks ran


@pytest.mark.parametrize("poisoned", ["q", "k", "v", "dout"])
def test_padding_reads_no_other_sequence(poisoned):
    """Padded positions of the buckets index row 0, which belongs to a sequence (q's and dout's to sequence 0,
    k's and v's to sequence 1: sequence 0 has no keys). With that row NaN, every other sequence's out, lse, dq, dk
    and dv stay bitwise those of the clean run, in the float64 reference and in the bf16 model alike: a padded
    value multiplied at weight 0 would carry the NaN into them (found by the nightly seeds, 2026-12-03)."""
    import jfa

    q_lens, kv_lens = [3, 5, 2], [0, 6, 3]  # pads: q 4, 8, 2; kv 1, 8, 4
    q, k, v, q_off, kv_off, dout = jagged_inputs(q_lens, kv_lens, 4, 2, 16, 16, seed=5)
    owner = 1 if poisoned in ("k", "v") else 0
    q_rows, kv_rows = np.cumsum([0] + q_lens), np.cumsum([0] + kv_lens)
    tensors = dict(q=q, k=k, v=v, dout=dout)
    poisoned_tensors = dict(tensors, **{poisoned: tensors[poisoned].clone().index_fill_(0, torch.tensor([0]),
                                                                                         float("nan"))})

    def model(t):
        leaves = [t[n].clone().requires_grad_() for n in ("q", "k", "v")]
        out, lse = jfa.attention(*leaves, q_off, kv_off, causal=True, return_lse=True, backend="bf16-model")
        grads = torch.autograd.grad(out, leaves, t["dout"])
        return dict(out=out.detach(), lse=lse.T, dq=grads[0], dk=grads[1], dv=grads[2])

    def exact(t):
        ref = reference(t["q"], t["k"], t["v"], problem_of(t["q"], t["k"], t["v"], q_off, kv_off, causal=True),
                        t["dout"])
        return dict(out=ref.out, lse=ref.lse.T, dq=ref.dq, dk=ref.dk, dv=ref.dv)

    for implementation in (model, exact):
        clean, dirty = implementation(tensors), implementation(poisoned_tensors)
        for name in clean:
            rows = kv_rows if name in ("dk", "dv") else q_rows
            for seq in set(range(len(q_lens))) - {owner}:
                a, b = clean[name][rows[seq]:rows[seq + 1]], dirty[name][rows[seq]:rows[seq + 1]]
                assert torch.equal(a.nan_to_num(), b.nan_to_num()) and not b.isnan().any(), (
                    f"{implementation.__name__}: NaN in {poisoned}'s row 0 (sequence {owner}) reached {name} of "
                    f"sequence {seq}")
