"""Dense, padded views of a jagged batch, for the pure-PyTorch implementations (reference, bf16 model).

Sequences are grouped by their lengths padded to powers of two, so a batch of 32k tiny sequences is a few
dense tensor operations instead of 32k Python iterations, and one 64k-token sequence is a single group
processed in query × key chunks. Padding never changes a result: padded keys are invisible, padded query
rows are never scattered back, and every padded position reads zeros (`gather_heads`, `Bucket.row_view`), never
another sequence's data, which a product at weight 0 would pass on if it were NaN or infinite.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from jfa.mask import visible_torch
from jfa.problem import Problem

# Elements of one [G, H, q_chunk, kv_chunk] score block: bounds the working set of every chunked loop
# (2M float64 = 16 MiB per temporary; a backward chunk holds a few dozen).
DEFAULT_BLOCK_ELEMENTS = 1 << 21


def _pow2_at_least(n: torch.Tensor) -> torch.Tensor:
    n = n.clamp(min=1).to(torch.float64)
    return torch.exp2(torch.ceil(torch.log2(n))).to(torch.int64)


@dataclass
class Bucket:
    """G sequences padded to q_pad query rows and kv_pad key rows; index tensors live on `device`."""

    seqs: torch.Tensor  # host [G] sequence indices
    q_pad: int
    kv_pad: int
    q_lens: torch.Tensor  # [G]
    kv_lens: torch.Tensor  # [G]
    q_rows: torch.Tensor  # [G, q_pad] row of q read for (g, i); 0 where padded
    out_rows: torch.Tensor  # [G, q_pad] row of out/lse written for (g, i)
    kv_rows: torch.Tensor  # [G, kv_pad] row of k/v
    q_valid: torch.Tensor  # [G, q_pad]
    kv_valid: torch.Tensor  # [G, kv_pad]
    problem: Problem
    identical_keys: torch.Tensor | None = None  # [G, Hq, 1, 1], set by the float64 reference

    def visible(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """[G, 1, q1-q0, k1-k0]: the contract's visibility of keys k0:k1 to query rows q0:q1."""
        device = self.q_lens.device
        i = torch.arange(q0, q1, device=device).view(1, -1, 1)
        j = torch.arange(k0, k1, device=device).view(1, 1, -1)
        q_len = self.q_lens.view(-1, 1, 1)
        kv_len = self.kv_lens.view(-1, 1, 1)
        mask = visible_torch(i, j, q_len, kv_len, self.problem.window, self.problem.causal)
        return (mask & (i < q_len)).unsqueeze(1)

    def queries(self, q: torch.Tensor, q0: int, q1: int, dtype: torch.dtype) -> torch.Tensor:
        """Query rows q0:q1 of q as [G, Hq, q1-q0, D], zeros where padded (`gather_heads`)."""
        return gather_heads(q, self.q_rows[:, q0:q1], self.q_valid[:, q0:q1], dtype)

    def output_rows(self, x: torch.Tensor, q0: int, q1: int, dtype: torch.dtype) -> torch.Tensor:
        """The output rows (out, dout) of query rows q0:q1 as [G, Hq, q1-q0, Dv], zeros where padded."""
        return gather_heads(x, self.out_rows[:, q0:q1], self.q_valid[:, q0:q1], dtype)

    def keys(self, x: torch.Tensor, k0: int, k1: int, dtype: torch.dtype, head_map: torch.Tensor) -> torch.Tensor:
        """Key rows k0:k1 of k or v as [G, Hq, k1-k0, D] (each query head's key/value head), zeros where
        padded."""
        return gather_heads(x, self.kv_rows[:, k0:k1], self.kv_valid[:, k0:k1], dtype, head_map)

    def row_view(self, x: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
        """[Hq, rows] per-row data (statistics, D) as [G, Hq, q1-q0] for query rows q0:q1, 0 where padded
        (padded rows index row 0: see `gather_heads`)."""
        return x[:, self.out_rows[:, q0:q1]].masked_fill(~self.q_valid[:, q0:q1], 0).permute(1, 0, 2)


def buckets(problem: Problem, device: torch.device, block_elements: int = DEFAULT_BLOCK_ELEMENTS
            ) -> Iterator[Bucket]:
    """Groups the sequences that have query rows into buckets of equal padded shape."""
    q_lens, kv_lens = problem.q_lens, problem.kv_lens
    has_rows = torch.nonzero(q_lens > 0).flatten()
    if has_rows.numel() == 0:
        return
    q_pad = _pow2_at_least(q_lens[has_rows])
    kv_pad = _pow2_at_least(kv_lens[has_rows])
    keys = q_pad * (1 << 32) + kv_pad
    for key in torch.unique(keys):
        members = has_rows[keys == key]
        qp, kp = int(key) >> 32, int(key) & 0xFFFFFFFF
        # Enough sequences per group to amortise Python overhead, few enough to bound memory.
        per_group = max(1, block_elements // (problem.q_heads * qp * kp))
        for start in range(0, members.numel(), per_group):
            yield _make_bucket(problem, members[start:start + per_group], qp, kp, device)


def _make_bucket(problem: Problem, seqs: torch.Tensor, q_pad: int, kv_pad: int, device) -> Bucket:
    q_lens, kv_lens = problem.q_lens[seqs], problem.kv_lens[seqs]
    i = torch.arange(q_pad).view(1, -1)
    j = torch.arange(kv_pad).view(1, -1)
    q_valid = i < q_lens.view(-1, 1)
    kv_valid = j < kv_lens.view(-1, 1)
    q_rows = torch.where(q_valid, problem.q_offsets_host[seqs].view(-1, 1) + i, 0)
    out_rows = torch.where(q_valid, problem.out_offsets_host[seqs].view(-1, 1) + i, 0)
    kv_rows = torch.where(kv_valid, problem.kv_offsets_host[seqs].view(-1, 1) + j, 0)
    return Bucket(
        seqs=seqs, q_pad=q_pad, kv_pad=kv_pad,
        q_lens=q_lens.to(device), kv_lens=kv_lens.to(device),
        q_rows=q_rows.to(device), out_rows=out_rows.to(device), kv_rows=kv_rows.to(device),
        q_valid=q_valid.to(device), kv_valid=kv_valid.to(device), problem=problem,
    )


def chunks(length: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, length, size):
        yield start, min(length, start + size)


def chunk_sizes(bucket: Bucket, block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> tuple[int, int]:
    """Query and key chunk lengths whose score block stays within `block_elements` per sequence.

    They depend on the padded lengths only, never on how many sequences share the bucket, so a sequence is
    chunked (and its sums ordered) the same alone and in any batch: the bf16 model is batch invariant.
    (`buckets` bounds the group so that whole small sequences fit the budget together.)
    """
    heads = bucket.problem.q_heads
    kv_chunk = min(bucket.kv_pad, max(1, block_elements // (heads * min(bucket.q_pad, 1024))))
    q_chunk = min(bucket.q_pad, max(1, block_elements // (heads * kv_chunk)))
    return q_chunk, kv_chunk


def gather_heads(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype,
                 head_map: torch.Tensor | None = None) -> torch.Tensor:
    """x[rows] as [G, H, L, D] in `dtype`, zeros where `valid` is False; head_map expands key/value heads to
    query heads (GQA).

    Rows of padding index row 0, a row of some sequence (or of nothing: an empty x, a batch without keys),
    and are zeroed: masks drop padded positions, but a padded value multiplied at weight 0 would still bring
    a NaN or infinity of that row into the products of the sequences sharing the bucket (0·NaN = NaN).
    The result is contiguous: torch's CPU matmul takes a different path for a strided operand when G = 1
    than when G > 1, which would make a sequence's bits depend on how many sequences share its bucket.
    """
    if x.shape[0] == 0:
        x = x.new_zeros(1, *x.shape[1:])
    g = x[rows.flatten()].to(dtype).masked_fill(~valid.reshape(-1, 1, 1), 0)
    if head_map is not None:
        g = g.index_select(1, head_map)
    return g.view(*rows.shape, *g.shape[1:]).permute(0, 2, 1, 3).contiguous()


def scatter_rows(target: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, values: torch.Tensor,
                 accumulate: bool) -> None:
    """Writes (or adds) values [G, H, L, D] into target [rows, H, D] at the valid rows."""
    vals = values.permute(0, 2, 1, 3)[valid]
    idx = rows[valid]
    if accumulate:
        target.index_add_(0, idx, vals.to(target.dtype))
    else:
        target[idx] = vals.to(target.dtype)


def sum_broadcast_rows(rows: torch.Tensor, valid: torch.Tensor, *values: torch.Tensor):
    """With broadcast-Q every sequence of a group reads the same query rows: their dq terms ([G, H, L, D] or
    [G, H, L]) summed over the group in a fixed order, with the first sequence's rows and validity, to be
    scattered once. (index_add_ of repeated rows is atomic, so run-dependent, on CUDA.)"""
    summed = []
    for x in values:
        mask = valid[:, None, :, None] if x.dim() == 4 else valid[:, None, :]
        summed.append(torch.where(mask, x, 0.0).sum(0, keepdim=True))
    return rows[:1], valid[:1], *summed


def scatter_row_heads(target: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, values: torch.Tensor,
                      accumulate: bool) -> None:
    """Writes (or adds) per-row values [G, H, L] into target [H, rows] at the valid rows."""
    vals = values.permute(0, 2, 1)[valid].T.to(target.dtype)
    idx = rows[valid]
    if accumulate:
        target.index_add_(1, idx, vals)
    else:
        target[:, idx] = vals


def head_map(problem: Problem, device) -> torch.Tensor:
    """Key/value head of each query head."""
    return torch.arange(problem.q_heads, device=device) // problem.group_size


def reduce_groups(x: torch.Tensor, problem: Problem) -> torch.Tensor:
    """Sums a [G, Hq, L, D] per-query-head gradient over each group into [G, Hkv, L, D]."""
    g, _, length, d = x.shape
    return x.view(g, problem.kv_heads, problem.group_size, length, d).sum(2)
