"""verify.invariants on its own: the batch-invariance comparison locates what differs."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jfa.backends import attention_fn
from tests.helpers import ScaledGradient, counting_model
from verify.checks import check_case
from verify.context import case_context
from verify.invariants import compare_sub_batch
from verify.runner import run
from verify.sub_batch import sub_batch


@pytest.mark.parametrize("case_id", ["empty_middle:0", "power_law:1", "broadcast_q:0"])
def test_sub_batch_comparison_names_the_changed_sequence(case_id):
    """The batch invariants compare a sub-batch re-run with the whole batch in one gather per tensor; a
    single changed element must be reported against the sequence it belongs to, and nothing else."""
    ctx = case_context(case_id, "cpu")
    model, _ = attention_fn("bf16-model")
    inputs = ctx.inputs
    whole = run(model, inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, inputs.dout,
                inputs.kwargs, backward=True)
    order = torch.randperm(ctx.problem.batch, generator=torch.Generator().manual_seed(0)).tolist()
    sub, out_parts, kv_parts = sub_batch(ctx.problem, ctx.inputs, order)
    part = run(model, sub.q, sub.k, sub.v, sub.q_offsets, sub.kv_offsets, sub.dout, sub.kwargs, backward=True)
    assert compare_sub_batch(ctx, whole, part, order, out_parts, kv_parts) == []

    with_keys = [i for i, rows in enumerate(kv_parts) if rows.numel()]
    position = with_keys[len(with_keys) // 2]
    row = sum(rows.numel() for rows in kv_parts[:position]) + kv_parts[position].numel() - 1
    part.dv[row, -1, -1] = torch.nextafter(part.dv[row, -1, -1], torch.tensor(math.inf, dtype=part.dv.dtype))
    assert compare_sub_batch(ctx, whole, part, order, out_parts, kv_parts) == [
        f"dv of sequence {order[position]}: 1 elements differ, first at ({kv_parts[position].numel() - 1}, "
        f"{part.dv.shape[1] - 1}, {part.dv.shape[2] - 1}): {float(whole.dv[kv_parts[position][-1], -1, -1])!r} vs "
        f"{float(part.dv[row, -1, -1])!r}"]


def test_invariants_reuse_the_backward_tests_run():
    """The invariants' first run of the case's own call is the backward test's, when that ran in this
    process: one call fewer, and the same verdicts."""
    spec, case_id, cpu = "tests.helpers:counting_model", "empty_middle:1", torch.device("cpu")
    case_context.cache_clear()
    counting_model.calls = 0
    alone = check_case(spec, case_id, "invariants", cpu)
    calls_alone = counting_model.calls
    check_case(spec, case_id, "backward", cpu)  # the same cached context
    counting_model.calls = 0
    after_backward = check_case(spec, case_id, "invariants", cpu)
    assert counting_model.calls == calls_alone - 1 > 0
    assert [(r["tensor"], r["status"]) for r in after_backward] == [(r["tensor"], r["status"]) for r in alone]


def test_invariants_reuse_the_backward_tests_deterministic_run(monkeypatch):
    """For a backend declaring dq_order the backward test also runs deterministic=True (to grade that dq);
    the invariants take it as their first run in that mode: one deterministic call fewer, the same verdicts."""
    from jfa import backends
    from tests import planted  # noqa: F401  (registers the planted backends)

    spec, case_id, cpu = "planted-ordered_dq_path", "empty_middle:1", torch.device("cpu")
    backend = backends.get(spec)
    calls = []
    real = backend.backward
    monkeypatch.setattr(backend, "backward", lambda *args: calls.append(args[-1].deterministic) or real(*args))
    case_context.cache_clear()
    alone = check_case(spec, case_id, "invariants", cpu)
    deterministic_alone = calls.count(True)
    check_case(spec, case_id, "backward", cpu)
    calls.clear()
    after_backward = check_case(spec, case_id, "invariants", cpu)
    assert calls.count(True) == deterministic_alone - 1 > 0 and calls.count(False) > 0
    assert [(r["tensor"], r["status"]) for r in after_backward] == [(r["tensor"], r["status"]) for r in alone]


def test_nan_filled_allocations_fill_and_restore_without_loading_inductor():
    """Fresh memory is NaN inside, torch's switches come back as they were, and Inductor is not imported to
    set its flag (seconds per process) unless it was loaded already, in which case its flag follows too."""
    script = """
import sys, torch
from verify.runner import nan_filled_allocations
assert not torch.are_deterministic_algorithms_enabled()
torch.utils.deterministic.fill_uninitialized_memory = False
with nan_filled_allocations():
    assert torch.empty(64).isnan().all() and torch.are_deterministic_algorithms_enabled()
