"""Grading a case too large for a whole float64 reference on a sample of its sequences.

The reference keeps float64 values and float32 bounds of out, dq, dk and dv (12 bytes per element), and the
statistics make float64 temporaries of a tensor's size (about 9 at once: 72 bytes per element). For
offset_overflow's cases (2.75·10⁹ elements of q and k) that is past any single GPU: their forward test ran out
of memory in the reference on an H100 80GB (2026-12-06, 73.6 GiB in use). Sequences are independent, so the
reference of a sub-batch of sequences is exactly the reference of their rows in the whole batch: such a case's
call runs whole, as its kernel must, and out, lse, dq, dk and dv are graded on the rows of the sampled
sequences. The invariants, bitwise comparisons between whole runs, are unchanged.

The sample: the sequences with an element at index 2³¹ or beyond in a tensor the call reads or writes by rows (the
rows int32 addressing cannot reach, FAILURES.md: q, k, v and dout at their strides, the results contiguous), the
last and those nearest each tensor's limit first; then the first sequence; then sequences drawn at random (seeded
by the case); each while the sample's size stays within SAMPLE_BUDGET (3/4 of it for those past the limit).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from jfa.problem import Problem
from verify.sub_batch import cat_rows, sequence_rows, tensor_rows

# Elements of q and k (rows × heads × the larger head dim) up to which a case is graded whole. At the limit the
# reference and one tensor's statistics take about 12·2³⁰ + 72·2²⁹ bytes ≈ 52 GB at most; the largest case
# of the nightly profile graded whole, one_huge_many_tiny:201, has 6.5·10⁸ elements (about 31 GB).
WHOLE_LIMIT = 2**30
# Elements of q and k of the sampled sequences: a few GB of reference and statistics. It holds the rows past
# the int32 limit of both offset_overflow cases (6.6·10⁷ and 1.0·10⁸ elements).
SAMPLE_BUDGET = 2**27
INDEX_LIMIT = 2**31


@dataclass
class Sample:
    """The sequences of a case its results are graded on, and where their rows lie in the results."""

    order: list[int]  # ascending sequence indices
    batch: int
    past_limit: int  # how many of them have elements at index 2³¹ or beyond
    past_total: int  # ... of the case's sequences that have
    first: bool  # the first sequence is among them, not being past the limit
    rows: dict[str, tuple[torch.Tensor, int]]  # per result tensor: the sample's rows in it, and the rows' axis

    def view(self, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """t's rows of the sampled sequences (in the sub-batch's order), or None for a tensor not graded on a
        sample (dq with broadcast_q: every sequence's sum)."""
        if name not in self.rows:
            return None
        rows, axis = self.rows[name]
        return t.index_select(axis, rows.to(t.device))

    def describe(self) -> str:
        drawn = len(self.order) - self.past_limit - self.first
        return (f"graded on {len(self.order)} of {self.batch} sequences ({self.past_limit} of the "
                f"{self.past_total} with elements at index 2^31 or beyond, {'the first, ' if self.first else ''}"
                f"{drawn} drawn at random): the case is too large for a whole float64 reference")


def reaches(spec, q, k, v, dout) -> list[tuple[str, int, int]]:
    """Per tensor the call reads or writes by rows: (its rows' side, "out" or "kv"; a; b), row r's furthest
    element lying at r·a + b from the tensor's start. q, k, v and dout at their strides (a non-contiguous dout's
    rows lie twice as far apart: flash-attention #2611); the results contiguous, as a backend allocates them.
    `spec`: a Problem, or a Case (whose inputs may be `fixtures.case.layout_of`'s meta tensors)."""
    def strided(t):
        return t.stride(0), sum((n - 1) * stride for n, stride in zip(t.shape[1:], t.stride()[1:], strict=True))

    def contiguous(heads, dim):
        return heads * dim, heads * dim - 1

    found = [("out", *strided(dout)), ("out", *contiguous(spec.q_heads, spec.head_dim_v)),
             ("out", 1, (spec.q_heads - 1) * spec.out_rows),  # lse [Hq, out rows]
             ("kv", *strided(k)), ("kv", *strided(v)), ("kv", *contiguous(spec.kv_heads, spec.head_dim)),
             ("kv", *contiguous(spec.kv_heads, spec.head_dim_v))]
    if not spec.broadcast_q:  # with broadcast_q every sequence reads all of q, and dq is their sum
        found += [("out", *strided(q)), ("out", *contiguous(spec.q_heads, spec.head_dim))]
    return found


def sample(problem: Problem, layout, seed: int) -> Sample | None:
    """The sample a case is graded on, or None when it is graded whole (at most WHOLE_LIMIT elements). `layout`:
    the call's q, k, v and dout, or meta tensors of their shapes and strides (`fixtures.case.layout_of`)."""
    width = max(problem.head_dim, problem.head_dim_v)
    chosen = choose(problem.out_offsets_host.long().diff(), problem.kv_offsets_host.long().diff(),
                    reaches(problem, *layout), problem.q_heads * width, problem.kv_heads * width, seed)
    if chosen is None:
        return None
    order, past = chosen
    _, out_parts, kv_parts = sequence_rows(problem, order)
    rows = {name: (cat_rows(parts), axis) for name, (parts, axis) in tensor_rows(problem, out_parts, kv_parts).items()}
    return Sample(order=order, batch=problem.batch, past_limit=int(past[order].sum()) if order else 0,
                  past_total=int(past.sum()), first=0 in order and not bool(past[0]), rows=rows)


def choose(out_lens: torch.Tensor, kv_lens: torch.Tensor, row_reaches, out_width: int, kv_width: int, seed: int):
    """(the sampled sequences, ascending; per sequence whether it has elements at index INDEX_LIMIT or beyond)
    for sequences of `out_lens` output rows and `kv_lens` key rows (`out_width` and `kv_width` elements each,
    the budget's measure) whose tensors reach as `row_reaches` says (`reaches`), or None when the case is graded
    whole. Past the limit, each tensor's sequences nearest its limit come first, the tensors in turn, after the
    last sequence: where a wrapped index first corrupts rows and where it is furthest wrapped."""
    cost = out_lens * out_width + kv_lens * kv_width
    if int(cost.sum()) <= WHOLE_LIMIT:
        return None
    lens = {"out": out_lens, "kv": kv_lens}
    per_tensor = [torch.nonzero((lens[side] > 0) & ((lens[side].cumsum(0) - 1) * a + b >= INDEX_LIMIT)).flatten()
                  for side, a, b in row_reaches]
    past = torch.zeros(cost.numel(), dtype=torch.bool)
    for found in per_tensor:
        past[found] = True
    nearest_first = [b for turn in itertools.zip_longest(*(found.tolist() for found in per_tensor))
                     for b in turn if b is not None]
    rest = torch.nonzero(~past).flatten()
    rest = rest[rest != 0]
    rest = rest[torch.randperm(rest.numel(), generator=torch.Generator().manual_seed(seed))]
    last = [int(torch.nonzero(past).max())] if past.any() else []
    chosen, total = [], 0
    # Sequences past the limit take at most 3/4 of the budget: the rest goes to sequences before it, the control.
    for candidates, budget in ((last + nearest_first, SAMPLE_BUDGET * 3 // 4), ([0] + rest.tolist(), SAMPLE_BUDGET)):
        for b in dict.fromkeys(candidates):
            if total + int(cost[b]) <= budget:
                chosen.append(b)
                total += int(cost[b])
    return sorted(chosen), past
