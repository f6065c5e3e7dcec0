"""Small builders shared by the unit tests."""

from __future__ import annotations

import os

import numpy as np
import torch

from jfa.validation import validate


def offsets(lengths) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out


def jagged_inputs(q_lens, kv_lens, q_heads=2, kv_heads=1, head_dim=8, head_dim_v=8, dtype=torch.bfloat16,
                  broadcast_q=False, seed=0):
    """Random q, k, v, offsets and dout for the given lengths (values ~ N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    q_rows = q_lens[0] if broadcast_q else sum(q_lens)
    out_rows = sum(q_lens)
    q = torch.randn(q_rows, q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(sum(kv_lens), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), kv_heads, head_dim_v, generator=gen).to(dtype)
    dout = torch.randn(out_rows, q_heads, head_dim_v, generator=gen).to(dtype)
    q_off = None if broadcast_q else offsets(q_lens)
    return q, k, v, q_off, offsets(kv_lens), dout


def rows_of(offsets: np.ndarray, lens: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """int64 row indices of the listed sequences, in order (offsets [B+1], lens [B])."""
    counts = lens[seqs]
    first = np.repeat(offsets[seqs] - (np.cumsum(counts) - counts), counts)
    return first + np.arange(int(counts.sum()), dtype=np.int64)


def problem_of(q, k, v, q_off, kv_off, **kwargs):
    defaults = dict(max_q_len=None, max_kv_len=None, sm_scale=None, window=None, causal=False,
                    broadcast_q=False, deterministic=False)
    defaults.update(kwargs)
    return validate(q, k, v, q_off, kv_off, **defaults)


def interpreter_unavailable() -> str | None:
    """Why the Triton kernels cannot run under the interpreter in this process, or None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET is not 1 (triton was imported before this module could set it)"
    from jfa.triton import backend

    if not backend.interpreted_consistently():
        return "triton was imported before TRITON_INTERPRET=1 was set in this process"
    return None


def counting_model(*args, **kwargs):
    """The bf16 model as a backend named by module:function ("tests.helpers:counting_model"), counting its
    calls in `counting_model.calls`."""
    from jfa.backends import attention_fn

    counting_model.calls += 1
    return attention_fn("bf16-model")[0](*args, **kwargs)


counting_model.calls = 0


class ScaledGradient(torch.autograd.Function):
    """Identity whose backward scales the gradient by `factor`, fixed at the forward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def drifting_model(q, *args, **kwargs):
    """The bf16 model ("tests.helpers:drifting_model") whose dq is scaled by 1 + 2^-6·n on its n-th call (steps
    of at least a bf16 ulp): every call's dq differs, its out, lse, dk and dv do not."""
    from jfa.backends import attention_fn

    drifting_model.calls += 1
    return attention_fn("bf16-model")[0](ScaledGradient.apply(q, 1 + 2.0**-6 * drifting_model.calls), *args, **kwargs)


drifting_model.calls = 0
