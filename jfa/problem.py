"""The validated description of one attention call, shared by every backend, the reference and the suite.

A `Problem` is built once per call by `jfa.validation.validate` (which also checks every rule); backends
read sequence bookkeeping from it instead of re-deriving it from the raw offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class StaleOffsets(Exception):
    """A speculative Problem's offsets values were not the caller's (they changed since they were validated):
    validate the call again without speculation."""


@dataclass(frozen=True, eq=False)
class Problem:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    sm_scale: float
    window: int | None
    causal: bool
    broadcast_q: bool
    deterministic: bool
    # Device int32 [B+1]: where sequence b's query rows are read (all 0 with broadcast_q), where its output,
    # lse and (without broadcast_q) dq rows are written, and where its key/value rows are read.
    q_offsets: torch.Tensor
    out_offsets: torch.Tensor
    kv_offsets: torch.Tensor
    # Host int64 copies: [B+1] offsets as above and [B] lengths; max_*_len bound the kernels' grids.
    q_offsets_host: torch.Tensor
    out_offsets_host: torch.Tensor
    kv_offsets_host: torch.Tensor
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    max_q_len: int
    max_kv_len: int
    q_rows: int
    out_rows: int
    kv_rows: int
    # Names the offsets' values (and, with broadcast_q, the shared query length): equal keys, equal lengths.
    # Tile-schedule caches key on it instead of comparing the lengths.
    lengths_key: tuple
    # For a speculative Problem (`validate(speculative=True)`): the pending device comparison of the caller's
    # offsets with the validated values the Problem was built from; None when they were compared already.
    confirmation: object = None

    def confirm(self) -> None:
        """Before the first launch that reads this Problem's offsets: returns once they are known to be the
        caller's, raises StaleOffsets if they are not."""
        if self.confirmation is not None and not self.confirmation.held():
            raise StaleOffsets("the offsets changed since the values this problem was built from were validated")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.q_heads // self.kv_heads

    @property
    def unit_roundoff(self) -> float:
        """u of the input dtype: 2^-8 for bf16, 2^-11 for fp16."""
        return torch.finfo(self.dtype).eps / 2