assert not torch.are_deterministic_algorithms_enabled() and not torch.utils.deterministic.fill_uninitialized_memory
assert "torch._inductor" not in sys.modules
import torch._inductor.config as inductor_config
with nan_filled_allocations():
    assert inductor_config.deterministic and torch.is_deterministic_algorithms_warn_only_enabled()
assert not inductor_config.deterministic and not torch.are_deterministic_algorithms_enabled()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-3000:]


class _GradNudge(torch.autograd.Function):
    """Identity whose gradient is scaled by 1 + 2⁻⁷·`factor()`, a value read at each backward."""

    factor = staticmethod(lambda: 0)

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * (1 + 2**-7 * _GradNudge.factor())


def _nudged_dq_model(nudge):
    """bf16-model with its dq scaled by 1 + 2⁻⁷·nudge(deterministic, batch) in each call."""
    model, _ = attention_fn("bf16-model")

    def fn(q, k, v, q_offsets, kv_offsets, deterministic=False, **kwargs):
        _GradNudge.factor = staticmethod(lambda: nudge(deterministic, len(kv_offsets) - 1))
        return model(_GradNudge.apply(q), k, v, q_offsets, kv_offsets, deterministic=deterministic, **kwargs)

    return fn


def test_dq_order_moves_dq_batch_and_padding_checks_to_deterministic_runs():
    """A backend whose default-mode dq changes from call to call (as TMA-reduce or atomic dq does) fails the
    padding and batch checks, unless it declares `dq_order`: then dq is compared between deterministic=True
    runs, where a dq that depends on the batch still fails."""
    from itertools import count

    from verify.invariants import check_all

    ctx = case_context("empty_middle:0", "cpu")
    assert ctx.problem.batch > 1 and not ctx.problem.broadcast_q
    calls = count()
    unordered = _nudged_dq_model(lambda deterministic, batch: 0 if deterministic else next(calls))
    failed = {k for k, v in check_all(unordered, ctx).items() if v}
    assert {"padding", "batch_permuted", "batch_alone"} <= failed and "deterministic" not in failed, failed
    assert not any(check_all(unordered, ctx, {"dq_order": "unordered dq"}).values())
    batch_variant = _nudged_dq_model(lambda deterministic, batch: int(batch == 1))  # another dq alone
    findings = check_all(batch_variant, ctx, {"dq_order": "unordered dq"})
    assert [k for k, v in findings.items() if v] == ["batch_alone"], findings
    assert all(problem.startswith("dq of sequence") for problem in findings["batch_alone"])


class _OneBackward(torch.autograd.Function):
    """Identity whose backward runs once per forward and raises `error` at a second, as a compiled backward with
    donated buffers refuses a retained graph."""

    error = "This backward function was compiled with non-empty donated buffers"

    @staticmethod
    def forward(ctx, x):
        ctx.done = False
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.done:
            raise RuntimeError(_OneBackward.error)
        ctx.done = True
        return grad


