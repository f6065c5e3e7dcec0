"""Everything the checks of one case need, computed once per worker and cached by case id: the inputs,
the validated problem, the float64 reference with bounds, the exact-value masks and the bf16 model's
outputs (the same-dtype baseline); for a case too large for a whole reference, these last three of a sample of
its sequences (`verify.graded`). Before any of it, the case's plan: its Problem and sample from its lengths and
layout alone, which is what a backend's verify_skip needs (a skipped case draws no values: offset_overflow's
would take 22 GB of the host)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from fixtures import Case, CaseInputs, case_from_id, make_inputs
from fixtures.case import DTYPES, call_kwargs, case_offsets, layout_of
from fixtures.values import shapes
from jfa.backends import attention_fn
from jfa.problem import Problem
from jfa.validation import validate
from reference.exact import Reference, reference
from verify import graded
from verify.devices import available_host_memory
from verify.runner import Outputs, run
from verify.sub_batch import sub_batch


@dataclass
class CaseContext:
    case: Case
    inputs: CaseInputs
    problem: Problem
    # The sequences the reference, baseline, exact masks and row offsets cover, where not the whole case.
    sample: graded.Sample | None
    reference: Reference
    baseline: Outputs
    exact: dict[str, torch.Tensor]  # per tensor: where the contract fixes the value exactly
    row_offsets: dict[str, torch.Tensor]  # per tensor: host offsets splitting its rows into sequences
    # Per backend, the outputs of its backward test (forward and backward of the case's own call), which the
    # invariants reuse as their first run instead of repeating it.
    backward_runs: dict[str, Outputs] = field(default_factory=dict)
    # ... and its deterministic=True run, where it makes one (a backend declaring dq_order).
    ordered_runs: dict[str, Outputs] = field(default_factory=dict)

    def graded(self, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """A result tensor of the case's call at the rows the reference covers (None: not graded here)."""
        return t if self.sample is None else self.sample.view(name, t)


def problem_of(inputs: CaseInputs) -> Problem:
    return validate(inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, **inputs.kwargs,
                    deterministic=False)


@dataclass(frozen=True)
class CasePlan:
    """A case's Problem (on the CPU: validation reads only shapes, dtypes and offsets, so stand-in tensors of
    one element expanded to the case's shapes serve for its values) and the sample it is graded on (its
    layout's strides from meta tensors). Nothing of the case's size is allocated."""

    case: Case
    problem: Problem
    sample: graded.Sample | None


def case_plan(case_id: str) -> CasePlan:
    case = case_from_id(case_id)
    layout = layout_of(case)
    stand_ins = [torch.zeros(1, 1, 1, dtype=DTYPES[case.dtype]).expand(t.shape) for t in layout[:3]]
    problem = validate(*stand_ins, *case_offsets(case), **call_kwargs(case), deterministic=False)
    return CasePlan(case=case, problem=problem, sample=graded.sample(problem, layout, case.seed))


def exact_masks(problem: Problem, ref: Reference, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Rows with no visible key (out 0, lse -inf, dq 0) and keys no query sees (dk = dv = 0)."""
    empty_row = torch.isinf(ref.lse).all(0)
    if problem.broadcast_q:
        empty_q_row = empty_row.view(problem.batch, -1).all(0) if problem.batch else torch.ones(
            problem.q_rows, dtype=torch.bool, device=empty_row.device)
    else:
        empty_q_row = empty_row
    unseen = ~ref.key_seen
    masks = {"out": empty_row, "lse": None, "dq": empty_q_row, "dk": unseen, "dv": unseen}
    result = {"lse": torch.isinf(ref.lse)}
    for name, rows in masks.items():
        if rows is not None:
            result[name] = rows.view(-1, 1, 1).expand(shapes[name])
    return result


class HostMemoryShortfall(Exception):
    """A case whose values this host cannot hold while they are drawn (the message says how much): the machine's
    limit, not a backend's failure. Without the check the OS kills the worker drawing them, which the suite would
    report as a crash of the backend (offset_overflow's 22 GB on the 24 GB CPU machine)."""


def drawn_bytes(case: Case, device_type: str) -> int:
    """Host memory make_inputs holds at once at least: q, k, v and dout's values, all four drawn in float32 on the
    CPU whatever the device (so that an id gives the same tensors everywhere), and their casts to the case's
    dtype: all four for a CPU run, one at a time on their way to a GPU."""
    elements = [math.prod(shape) for shape in shapes(case)]
    cast = DTYPES[case.dtype].itemsize * (sum(elements) if device_type == "cpu" else max(elements))
    return 4 * sum(elements) + cast


@functools.lru_cache(maxsize=1)
def case_context(case_id: str, device_type: str) -> CaseContext:
    """Raises HostMemoryShortfall before drawing anything where the case's values pass the host memory available
    (asked only here, when the case is not the one cached already)."""
    plan = case_plan(case_id)
    case, sample = plan.case, plan.sample
    needed, available = drawn_bytes(case, device_type), available_host_memory()
    if available is not None and needed > available:
        raise HostMemoryShortfall(f"its values are drawn in float32 on the host and cast there (fixtures.make_inputs): "
                                  f"{needed / 1e9:.1f} GB, more than the {available / 1e9:.1f} GB of memory this "
                                  f"host has available")
    inputs = make_inputs(case, torch.device(device_type))
    problem = problem_of(inputs)
    graded_inputs = inputs if sample is None else sub_batch(problem, inputs, sample.order)[0]
    graded_problem = problem if sample is None else problem_of(graded_inputs)
    ref = reference(graded_inputs.q, graded_inputs.k, graded_inputs.v, graded_problem, graded_inputs.dout)
    model, _ = attention_fn("bf16-model")
    baseline = run(model, graded_inputs.q, graded_inputs.k, graded_inputs.v, graded_inputs.q_offsets,
                   graded_inputs.kv_offsets, graded_inputs.dout, graded_inputs.kwargs, backward=True)
    shapes = {name: tuple(t.shape) for name, t in baseline.named().items()}
    q_rows = torch.tensor([0, graded_problem.q_rows]) if graded_problem.broadcast_q else graded_problem.q_offsets_host
    return CaseContext(
        case=case, inputs=inputs, problem=problem, sample=sample, reference=ref, baseline=baseline,
        exact=exact_masks(graded_problem, ref, shapes),
        row_offsets={"out": graded_problem.out_offsets_host, "lse": graded_problem.out_offsets_host, "dq": q_rows,
                     "dk": graded_problem.kv_offsets_host, "dv": graded_problem.kv_offsets_host},
    )
