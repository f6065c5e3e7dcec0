"""The "ideal kernel" model: what a flash kernel with FlashAttention-2's rounding points computes.

fp32 scores S = scale·(QKᵀ) from the input-dtype operands (products exact, fp32 sums); fp32 softmax with
the final row max m and sum l; the unnormalised P̃ = exp(S - m) rounded to the input dtype before the PV
product; O = (round(P̃) V) / l accumulated in fp32 and rounded. Backward: P = exp(S - m) / l recomputed from
the stored m and l (robust for huge logits, where lse = m + log l loses log l in fp32), D = rowsum(dO∘O)
from the rounded output, dS = P∘(dP - D) rounded before the dQ and dK products, P rounded before dV; all
gradient sums in fp32, rounded once. Its error against the float64 reference is the same-dtype baseline
that kernels are judged against. Runs on the CPU or GPU, in the input dtype, chunked like the reference.
"""

from __future__ import annotations

import contextlib
import math

import torch

from jfa.problem import Problem
from reference.buckets import (
    buckets,
    chunk_sizes,
    chunks,
    head_map,
    reduce_groups,
    scatter_rows,
    sum_broadcast_rows,
)

F32 = torch.float32


@contextlib.contextmanager
def _exact_fp32_matmul():
    """fp32 matmuls in true fp32: TF32 would round the operands and is not what a kernel's MMA does."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(F32)


class _Scores:
    def __init__(self, bucket, q, k, hmap, scale, q0, q1, k0, k1):
        self.mask = bucket.visible(q0, q1, k0, k1)
        self.k = bucket.keys(k, k0, k1, F32, hmap)
        self.q = bucket.queries(q, q0, q1, F32)
        self.s = ((self.q @ self.k.transpose(-1, -2)) * scale).masked_fill(~self.mask, -math.inf)

    def unnormalised(self, m: torch.Tensor) -> torch.Tensor:
        """P̃ = exp(S - m), 0 where invisible (also for empty rows, where m = -inf)."""
        p = torch.exp(self.s - m.unsqueeze(-1))
        return torch.where(self.mask, p, torch.zeros((), dtype=F32, device=p.device))


class Bf16Model:
    name = "bf16-model"
    description = "ideal bf16/fp16 flash kernel in PyTorch (FlashAttention-2 rounding points)"

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def invariance_waivers(self, device: torch.device) -> dict[str, str]:
        """The model promises bitwise batch and padding invariance on the CPU only: cuBLAS picks its kernels
        by matrix shape and pointer alignment, so on a GPU a sequence's bits depend on its bucket."""
        if device.type == "cuda":
            return {"batch": "bf16-model on CUDA: cuBLAS picks kernels by shape and alignment (a baseline, "
                             "not a product kernel)"}
        return {}

    def forward(self, q, k, v, problem: Problem):
        device, dtype = q.device, q.dtype
        hq, rows = problem.q_heads, problem.out_rows
        hmap = head_map(problem, device)
        out = torch.zeros(rows, hq, problem.head_dim_v, dtype=dtype, device=device)
        row_max = torch.full((hq, rows), -math.inf, dtype=F32, device=device)
        row_sum = torch.zeros(hq, rows, dtype=F32, device=device)
        with _exact_fp32_matmul(), torch.no_grad():
            for bucket in buckets(problem, device):
                q_chunk, kv_chunk = chunk_sizes(bucket)
                for q0, q1 in chunks(bucket.q_pad, q_chunk):
                    blocks = list(chunks(bucket.kv_pad, kv_chunk))
                    m = None
                    for k0, k1 in blocks:
                        part = _Scores(bucket, q, k, hmap, problem.sm_scale, q0, q1, k0, k1).s.amax(-1)
                        m = part if m is None else torch.maximum(m, part)
                    acc = l_sum = 0.0
                    for k0, k1 in blocks:
                        sc = _Scores(bucket, q, k, hmap, problem.sm_scale, q0, q1, k0, k1)
                        p = sc.unnormalised(m)
                        l_sum = l_sum + p.sum(-1)
                        v_c = bucket.keys(v, k0, k1, F32, hmap)
                        acc = acc + _round(p, dtype) @ v_c
                    # Rows with no visible key: l = 0, out = 0 (not 0/0).
                    o = torch.where(l_sum.unsqueeze(-1) > 0, acc / l_sum.unsqueeze(-1), 0.0)
                    rows_sel, valid = bucket.out_rows[:, q0:q1], bucket.q_valid[:, q0:q1]
                    scatter_rows(out, rows_sel, valid, o, accumulate=False)
                    idx = rows_sel[valid]
                    row_max[:, idx] = m.permute(0, 2, 1)[valid].T
                    row_sum[:, idx] = l_sum.permute(0, 2, 1)[valid].T
        lse = torch.where(row_sum > 0, row_max + torch.log(row_sum), -math.inf)
        return out, lse, (row_max, row_sum)

    def backward(self, dout, q, k, v, out, lse, residuals, problem: Problem):
        row_max, row_sum = residuals
        device, dtype = q.device, q.dtype
        hmap = head_map(problem, device)
        dq = torch.zeros(q.shape, dtype=F32, device=device)
        dk = torch.zeros(k.shape, dtype=F32, device=device)
        dv = torch.zeros(v.shape, dtype=F32, device=device)
        delta = (dout.to(F32) * out.to(F32)).sum(-1).T
        with _exact_fp32_matmul(), torch.no_grad():
            for bucket in buckets(problem, device):
                q_chunk, kv_chunk = chunk_sizes(bucket)
                for q0, q1 in chunks(bucket.q_pad, q_chunk):
                    do = bucket.output_rows(dout, q0, q1, F32)
                    m, l_sum, d = (bucket.row_view(x, q0, q1) for x in (row_max, row_sum, delta))
                    inv_l = torch.where(l_sum > 0, 1.0 / l_sum, 0.0).unsqueeze(-1)
                    acc_dq = 0.0
                    for k0, k1 in chunks(bucket.kv_pad, kv_chunk):
                        sc = _Scores(bucket, q, k, hmap, problem.sm_scale, q0, q1, k0, k1)
                        p = sc.unnormalised(m) * inv_l
                        v_c = bucket.keys(v, k0, k1, F32, hmap)
                        ds = _round(p * (do @ v_c.transpose(-1, -2) - d.unsqueeze(-1)), dtype)
                        acc_dq = acc_dq + ds @ sc.k
                        kv_rows, kv_valid = bucket.kv_rows[:, k0:k1], bucket.kv_valid[:, k0:k1]
                        for target, values in (
                            (dk, ds.transpose(-1, -2) @ sc.q),
                            (dv, _round(p, dtype).transpose(-1, -2) @ do),
                        ):
                            scatter_rows(target, kv_rows, kv_valid, reduce_groups(values, problem), True)
                    q_rows, q_valid = bucket.q_rows[:, q0:q1], bucket.q_valid[:, q0:q1]
                    if problem.broadcast_q:
                        q_rows, q_valid, acc_dq = sum_broadcast_rows(q_rows, q_valid, acc_dq)
                    scatter_rows(dq, q_rows, q_valid, acc_dq, True)
        scale = problem.sm_scale
        return (dq * scale).to(dtype), (dk * scale).to(dtype), dv.to(dtype)


BACKEND = Bf16Model()