def test_a_backward_refusing_a_retained_graph_fails_backward_again_alone(monkeypatch):
    """Every other invariant runs one backward per forward and passes; a device fault is not a refusal: it ends
    the check (the suite replaces the process)."""
    from verify.invariants import check_all

    model, _ = attention_fn("bf16-model")

    def fn(q, k, v, *args, **kwargs):
        return model(_OneBackward.apply(q), k, v, *args, **kwargs)

    ctx = case_context("uniform:0", "cpu")
    findings = check_all(fn, ctx)
    assert [k for k, v in findings.items() if v] == ["backward_again"], findings
    assert findings["backward_again"] == ["a second backward over the retained graph raised RuntimeError: "
                                          + _OneBackward.error]
    monkeypatch.setattr(_OneBackward, "error", "CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        check_all(fn, ctx)


def test_the_retained_graph_first_backward_is_the_deterministic_checks_second_run():
    """With both groups checked, the deterministic check compares its first run with the retained graph's first
    backward instead of calling the op once more: two calls with deterministic=True where there were three. A
    dq that changes from call to call still fails `deterministic` (and only it: the two backwards of one call
    agree)."""
    from verify.invariants import check_all

    model, _ = attention_fn("bf16-model")
    calls = []

    def counted(q, k, v, *args, **kwargs):
        calls.append(kwargs.get("deterministic", False))
        return model(q, k, v, *args, **kwargs)

    ctx = case_context("uniform:0", "cpu")
    findings = check_all(counted, ctx)
    assert not any(findings.values()) and calls.count(True) == 2, (findings, calls)

    def drifting(q, k, v, *args, **kwargs):  # each call's dq scaled by its own factor, both its backwards alike
        calls.append(True)
        return model(ScaledGradient.apply(q, 1 + 2.0**-6 * len(calls)), k, v, *args, **kwargs)

    failed = [k for k, v in check_all(drifting, ctx).items() if v]
    assert "deterministic" in failed and "backward_again" not in failed, failed


def test_a_backend_refusing_the_allocation_guards_is_told_why_unless_it_waives_them():
    """A call that raises under the guards' dispatch mode (as torch.compile'd code does) fails the invariants with
    an error naming the waiver group; declared, the written check runs without the guards and in_bounds is
    reported not applicable. The device running out of memory under the guards is raised as it is."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from verify.invariants import check_all

    model, _ = attention_fn("bf16-model")

    def refusing(*args, **kwargs):
        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("non-infra torch dispatch mode present")
        return model(*args, **kwargs)

    ctx = case_context("uniform:0", "cpu")
    with pytest.raises(RuntimeError, match="declares the waiver group 'guarded_allocations'.*non-infra"):
        check_all(refusing, ctx)
    findings = check_all(refusing, ctx, {"guarded_allocations": "compiled"})
    assert findings["in_bounds"] == "compiled" and findings["written"] == [], findings
    assert not any(problems for problems in findings.values() if isinstance(problems, list)), findings

    def out_of_memory_when_guarded(*args, **kwargs):  # the case's size: nothing to waive
        if _get_current_dispatch_mode() is not None:
            raise torch.OutOfMemoryError("stand-in: tried to allocate 8.20 GiB")
        return model(*args, **kwargs)

    with pytest.raises(torch.OutOfMemoryError, match="stand-in") as raised:
        check_all(out_of_memory_when_guarded, ctx)
    assert "guarded_allocations" not in str(raised.value)


def test_a_stray_write_of_the_deterministic_path_alone_is_caught_in_the_retained_graph_run():
    """The retained graph's run (deterministic=True) is guarded too: a backend whose deterministic path alone
    writes past its output is named there, with the run; the default-mode written run stays clean."""
    from tests.planted import store_past_end
    from verify.invariants import check_all

    model, _ = attention_fn("bf16-model")

    def overrunning_when_deterministic(*args, deterministic=False, **kwargs):
        out, lse = model(*args, deterministic=deterministic, **kwargs)
        if deterministic:
            store_past_end(out.detach(), 2)
        return out, lse

    findings = check_all(overrunning_when_deterministic, case_context("gqa:0", "cpu"))
    assert [k for k, v in findings.items() if v] == ["in_bounds"], findings
    (problem,) = findings["in_bounds"]
    assert problem.startswith("deterministic=True, two backwards over one graph: ")
    assert "written past its end" in problem


def test_base_waits_on_the_host_where_the_runs_held_would_pass_the_device_memory(monkeypatch):
    """`_parked`: a run is moved to the host exactly where RUNS_HELD runs of its size pass the device's memory
    (offset_overflow:200 on an H100); otherwise it is left as it is, the same object."""
    from verify import invariants
    from verify.runner import Outputs

    outputs = Outputs(*(torch.randn(3, 2, 4) for _ in range(2)), *(torch.randn(3, 2, 4) for _ in range(3)))
    run_bytes = 5 * 3 * 2 * 4 * 4
    for memory, parked in ((invariants.RUNS_HELD * run_bytes, False), (invariants.RUNS_HELD * run_bytes - 1, True)):
        monkeypatch.setattr(invariants, "_device_memory", lambda device, memory=memory: memory)
        got = invariants._parked(outputs)
        assert (got is not outputs) == parked
        assert all(torch.equal(a, b) for a, b in zip(got.named().values(), outputs.named().values(), strict=True))
    monkeypatch.setattr(invariants, "_device_memory", lambda device: None)  # the host: nothing to park
    assert invariants._parked(outputs) is outputs


def test_the_device_memory_is_what_this_process_can_hold(monkeypatch):
    """`_device_memory` counts what is free on the device and what this process's allocator holds (its runs are
    the ones RUNS_HELD counts), not the device's total: memory held by other processes on the device (a group's
    sanitizer shards) is not this process's. The host has none to count."""
    from verify import invariants

    gib = 2**30
    device = torch.device("cuda", 1)
    asked = []

    def mem_get_info(where):
        asked.append(where)
        return 30 * gib, 80 * gib  # 50 GiB held: 20 by this process, 30 by others

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda where: 20 * gib if where == device else 0)
    assert invariants._device_memory(device) == 50 * gib and asked == [device]
    assert invariants._device_memory(torch.device("cpu")) is None and asked == [device]


