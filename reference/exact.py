"""The float64 reference: exact softmax per sequence, analytic backward, and the componentwise error bound.

Inputs are the caller's bf16/fp16 tensors upcast to float64, so input rounding is not counted as kernel
error. Work is chunked over queries and keys (see `buckets`), so one 65,536-token sequence with 8 heads
and D = 128 runs within a few GiB; it runs on whatever device the inputs are on (an H200 does float64 at
~56 TFLOP/s). The lse is computed first over all keys, so P = exp(S - lse) is exact rather than rescaled.

Bounds (`bound_*`, float32) follow the first-order rounding model of DESIGN.md, per element:
  b_O  = u(|O| + P|V|)                      + w E|V|
  b_dV = u(|dV| + Pᵀ|dO|)                    + w Eᵀ|dO|
  b_D  = rowsum(|dO| ∘ b_O)
  b_dS = u|dS| + P∘(u|dO||V|ᵀ + b_D)        + w E∘|dP - D|
  b_dQ = u|dQ| + scale b_dS |K|,  b_dK = u|dK| + scale b_dSᵀ |Q|
  b_lse = u32 (2|lse| + 2 log2(n + 1) + 4)  + w r
with u the input dtype's unit roundoff, and a term DESIGN.md's set leaves out: the fp32 rounding of the
logits themselves. A logit s = scale·q·k summed in fp32 over D terms (then scaled, and scaled by log2 e
in exp2-based kernels) is off by up to w·a with w = (D + 2)·u32 and a = scale·|q|·|k|; to first order
that moves P_ij by P_ij(Δs_ij - Σ_k P_ik Δs_ik), so |ΔP| <= w E with E = P∘(A + r), A = scale|Q||K|ᵀ and
r = rowsum(P∘A). It is negligible for ordinary activations (w·a ~ 1e-5 against u ~ 4e-3) and dominant
for logits of magnitude ~1e4 and more, where every fp32 kernel, the bf16 model included, is that far off.
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
    gather_heads,
    head_map,
    reduce_groups,
    scatter_rows,
)

F64 = torch.float64
U32 = 2.0**-24


@dataclass
class Reference:
    out: torch.Tensor  # [out_rows, Hq, Dv] float64
    lse: torch.Tensor  # [Hq, out_rows] float64, -inf for rows with no visible key
    bound_out: torch.Tensor  # float32, like out
    bound_lse: torch.Tensor
    dq: torch.Tensor | None = None  # float64, like q
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    bound_dq: torch.Tensor | None = None
    bound_dk: torch.Tensor | None = None
    bound_dv: torch.Tensor | None = None

    def tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each computed tensor with its bound, by name (out, lse, dq, dk, dv)."""
        named = {"out": (self.out, self.bound_out), "lse": (self.lse, self.bound_lse)}
        if self.dq is not None:
            named.update(dq=(self.dq, self.bound_dq), dk=(self.dk, self.bound_dk), dv=(self.dv, self.bound_dv))
        return named


class _Chunk:
    """Float64 operands of one (bucket, query chunk, key chunk) block, shared by forward and backward."""

    def __init__(self, bucket: Bucket, inputs, q0, q1, k0, k1):
        q, k, v, hmap, scale = inputs
        self.mask = bucket.visible(q0, q1, k0, k1)
        self.q = gather_heads(q, bucket.q_rows[:, q0:q1], F64)
        self.k = gather_heads(k, bucket.kv_rows[:, k0:k1], F64, hmap)
        self.v = gather_heads(v, bucket.kv_rows[:, k0:k1], F64, hmap)
        self.scores = (scale * self.q @ self.k.transpose(-1, -2)).masked_fill(~self.mask, -math.inf)
        # A = scale |Q||K|ᵀ: the magnitude each fp32 logit is computed at (its rounding scales with it).
        self.logit_magnitude = scale * self.q.abs() @ self.k.abs().transpose(-1, -2)

    def probs(self, lse: torch.Tensor) -> torch.Tensor:
        """P = exp(S - lse), exactly 0 where invisible (also for rows with lse = -inf)."""
        p = torch.exp(self.scores - lse.unsqueeze(-1))
        return torch.where(self.mask, p, torch.zeros((), dtype=F64, device=p.device))


def _row_view(x: torch.Tensor, bucket: Bucket, q0: int, q1: int) -> torch.Tensor:
    """[Hq, rows] per-row data as [G, Hq, chunk] for the bucket's rows q0:q1."""
    return x[:, bucket.out_rows[:, q0:q1]].permute(1, 0, 2)


