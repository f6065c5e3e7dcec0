"""Peer implementations, adapted to the op contract for comparison: PyTorch's varlen_attn
(FlashAttention-2 inside PyTorch) and FlexAttention with a document mask.

Adapters translate the call and nothing else: where a peer's semantics differ from the contract (its
window is aligned bottom-right, its empty rows), the verify suite reports the difference. A feature a
peer cannot express raises `Unsupported`, which the suite reports as a skip with the reason.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

from jfa.mask import visible_torch
from jfa.problem import Problem


class Unsupported(NotImplementedError):
    """The peer cannot express this call."""


def _jagged_queries(q: torch.Tensor, problem: Problem) -> torch.Tensor:
    """broadcast_q as ordinary jagged queries: the shared sequence repeated per sequence (autograd sums
    the repeats' gradients, which is the contract's dq)."""
    if not problem.broadcast_q:
        return q
    return q.repeat(problem.batch, 1, 1)


class TorchVarlen:
    name = "torch-varlen"
    gating = False  # a peer is measured, not gated: the suite reports its failures as expected (xfail)
    description = "torch.nn.attention.varlen.varlen_attn (FlashAttention-2 inside PyTorch)"

    def unavailable(self, device: torch.device) -> str | None:
        try:
            from torch.nn.attention import varlen  # noqa: F401
        except ImportError as error:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen ({error})"
        if device.type != "cuda":
            return "varlen_attn runs on CUDA devices only"
        return None

    def __call__(self, q, k, v, problem: Problem):
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        params = inspect.signature(varlen_attn).parameters
        if problem.head_dim_v != problem.head_dim:
            raise Unsupported("FlashAttention-2 needs the value head dim to equal the query/key head dim")
        kwargs = dict(return_aux=AuxRequest(lse=True), scale=problem.sm_scale)
        if problem.kv_heads != problem.q_heads:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(problem.group_size, dim=1)
                v = v.repeat_interleave(problem.group_size, dim=1)
        if problem.window is not None or problem.causal:
            left = -1 if problem.window is None else problem.window
            right = 0 if problem.causal else problem.window
            if "window_size" in params:
                kwargs["window_size"] = (left, right)
            elif problem.window is None:
                kwargs["is_causal"] = True
            else:
                raise Unsupported(f"varlen_attn of torch {torch.__version__} has no window_size")
        out, lse = varlen_attn(
            _jagged_queries(q, problem), k, v, problem.out_offsets, problem.kv_offsets,
            problem.max_q_len, problem.max_kv_len, **kwargs,
        )
        if lse.shape[0] != problem.q_heads or lse.shape[0] == lse.shape[1] != problem.q_heads:
            lse = lse.transpose(0, 1)
        return out, lse.float()


class Flex:
    name = "flex"
    gating = False
    description = "torch.nn.attention.flex_attention with a jagged document mask (compiled on CUDA)"

    def unavailable(self, device: torch.device) -> str | None:
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError as error:
            return f"torch {torch.__version__} has no flex_attention ({error})"
        return None

    @staticmethod
    @functools.cache
    def _kernel(device_type: str):
        from torch.nn.attention.flex_attention import flex_attention

        # Compiled with dynamic shapes so that the suite's many case shapes share compilations; eager on
        # the CPU, where compiling would cost more than it saves on small cases.
        return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention

    def __call__(self, q, k, v, problem: Problem):
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

        device = q.device
        q = _jagged_queries(q, problem)
        q_seq = torch.repeat_interleave(torch.arange(problem.batch), problem.q_lens).to(device)
        kv_seq = torch.repeat_interleave(torch.arange(problem.batch), problem.kv_lens).to(device)
        q_start = problem.out_offsets[:-1].long()
        kv_start = problem.kv_offsets[:-1].long()
        q_len = (problem.out_offsets[1:] - problem.out_offsets[:-1]).long()
        kv_len = (problem.kv_offsets[1:] - problem.kv_offsets[:-1]).long()
        window, causal = problem.window, problem.causal

        def document_mask(b, h, q_idx, kv_idx):
            qs, ks = q_seq[q_idx], kv_seq[kv_idx]
            i, j = q_idx - q_start[qs], kv_idx - kv_start[ks]
            return (qs == ks) & visible_torch(i, j, q_len[qs], kv_len[qs], window, causal)

        # Compiled on CUDA: evaluated eagerly, the mask of a whole packed batch is materialised as [Tq, Tk]
        # (490 GiB for the GEM-like benchmark row on the H200).
        block_mask = create_block_mask(document_mask, None, None, q.shape[0], k.shape[0], device=device,
                                       _compile=device.type == "cuda")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            out, aux = self._kernel(device.type)(
                *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                block_mask=block_mask, scale=problem.sm_scale, enable_gqa=problem.kv_heads != problem.q_heads,
                return_aux=AuxRequest(lse=True),
            )
        return out.squeeze(0).transpose(0, 1), aux.lse.squeeze(0).float()


TORCH_VARLEN = TorchVarlen()
FLEX = Flex()