@pytest.mark.parametrize(("spec", "case_id", "failing"), [
    ("planted-batch_dependent_blocks", "gem_like:0", ["batch_alone"]),
    ("planted-masked_neighbour_rows", "gem_like:0", ["isolation", "isolation_grad"]),
    ("tests.planted:offsets_cached_by_address", "gem_like:0", ["offsets_reused"]),
    ("emulator", "gem_like:0", []),
])
def test_a_parked_base_gives_the_same_findings(spec, case_id, failing, monkeypatch):
    """With `base` parked (a device of one byte), the invariants comparing with it name the planted bug's
    checks in the same words, and pass the clean emulator, as with `base` where it was made."""
    from tests import planted  # noqa: F401  (registers the planted backends)
    from verify import invariants

    fn, _ = attention_fn(spec)
    ctx = case_context(case_id, "cpu")
    where_made = invariants.check_all(fn, ctx)
    assert [k for k, v in where_made.items() if v] == failing
    parked = []
    real_parked = invariants._parked
    monkeypatch.setattr(invariants, "_device_memory", lambda device: 1)

    def recording(outputs):
        got = real_parked(outputs)
        parked.append(got is not outputs)
        return got

    monkeypatch.setattr(invariants, "_parked", recording)
    assert invariants.check_all(fn, ctx) == where_made
    assert parked == [True]


def out_of_memory_when_deterministic(*args, deterministic=False, **kwargs):
    """The bf16 model, raising as a device out of memory does on its deterministic=True calls."""
    if deterministic:
        raise torch.OutOfMemoryError("stand-in: tried to allocate 8.20 GiB")
    return attention_fn("bf16-model")[0](*args, deterministic=deterministic, **kwargs)


def test_an_error_in_the_invariants_names_the_invariants_checked_before_it():
    """A run of the invariants that raises (a case too large for the device) fails the record with the error and
    the invariants already checked, so that the one that raised is known: here `backward_again`'s runs (the first
    with deterministic=True, under the allocation guards), after the default-mode runs of `repeatable` and
    `written`. An out of memory is the case's size, not the backend refusing a retained graph or the guards, so it
    is neither `backward_again`'s finding nor told to waive the guards."""
    case_context.cache_clear()
    (record,) = check_case("tests.test_invariants:out_of_memory_when_deterministic", "gqa:0", "invariants",
                          torch.device("cpu"))
    assert record["status"] == "fail" and record["tensor"] == "*"
    assert record["message"] == ("OutOfMemoryError: stand-in: tried to allocate 8.20 GiB (raised after the "
                                 "invariants repeatable, written, in_bounds had been checked)")


def test_the_invariants_hold_one_sub_batch_at_a_time(monkeypatch):
    """On offset_overflow:201 a sub-batch's inputs and each of its runs are a whole case's size (15.6 GB, 16 GB): every
    run of the invariants must start with at most two earlier runs alive (`base` and, with dq_order, `first`'s
    dq), and every sub-batch be made with no earlier one alive. A loop keeping one sub-batch's inputs and run into
    the next one's ran an H100 out of memory (2026-12-07)."""
    import weakref

    from verify import invariants

    model, _ = attention_fn("bf16-model")
    ctx = case_context("empty_middle:0", "cpu")
    assert len(invariants._alone_samples(ctx.problem)) > 1 and not ctx.problem.broadcast_q
    runs, sub_batches, held_at_run, held_at_sub_batch = [], [], [], []

    def alive(refs) -> int:
        return sum(any(ref() is not None for ref in tensors) for tensors in refs)

    def tracked_run(*args, **kwargs):
        held_at_run.append(alive(runs))
        outputs = run(*args, **kwargs)
        runs.append([weakref.ref(t) for t in outputs.named().values()])
        return outputs

    def tracked_sub_batch(*args):
        held_at_sub_batch.append(alive(sub_batches))
        made = sub_batch(*args)
        sub_batches.append([weakref.ref(t) for t in (made[0].q, made[0].k, made[0].v, made[0].dout)])
        return made

    monkeypatch.setattr(invariants, "run", tracked_run)
    monkeypatch.setattr(invariants, "sub_batch", tracked_sub_batch)
    assert not any(invariants.check_all(model, ctx, {"dq_order": "unordered dq"}).values())
    assert len(held_at_sub_batch) == 1 + len(invariants._alone_samples(ctx.problem))
    assert held_at_sub_batch == [0] * len(held_at_sub_batch)
    assert max(held_at_run) == 2, held_at_run
