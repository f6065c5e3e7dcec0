"""The float64 reference: exact softmax per sequence, analytic backward, and the componentwise error bound.

Inputs are the caller's bf16/fp16 tensors upcast to float64, so input rounding is not counted as kernel
error. Work is chunked over queries and keys (see `buckets`), so one 65,536-token sequence with 8 heads
and D = 128 runs within a few GiB; it runs on whatever device the inputs are on (an H200 does float64 at
~56 TFLOP/s). The lse is computed first over all keys, so P = exp(S - lse) is exact rather than rescaled.

Bounds (`bound_*`, float32) follow the first-order rounding model of DESIGN.md, per element:
  b_O  = u(|O| + P|V|)                      + w E|V|          + η(M|V| + 1)
  b_dV = u(|dV| + Pᵀ|dO|)                    + w Eᵀ|dO|        + η(Mᵀ|dO| + 1)
  b_D  = rowsum(|dO| ∘ b_O)
  b_dS = u|dS| + P∘(u|dO||V|ᵀ + b_D)        + w E∘|dP - D|    + η M
  b_dQ = u|dQ| + scale b_dS |K| + η,  b_dK = u|dK| + scale b_dSᵀ |Q| + η
  b_lse = u32 (2|lse| + 2 log2(n + 1) + 4)  + w r
with u the input dtype's unit roundoff, plus two kinds of term DESIGN.md's set leaves out.

Underflow: rounding to the input dtype has an absolute error floor η (half its smallest subnormal: 2^-25 in
fp16; 2^-126 in bf16, where GPUs flush fp32 subnormals to zero). Every rounded P or dS entry and every rounded
output may be off by η, which adds η M|V| to b_O, η Mᵀ|dO| to b_dV, η M to b_dS (M the 0/1 visibility) and η
to every bound; fp16 gradients of ~1e-7 are otherwise far outside a purely relative bound.

Logit rounding: the fp32 rounding of the logits themselves. A logit s = scale·q·k summed in fp32 over D
terms (then scaled, and scaled by log2 e in exp2-based kernels) is off by up to w·a with w = (D + 2)·u32
and a = scale·|q|·|k|; to first order that moves P_ij by P_ij(Δs_ij - Σ_k P_ik Δs_ik), so
|ΔP| <= w E with E = P∘(A + r), A = scale|Q||K|ᵀ and r = rowsum(P∘A). It is negligible for ordinary
activations (w·a ~ 1e-5 against u ~ 4e-3) and dominant for logits of magnitude ~1e4 and more, where every
fp32 kernel, the bf16 model included, is that far off (except where all keys are identical: see
`identical_keys`).
The b_lse constant covers the fp32 exp/log/sum of the kernel's softmax (a few u32 per step).
Calibration (see tests/test_reference.py and README): the bf16 model sits at max bound ratio ≲ 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from jfa.problem import Problem
from reference.buckets import (
    Bucket,
    buckets,
    chunk_sizes,
    chunks,
    head_map,
    reduce_groups,
    scatter_row_heads,
    scatter_rows,
    sum_broadcast_rows,
)

F64 = torch.float64
U32 = 2.0**-24


@dataclass
class Reference:
    """Float64 values of out [out_rows, Hq, Dv], lse [Hq, out_rows] (-inf for rows with no visible key) and,
    after a backward, dq, dk, dv; per tensor its bound (float32, like the value) and the bound's
    logit-rounding part, as an upper bound of its maximum over each row and head ([H, rows] float32: the
    baseline check needs only block maxima, and a per-element copy would not fit 64k-token sequences)."""

    values: dict[str, torch.Tensor]
    bounds: dict[str, torch.Tensor]
    logit_bounds: dict[str, torch.Tensor]
    key_seen: torch.Tensor  # [kv_rows] bool: some query of some head sees this key (else dk = dv = 0)

    def __getattr__(self, name: str):
        if name in ("out", "lse", "dq", "dk", "dv"):
            return self.values.get(name)
        raise AttributeError(name)

    def tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(value, bound, logit-rounding part of the bound) of each computed tensor, by name."""
        return {name: (value, self.bounds[name], self.logit_bounds[name]) for name, value in self.values.items()}


