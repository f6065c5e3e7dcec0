"""The rows of a subset of a case's sequences: their inputs as a batch of their own, and where each result
tensor holds their rows. Shared by the batch-invariance checks (`verify.invariants`) and by the grading of a
case too large for a whole reference (`verify.graded`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from jfa.problem import Problem


def sub_batch(problem: Problem, inputs, order: list[int]):
    """The case's inputs (a `fixtures.CaseInputs`) restricted to sequences `order` (in that order), and per
    sequence the old rows of its q/out and kv rows (their new rows follow in order). The sub-batch's call has
    no max_*_len: its maxima are not the case's, and a kernel whose arithmetic depends on them shows up too."""
    q_parts, out_parts, kv_parts = sequence_rows(problem, order)

    def offsets(parts):
        return offsets_of(torch.tensor([p.numel() for p in parts], dtype=torch.int64))

    device = inputs.q.device
    out_rows, kv_rows = cat_rows(out_parts).to(device), cat_rows(kv_parts).to(device)
    q = inputs.q if problem.broadcast_q else inputs.q[cat_rows(q_parts).to(device)]
    k, v = inputs.k[kv_rows], inputs.v[kv_rows]
    dout = inputs.dout[out_rows]
    q_offsets = None if problem.broadcast_q else offsets(q_parts).to(device)
    kwargs = {**inputs.kwargs, "max_q_len": None, "max_kv_len": None}
    sub = replace(inputs, q=q, k=k, v=v, q_offsets=q_offsets, kv_offsets=offsets(kv_parts).to(device), dout=dout,
                  kwargs=kwargs)
    return sub, out_parts, kv_parts


def sequence_rows(problem: Problem, order: list[int]):
    """Per sequence of `order`, its rows of q, of out (and dout) and of k/v: three lists of index tensors."""
    def rows(offsets):
        return [torch.arange(int(offsets[b]), int(offsets[b + 1])) for b in order]

    return rows(problem.q_offsets_host), rows(problem.out_offsets_host), rows(problem.kv_offsets_host)


def tensor_rows(problem: Problem, out_parts, kv_parts) -> dict:
    """Which per-sequence rows (and along which axis) each result tensor holds: {name: (parts, axis)}; dq only
    without broadcast_q, whose dq is every sequence's sum."""
    per_tensor = {"out": (out_parts, 0), "lse": (out_parts, 1), "dk": (kv_parts, 0), "dv": (kv_parts, 0)}
    if not problem.broadcast_q:
        per_tensor["dq"] = (out_parts, 0)  # q rows and out rows coincide without broadcast
    return per_tensor


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """int32 offsets [B+1] of int64 sequence lengths [B] (on their device)."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
