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


@functools.cache
def _parameters(fn) -> frozenset[str]:
    """A function's parameter names, looked up once: `inspect.signature` on every call would add tens of
    microseconds of adapter time to the peer's measured time."""
    return frozenset(inspect.signature(fn).parameters)


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

        params = _parameters(varlen_attn)
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


FLEX_BLOCK = 128  # FlexAttention's default sparse block (rows and columns of one BlockMask entry)


def _intervals_to_indices(first: torch.Tensor, count: torch.Tensor, width: int,
                          skip_first: torch.Tensor | None = None, skip_count: torch.Tensor | None = None):
    """Per row r, the block indices first[r] .. first[r] + count[r] - 1, less skip_count[r] of them from
    skip_first[r] on, packed to the left of an int32 [rows, width] table (BlockMask's kv_indices layout)."""
    n = torch.arange(width, device=first.device)
    index = first[:, None] + n[None, :]
    if skip_first is not None:
        skipped = n[None, :] >= (skip_first - first)[:, None]
        index = torch.where(skipped, index + skip_count[:, None], index)
        count = count - skip_count
    return count.to(torch.int32), torch.where(n[None, :] < count[:, None], index, 0).to(torch.int32)


def jagged_block_tables(problem: Problem, device: torch.device):
    """FlexAttention's block tables (BlockMask.from_kv_blocks' kv_num_blocks, kv_indices,
    full_kv_num_blocks, full_kv_indices) for the packed jagged batch, built from the offsets.

    `create_block_mask` evaluates mask_mod on every (query, key) pair of the packed batch: eagerly that is a
    [Tq, Tk] tensor (490 GiB for the GEM-like benchmark row), compiled it is a compilation per batch shape
    that the suite's thousands of shapes cannot afford. The block structure of a jagged batch follows from
    its offsets: each query row sees a contiguous key range, so each row block of FLEX_BLOCK queries sees
    the key blocks between the first and the last key its rows see (partial blocks, mask_mod applied), and
    a key block that every row of a one-sequence row block sees entirely is full (mask_mod skipped).
    """
    block = FLEX_BLOCK
    q_rows, kv_rows = problem.out_rows, problem.kv_rows
    q_blocks, kv_blocks = -(-q_rows // block), -(-kv_rows // block)
    sequences = torch.arange(problem.batch, device=device)
    q_lens, kv_lens = problem.q_lens.to(device), problem.kv_lens.to(device)
    seq = torch.repeat_interleave(sequences, q_lens)
    i = torch.arange(q_rows, device=device) - problem.out_offsets.long()[seq]
    kv_start, kv_len, q_len = problem.kv_offsets.long()[seq], kv_lens[seq], q_lens[seq]
    lo, hi = torch.zeros_like(i), kv_len - 1
    if problem.window is not None:
        lo, hi = torch.maximum(lo, i - problem.window), torch.minimum(hi, i + problem.window)
    if problem.causal:
        hi = torch.minimum(hi, i + kv_len - q_len)
    sees = lo <= hi
    lo, hi = kv_start + lo, kv_start + hi  # packed key rows
    row_block = torch.arange(q_rows, device=device) // block

    def per_row_block(values, reduce, empty):
        out = torch.full((q_blocks,), empty, dtype=torch.long, device=device)
        return out.scatter_reduce(0, row_block[sees], values[sees], reduce, include_self=False)

    first = per_row_block(lo // block, "amin", 0)
    last = per_row_block(hi // block, "amax", -1)
    count = (last - first + 1).clamp(min=0)
    # Full key blocks: a complete row block inside one sequence, every row seeing the whole key block.
    rows_seeing = torch.zeros(q_blocks, dtype=torch.long, device=device).index_add_(0, row_block, sees.long())
    one_sequence = per_row_block(seq, "amin", -1) == per_row_block(seq, "amax", -2)
    complete = (rows_seeing == block) & one_sequence
    common_lo, common_hi = per_row_block(lo, "amax", 0), per_row_block(hi, "amin", -1)
    full_first = -(-common_lo // block)
    full_last = (common_hi + 1) // block - 1  # a short last key block stays partial: mask_mod masks its padding
    full_count = torch.where(complete, (full_last - full_first + 1).clamp(min=0), 0)
    full_first = torch.where(full_count > 0, full_first, first)

    kv_num, kv_index = _intervals_to_indices(first, count, max(kv_blocks, 1), full_first, full_count)
    full_num, full_index = _intervals_to_indices(full_first, full_count, max(kv_blocks, 1))
    return tuple(t[None, None] for t in (kv_num, kv_index, full_num, full_index))


def _flex_jagged(q, k, v, block_tables, lookups, *, seq_lengths, scale, enable_gqa, window, causal):
    """flex_attention over the packed batch with the document mask. One function, compiled as a whole on
    CUDA: the mask_mod is built inside from the lookup tensors it receives, so they are graph inputs (a
    mask_mod closing over fresh tensors on every call is a new function to Dynamo each time)."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

    q_seq, kv_seq, q_start, kv_start, q_len, kv_len = lookups

    def document_mask(b, h, q_idx, kv_idx):
        qs, ks = q_seq[q_idx], kv_seq[kv_idx]
        i, j = q_idx - q_start[qs], kv_idx - kv_start[ks]
        return (qs == ks) & visible_torch(i, j, q_len[qs], kv_len[qs], window, causal)

    block_mask = BlockMask.from_kv_blocks(*block_tables, BLOCK_SIZE=FLEX_BLOCK, mask_mod=document_mask,
                                          seq_lengths=seq_lengths)
    out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                              return_aux=AuxRequest(lse=True))
    return out, aux.lse


class Flex:
    name = "flex"
    gating = False
    description = "torch.nn.attention.flex_attention, jagged batch as a document mask (compiled on CUDA)"

    def unavailable(self, device: torch.device) -> str | None:
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError as error:
            return f"torch {torch.__version__} has no flex_attention ({error})"
        return None

    def invariance_waivers(self, device: torch.device) -> dict[str, str]:
        return {"guarded_allocations": "flex_attention runs through torch.compile (eagerly too), which refuses to "
                                       "trace under the suite's allocation-guarding dispatch mode (verify.guards)"}

    @staticmethod
    @functools.cache
    def _kernel(device_type: str):
        # Compiled as FlexAttention's documentation does it (automatic dynamic shapes after the first
        # recompilation), as one graph: after a graph break flex_attention would run eagerly, materialising
        # [B, H, Tq, Tk] scores (thousands of GiB on the benchmark rows). Eager on the CPU, where compiling
        # would cost more than it saves on small cases.
        if device_type != "cuda":
            return _flex_jagged
        compiled = torch.compile(_flex_jagged, fullgraph=True)

        def call(*args, **kwargs):
            # A compilation per head dims, dtype, mask kind, GQA and grad mode: the suite meets dozens, past
            # torch.compile's default of 8 per function (the premerge run of 2026-11-29 hit that limit).
            with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
                return compiled(*args, **kwargs)

        return call

    def __call__(self, q, k, v, problem: Problem):
        device = q.device
        q = _jagged_queries(q, problem)
        # Per-sequence lookup tables padded with two sentinel sequences, so the mask_mod's lookups stay in
        # bounds for the padding rows of the last block (a query sentinel never meets a key sentinel).
        batch = problem.batch

        def sequence_of_rows(lengths, rows, sentinel):
            padding = -(-max(rows, 1) // FLEX_BLOCK) * FLEX_BLOCK - rows
            return torch.cat([torch.repeat_interleave(torch.arange(batch), lengths),
                              torch.full((padding,), sentinel)]).to(device)

        pad = torch.zeros(2, dtype=torch.long, device=device)
        lookups = (sequence_of_rows(problem.q_lens, problem.out_rows, batch),
                   sequence_of_rows(problem.kv_lens, problem.kv_rows, batch + 1),
                   torch.cat([problem.out_offsets[:-1].long(), pad]), torch.cat([problem.kv_offsets[:-1].long(), pad]),
                   torch.cat([problem.q_lens.to(device), pad]), torch.cat([problem.kv_lens.to(device), pad]))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            out, lse = self._kernel(device.type)(
                *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), jagged_block_tables(problem, device),
                lookups, seq_lengths=(problem.out_rows, problem.kv_rows), scale=problem.sm_scale,
                enable_gqa=problem.kv_heads != problem.q_heads, window=problem.window, causal=problem.causal)
        return out.squeeze(0).transpose(0, 1), lse.squeeze(0).float()


TORCH_VARLEN = TorchVarlen()
FLEX = Flex()

