"""Everything the checks of one case need, computed once per worker and cached by case id: the inputs,
the validated problem, the float64 reference with bounds, the exact-value masks and the bf16 model's
outputs (the same-dtype baseline)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from fixtures import Case, CaseInputs, case_from_id, make_inputs
from jfa.backends import attention_fn
from jfa.problem import Problem
from jfa.validation import validate
from reference.exact import Reference, reference
from verify.runner import Outputs, run


@dataclass
class CaseContext:
    case: Case
    inputs: CaseInputs
    problem: Problem
    reference: Reference
    baseline: Outputs
    exact: dict[str, torch.Tensor]  # per tensor: where the contract fixes the value exactly
    row_offsets: dict[str, torch.Tensor]  # per tensor: host offsets splitting its rows into sequences
    # Per backend, the outputs of its backward test (forward and backward of the case's own call), which the
    # invariants reuse as their first run instead of repeating it.
    backward_runs: dict[str, Outputs] = field(default_factory=dict)
    # ... and its deterministic=True run, where it makes one (a backend declaring dq_order).
    ordered_runs: dict[str, Outputs] = field(default_factory=dict)


def problem_of(inputs: CaseInputs) -> Problem:
    return validate(inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, **inputs.kwargs,
                    deterministic=False)


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


@functools.lru_cache(maxsize=1)
def case_context(case_id: str, device_type: str) -> CaseContext:
    case = case_from_id(case_id)
    device = torch.device(device_type)
    inputs = make_inputs(case, device)
    problem = problem_of(inputs)
    ref = reference(inputs.q, inputs.k, inputs.v, problem, inputs.dout)
    model, _ = attention_fn("bf16-model")
    baseline = run(model, inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, inputs.dout,
                   inputs.kwargs, backward=True)
    shapes = {name: tuple(t.shape) for name, t in baseline.named().items()}
    q_rows = torch.tensor([0, problem.q_rows]) if problem.broadcast_q else problem.q_offsets_host
    return CaseContext(
        case=case, inputs=inputs, problem=problem, reference=ref, baseline=baseline,
        exact=exact_masks(problem, ref, shapes),
        row_offsets={"out": problem.out_offsets_host, "lse": problem.out_offsets_host, "dq": q_rows,
                     "dk": problem.kv_offsets_host, "dv": problem.kv_offsets_host},
    )