def identical_keys(bucket: Bucket, k: torch.Tensor, hmap: torch.Tensor) -> torch.Tensor:
    """[G, Hq, 1, 1]: every key of the sequence is bitwise the same vector (for that head).

    A tiled kernel computes every logit of a row with the same instruction sequence, so identical keys give
    bitwise identical fp32 logits: their rounding is common to the row and cancels in the softmax. Without
    this, logits of ~1e11 (q = k = 133120) would make the logit-rounding term swamp every other check.
    """
    rows, valid = bucket.kv_rows, bucket.kv_valid
    if k.shape[0] == 0:  # no keys at all: vacuously identical
        return torch.ones(rows.shape[0], hmap.numel(), 1, 1, dtype=torch.bool, device=k.device)
    first = k[rows[:, 0]]
    same = torch.ones(first.shape[:2], dtype=torch.bool, device=k.device)
    for k0, k1 in chunks(bucket.kv_pad, 4096):
        equal = (k[rows[:, k0:k1]] == first.unsqueeze(1)).all(-1) | ~valid[:, k0:k1].unsqueeze(-1)
        same &= equal.all(1)
    return same.index_select(1, hmap).view(*same.shape[:1], -1, 1, 1)


class _Chunk:
    """Float64 operands of one (bucket, query chunk, key chunk) block, shared by forward and backward."""

    def __init__(self, bucket: Bucket, inputs, q0, q1, k0, k1):
        q, k, v, hmap, scale = inputs
        self.mask = bucket.visible(q0, q1, k0, k1)
        self.q = bucket.queries(q, q0, q1, F64)
        self.k = bucket.keys(k, k0, k1, F64, hmap)
        self.v = bucket.keys(v, k0, k1, F64, hmap)
        self.scores = (scale * self.q @ self.k.transpose(-1, -2)).masked_fill(~self.mask, -math.inf)
        # A = scale |Q||K|ᵀ: the magnitude each fp32 logit is computed at (its rounding scales with it).
        # The lse keeps every logit's rounding; P (a difference of logits) loses it for identical keys.
        self.lse_logit_magnitude = scale * self.q.abs() @ self.k.abs().transpose(-1, -2)
        self.logit_magnitude = self.lse_logit_magnitude.masked_fill(bucket.identical_keys, 0.0)

    def probs(self, lse: torch.Tensor) -> torch.Tensor:
        """P = exp(S - lse), exactly 0 where invisible (also for rows with lse = -inf)."""
        p = torch.exp(self.scores - lse.unsqueeze(-1))
        return torch.where(self.mask, p, torch.zeros((), dtype=F64, device=p.device))


def _buckets(problem: Problem, inputs):
    q, k, _, hmap, _ = inputs
    for bucket in buckets(problem, q.device):
        bucket.identical_keys = identical_keys(bucket, k, hmap)
        yield bucket