def reference(q, k, v, problem: Problem, dout: torch.Tensor | None = None, device=None) -> Reference:
    """Exact forward (and backward, when `dout` is given) with componentwise error bounds."""
    device = torch.device(device) if device is not None else q.device
    q, k, v = (x.detach().to(device) for x in (q, k, v))
    hq, rows, dv_dim = problem.q_heads, problem.out_rows, problem.head_dim_v
    u = problem.unit_roundoff
    w = (problem.head_dim + 2) * U32
    scale = problem.sm_scale
    inputs = (q, k, v, head_map(problem, device), scale)

    out = torch.zeros(rows, hq, dv_dim, dtype=F64, device=device)
    bound_out = torch.zeros(rows, hq, dv_dim, dtype=torch.float32, device=device)
    lse = torch.full((hq, rows), -math.inf, dtype=F64, device=device)
    bound_lse = torch.zeros(hq, rows, dtype=torch.float32, device=device)
    r_rows = torch.zeros(hq, rows, dtype=F64, device=device)

    for bucket in buckets(problem, device):
        q_chunk, kv_chunk = chunk_sizes(bucket)
        sel = bucket.out_rows
        for q0, q1 in chunks(bucket.q_pad, q_chunk):
            blocks = [(k0, k1) for k0, k1 in chunks(bucket.kv_pad, kv_chunk)]
            row_lse = None
            for k0, k1 in blocks:
                part = torch.logsumexp(_Chunk(bucket, inputs, q0, q1, k0, k1).scores, dim=-1)
                row_lse = part if row_lse is None else torch.logaddexp(row_lse, part)
            acc_out = acc_pv = acc_pav = 0.0
            r = count = 0.0
            for k0, k1 in blocks:
                c = _Chunk(bucket, inputs, q0, q1, k0, k1)
                p = c.probs(row_lse)
                pa = p * c.logit_magnitude
                acc_out = acc_out + p @ c.v
                acc_pv = acc_pv + p @ c.v.abs()
                acc_pav = acc_pav + pa @ c.v.abs()
                r = r + pa.sum(-1)
                count = count + c.mask.sum(-1)
            valid = bucket.q_valid[:, q0:q1]
            b_out = u * (acc_out.abs() + acc_pv) + w * (acc_pav + r.unsqueeze(-1) * acc_pv)
            scatter_rows(out, sel[:, q0:q1], valid, acc_out, accumulate=False)
            scatter_rows(bound_out, sel[:, q0:q1], valid, b_out, accumulate=False)
            b_lse = U32 * (2 * row_lse.abs() + 2 * torch.log2(count + 1.0) + 4) + w * r
            b_lse = torch.where(torch.isinf(row_lse), 0.0, b_lse)
            for target, values in ((lse, row_lse), (bound_lse, b_lse), (r_rows, r)):
                rows_idx = sel[:, q0:q1][valid]
                target[:, rows_idx] = values.permute(0, 2, 1)[valid].T.to(target.dtype)

    result = Reference(out=out, lse=lse, bound_out=bound_out, bound_lse=bound_lse)
    if dout is not None:
        _backward(result, r_rows, inputs, dout.detach().to(device), problem, u, w)
    return result


def _backward(result: Reference, r_rows, inputs, dout, problem: Problem, u: float, w: float) -> None:
    q, k, v, hmap, scale = inputs
    device = q.device
    dq = torch.zeros(q.shape, dtype=F64, device=device)
    dk = torch.zeros(k.shape, dtype=F64, device=device)
    dv = torch.zeros(v.shape, dtype=F64, device=device)
    part_dq = torch.zeros(q.shape, dtype=F64, device=device)
    part_dk = torch.zeros(k.shape, dtype=F64, device=device)
    part_dv = torch.zeros(v.shape, dtype=F64, device=device)
    # D = rowsum(dO∘O) from the exact output, and its bound b_D = rowsum(|dO|∘b_O).
    delta = (dout.to(F64) * result.out).sum(-1).T
    bound_delta = (dout.abs().to(F64) * result.bound_out.to(F64)).sum(-1).T

    for bucket in buckets(problem, device):
        q_chunk, kv_chunk = chunk_sizes(bucket)
        for q0, q1 in chunks(bucket.q_pad, q_chunk):
            do = gather_heads(dout, bucket.out_rows[:, q0:q1], F64)
            row_lse, row_delta, row_bd, row_r = (
                _row_view(x, bucket, q0, q1).unsqueeze(-1) for x in (result.lse, delta, bound_delta, r_rows)
            )
            acc_dq = acc_bdq = 0.0
            for k0, k1 in chunks(bucket.kv_pad, kv_chunk):
                c = _Chunk(bucket, inputs, q0, q1, k0, k1)
                p = c.probs(row_lse.squeeze(-1))
                dp = do @ c.v.transpose(-1, -2)
                ds = p * (dp - row_delta)
                envelope = p * (c.logit_magnitude + row_r)
                b_ds = (u * ds.abs() + p * (u * (do.abs() @ c.v.abs().transpose(-1, -2)) + row_bd)
                        + w * envelope * (dp - row_delta).abs())
                acc_dq = acc_dq + scale * ds @ c.k
                acc_bdq = acc_bdq + scale * b_ds @ c.k.abs()
                kv_rows, kv_valid = bucket.kv_rows[:, k0:k1], bucket.kv_valid[:, k0:k1]
                for target, values in (
                    (dk, scale * ds.transpose(-1, -2) @ c.q),
                    (part_dk, scale * b_ds.transpose(-1, -2) @ c.q.abs()),
                    (dv, p.transpose(-1, -2) @ do),
                    (part_dv, (u * p + w * envelope).transpose(-1, -2) @ do.abs()),
                ):
                    scatter_rows(target, kv_rows, kv_valid, reduce_groups(values, problem), accumulate=True)
            q_rows, q_valid = bucket.q_rows[:, q0:q1], bucket.q_valid[:, q0:q1]
            scatter_rows(dq, q_rows, q_valid, acc_dq, accumulate=True)
            scatter_rows(part_dq, q_rows, q_valid, acc_bdq, accumulate=True)

    result.dq, result.dk, result.dv = dq, dk, dv
    result.bound_dq = (u * dq.abs() + part_dq).float()
    result.bound_dk = (u * dk.abs() + part_dk).float()
    result.bound_dv = (u * dv.abs() + part_dv).float()
