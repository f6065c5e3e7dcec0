"""`jfa.attention`: validate, pick a backend, run it under one autograd function."""

from __future__ import annotations

import torch

from jfa import backends
from jfa.problem import Problem, StaleOffsets
from jfa.validation import validate


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend, problem: Problem):
        out, lse, residuals = backend.forward(q, k, v, problem)
        ctx.backend, ctx.problem = backend, problem
        ctx.save_for_backward(q, k, v, out, lse, *residuals)
        ctx.mark_non_differentiable(lse)
        # lse takes no gradient: without this autograd would allocate and zero-fill one ([Hq, rows] fp32) for
        # every backward; and a backward reached without a gradient of out has nothing to compute.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return None, None, None, None, None
        q, k, v, out, lse, *residuals = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(dout, q, k, v, out, lse, tuple(residuals), ctx.problem)
        return dq, dk, dv, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    *,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    sm_scale: float | None = None,
    window: int | None = None,
    causal: bool = False,
    broadcast_q: bool = False,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
):
    """Jagged (variable-length) multi-head attention.

    q [Tq, Hq, D] (with broadcast_q: one shared sequence [Lq, Hq, D] and q_offsets None), k [Tk, Hkv, D],
    v [Tk, Hkv, Dv], offsets int32/int64 [B+1]. Returns out [rows, Hq, Dv], and lse [Hq, rows] float32
    (natural log; -inf for a row with no visible key; not differentiable) when return_lse. The README
    states the whole contract.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    options = dict(max_q_len=max_q_len, max_kv_len=max_kv_len, sm_scale=sm_scale, window=window, causal=causal,
                   broadcast_q=broadcast_q, deterministic=deterministic)
    # Speculative validation: the host work a call needs (checks, tile schedule, allocations, launch
    # arguments) runs while the device still compares the offsets with validated ones; `Problem.confirm()`
    # waits for that answer before the first launch, and a StaleOffsets starts the call over without it.
    problem = validate(q, k, v, q_offsets, kv_offsets, **options, speculative=True)
    impl = backends.resolve(backend, problem.device)
    try:
        out, lse = _run(impl, q, k, v, problem)
    except StaleOffsets:
        problem = validate(q, k, v, q_offsets, kv_offsets, **options)
        out, lse = _run(impl, q, k, v, problem)
    return (out, lse) if return_lse else out


def _run(impl, q, k, v, problem: Problem):
    """The backend on `problem`. A backend that does not declare `speculative` gets a confirmed problem;
    one that does confirms before its first launch; either way the problem is confirmed before the outputs
    are returned (a forward with nothing to launch, a backward that relies on it)."""
    if not getattr(impl, "speculative", False):
        problem.confirm()
    if hasattr(impl, "forward"):
        out, lse = _KernelAttention.apply(q, k, v, impl, problem)
    else:
        out, lse = impl(q, k, v, problem)
    problem.confirm()
    return out, lse