def reference(q, k, v, problem: Problem, dout: torch.Tensor | None = None, device=None) -> Reference:
    """Exact forward (and backward, when `dout` is given) with componentwise error bounds."""
    device = torch.device(device) if device is not None else q.device
    q, k, v = (x.detach().to(device) for x in (q, k, v))
    hq, rows, dv_dim = problem.q_heads, problem.out_rows, problem.head_dim_v
    u = problem.unit_roundoff
    w = (problem.head_dim + 2) * U32
    eta = underflow_floor(problem.dtype)
    scale = problem.sm_scale
    inputs = (q, k, v, head_map(problem, device), scale)

    f32 = dict(dtype=torch.float32, device=device)
    out = torch.zeros(rows, hq, dv_dim, dtype=F64, device=device)
    lse = torch.full((hq, rows), -math.inf, dtype=F64, device=device)
    r_rows = torch.zeros(hq, rows, dtype=F64, device=device)
    bounds = {"out": torch.zeros(rows, hq, dv_dim, **f32), "lse": torch.zeros(hq, rows, **f32)}
    logit_bounds = {name: torch.zeros(hq, rows, **f32) for name in bounds}
    key_seen = torch.zeros(problem.kv_rows, dtype=torch.bool, device=device)

    for bucket in _buckets(problem, inputs):
        q_chunk, kv_chunk = chunk_sizes(bucket)
        for q0, q1 in chunks(bucket.q_pad, q_chunk):
            blocks = list(chunks(bucket.kv_pad, kv_chunk))
            row_lse = None
            for k0, k1 in blocks:
                part = torch.logsumexp(_Chunk(bucket, inputs, q0, q1, k0, k1).scores, dim=-1)
                row_lse = part if row_lse is None else torch.logaddexp(row_lse, part)
            acc_out = acc_pv = acc_pav = acc_mv = 0.0
            r = r_lse = count = 0.0
            for k0, k1 in blocks:
                c = _Chunk(bucket, inputs, q0, q1, k0, k1)
                p = c.probs(row_lse)
                pa = p * c.logit_magnitude
                acc_out = acc_out + p @ c.v
                acc_pv = acc_pv + p @ c.v.abs()
                acc_pav = acc_pav + pa @ c.v.abs()
                acc_mv = acc_mv + c.mask.to(F64) @ c.v.abs()
                r = r + pa.sum(-1)
                r_lse = r_lse + (p * c.lse_logit_magnitude).sum(-1)
                count = count + c.mask.sum(-1)
                seen = c.mask.any(-2).squeeze(1) & bucket.kv_valid[:, k0:k1]
                key_seen[bucket.kv_rows[:, k0:k1][seen]] = True
            rows_sel, valid = bucket.out_rows[:, q0:q1], bucket.q_valid[:, q0:q1]
            logit_out = w * (acc_pav + r.unsqueeze(-1) * acc_pv)
            b_out = u * (acc_out.abs() + acc_pv) + logit_out + eta * (acc_mv + 1)
            for target, values in ((out, acc_out), (bounds["out"], b_out)):
                scatter_rows(target, rows_sel, valid, values, accumulate=False)
            empty = torch.isinf(row_lse)
            logit_lse = torch.where(empty, 0.0, w * r_lse)
            b_lse = torch.where(empty, 0.0, U32 * (2 * row_lse.abs() + 2 * torch.log2(count + 1.0) + 4)) + logit_lse
            for target, values in ((lse, row_lse), (bounds["lse"], b_lse), (logit_bounds["lse"], logit_lse),
                                   (logit_bounds["out"], logit_out.amax(-1)), (r_rows, r)):
                scatter_row_heads(target, rows_sel, valid, values, accumulate=False)

    result = Reference(values={"out": out, "lse": lse}, bounds=bounds, logit_bounds=logit_bounds, key_seen=key_seen)
    if dout is not None:
        _backward(result, r_rows, inputs, dout.detach().to(device), problem, u, w, eta)
    return result


def underflow_floor(dtype: torch.dtype) -> float:
    """η: the absolute error floor of producing a value in `dtype` through fp32 arithmetic.

    Half the smallest subnormal of `dtype` (rounding to it), but at least fp32's smallest normal 2^-126:
    GPU fp32 arithmetic flushes subnormals to zero (ftz; Triton's exp2 is ex2.approx.ftz), and bf16
    subnormals are fp32 subnormals, so a bf16 gradient of 1e-39 may come out 0.
    """
    info = torch.finfo(dtype)
    return max(info.smallest_normal * info.eps / 2, torch.finfo(torch.float32).smallest_normal)


def _backward(result: Reference, r_rows, inputs, dout, problem: Problem, u: float, w: float, eta: float) -> None:
    q, k, v, hmap, scale = inputs
    device = q.device
    # Per gradient: the float64 value, its bound beyond u|value| + η (float32) and the logit part ([H, rows]).
    grads = {name: (torch.zeros(x.shape, dtype=F64, device=device), torch.zeros(x.shape, dtype=torch.float32,
                                                                               device=device),
                    torch.zeros(x.shape[1], x.shape[0], dtype=torch.float32, device=device))
             for name, x in (("dq", q), ("dk", k), ("dv", v))}
    # D = rowsum(dO∘O) from the exact output, and its bound b_D = rowsum(|dO|∘b_O) (and logit part).
    delta = (dout.to(F64) * result.out).sum(-1).T
    bound_delta = (dout.abs().to(F64) * result.bounds["out"].to(F64)).sum(-1).T
    logit_delta = dout.abs().to(F64).sum(-1).T * result.logit_bounds["out"]

    for bucket in _buckets(problem, inputs):
        q_chunk, kv_chunk = chunk_sizes(bucket)
        for q0, q1 in chunks(bucket.q_pad, q_chunk):
            do = bucket.output_rows(dout, q0, q1, F64)
            row_lse, row_delta, row_bd, row_ld, row_r = (
                bucket.row_view(x, q0, q1).unsqueeze(-1)
                for x in (result.lse, delta, bound_delta, logit_delta, r_rows)
            )
            acc_dq = [0.0, 0.0, 0.0]
            for k0, k1 in chunks(bucket.kv_pad, kv_chunk):
                c = _Chunk(bucket, inputs, q0, q1, k0, k1)
                p = c.probs(row_lse.squeeze(-1))
                dp = do @ c.v.transpose(-1, -2)
                ds = p * (dp - row_delta)
                envelope = p * (c.logit_magnitude + row_r)
                visible = c.mask.to(F64)
                logit_ds = p * row_ld + w * envelope * (dp - row_delta).abs()
                b_ds = (u * ds.abs() + p * (u * (do.abs() @ c.v.abs().transpose(-1, -2)) + row_bd)
                        + w * envelope * (dp - row_delta).abs() + eta * visible)
                k_abs, q_abs = c.k.abs(), c.q.abs()
                for i, (term, keys) in enumerate(((ds, c.k), (b_ds, k_abs), (logit_ds, k_abs))):
                    acc_dq[i] = acc_dq[i] + scale * term @ keys
                per_key = {
                    "dk": (scale * ds.transpose(-1, -2) @ c.q, scale * b_ds.transpose(-1, -2) @ q_abs,
                           scale * logit_ds.transpose(-1, -2) @ q_abs),
                    "dv": (p.transpose(-1, -2) @ do,
                           (u * p + w * envelope + eta * visible).transpose(-1, -2) @ do.abs(),
                           (w * envelope).transpose(-1, -2) @ do.abs()),
                }
                kv_rows, kv_valid = bucket.kv_rows[:, k0:k1], bucket.kv_valid[:, k0:k1]
                for name, (value, part, logit_part) in per_key.items():
                    target_value, target_part, target_logit = grads[name]
                    scatter_rows(target_value, kv_rows, kv_valid, reduce_groups(value, problem), True)
                    scatter_rows(target_part, kv_rows, kv_valid, reduce_groups(part, problem), True)
                    # Summing per-chunk row maxima bounds the row maximum of the sum.
                    row_max = reduce_groups(logit_part, problem).amax(-1)
                    scatter_row_heads(target_logit, kv_rows, kv_valid, row_max, True)
            q_rows, q_valid = bucket.q_rows[:, q0:q1], bucket.q_valid[:, q0:q1]
            dq_terms = (acc_dq[0], acc_dq[1], acc_dq[2].amax(-1))
            if problem.broadcast_q:
                q_rows, q_valid, *dq_terms = sum_broadcast_rows(q_rows, q_valid, *dq_terms)
            value, part, logit_part = grads["dq"]
            scatter_rows(value, q_rows, q_valid, dq_terms[0], accumulate=True)
            scatter_rows(part, q_rows, q_valid, dq_terms[1], accumulate=True)
            scatter_row_heads(logit_part, q_rows, q_valid, dq_terms[2], accumulate=True)

    for name, (value, part, logit_part) in grads.items():
        result.values[name] = value
        result.bounds[name] = part.add_(u * value.abs()).add_(eta)
        result.logit_bounds[name] = logit_part
