"""verify.graded: a case too large for a whole reference is graded on a sample of its sequences, which holds
every sequence past the int32 index limit and catches a kernel whose row addressing wraps there. On the CPU
the limits are scaled down (monkeypatched) so that small cases exercise the same code."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import jfa
import tests.planted  # noqa: F401  (registers the emulator backend)
from fixtures.case import layout_of, make_inputs
from fixtures.families import case_from_id
from fixtures.profiles import profile_case_ids
from jfa.problem import Problem
from reference.exact import reference
from verify import context, graded, results
from verify.checks import check_case, failure_message
from verify.context import case_context, case_plan, problem_of

CPU = torch.device("cpu")
CASE = "many_tiny:1"


def wrapped_rows(q, k, v, q_offsets, kv_offsets, **kwargs):
    """The clean emulator reading q's rows as a kernel computing row·stride in int32 would, with the wrap at
    graded.INDEX_LIMIT elements instead of 2^31: rows past the limit read earlier rows."""
    width = q.shape[1] * q.shape[2]
    rows = torch.arange(q.shape[0], device=q.device)
    return jfa.attention(q[(rows * width) % graded.INDEX_LIMIT // width], k, v, q_offsets, kv_offsets,
                         backend="emulator", **kwargs)


@pytest.fixture
def scaled_limits(monkeypatch):
    """WHOLE_LIMIT 0 (every case sampled); INDEX_LIMIT at 3/4 of CASE's out rows; SAMPLE_BUDGET half its size.
    The case context is rebuilt under them and dropped after."""
    case = case_from_id(CASE)
    width = case.q_heads * max(case.head_dim, case.head_dim_v)
    kv_width = case.kv_heads * max(case.head_dim, case.head_dim_v)
    cost = sum(case.q_lens) * width + sum(case.kv_lens) * kv_width
    monkeypatch.setattr(graded, "WHOLE_LIMIT", 0)
    monkeypatch.setattr(graded, "INDEX_LIMIT", sum(case.q_lens) * 3 // 4 * width)
    monkeypatch.setattr(graded, "SAMPLE_BUDGET", cost // 2)
    case_context.cache_clear()
    yield
    case_context.cache_clear()


def _sample_of(case_id: str, seed: int | None = None):
    """graded.choose on a case's lengths and layout (meta tensors: the overflow cases' values would take 22 GB)."""
    case = case_from_id(case_id)
    width = max(case.head_dim, case.head_dim_v)
    out_lens = [case.q_lens[0]] * len(case.kv_lens) if case.broadcast_q else case.q_lens  # broadcast: q per kv
    reaches = graded.reaches(case, *layout_of(case))
    chosen = graded.choose(torch.tensor(out_lens), torch.tensor(case.kv_lens), reaches, case.q_heads * width,
                           case.kv_heads * width, case.seed if seed is None else seed)
    return chosen, reaches, torch.tensor(out_lens), torch.tensor(case.kv_lens)


def test_nightly_samples_only_the_offset_overflow_cases_and_their_rows_past_the_limit():
    """Every nightly case but offset_overflow's is graded whole (WHOLE_LIMIT is above them all). Of those two, the
    sample holds, within the budget, the last sequence and each tensor's first sequence past 2^31 elements (q's and
    dout's, whose rows offset_overflow:201 lays out twice as far apart), every sequence past the limit where they
    fit (offset_overflow:200), the first sequence and sequences drawn by the seed."""
    sampled = {}
    for case_id in profile_case_ids("nightly"):
        chosen, reaches, out_lens, kv_lens = _sample_of(case_id)
        if chosen is not None:
            sampled[case_id] = chosen, reaches, out_lens, kv_lens
    assert sorted(sampled) == ["offset_overflow:200", "offset_overflow:201"]
    for case_id, ((order, past), reaches, out_lens, kv_lens) in sampled.items():
        case = case_from_id(case_id)
        width = max(case.head_dim, case.head_dim_v)
        lens = {"out": out_lens, "kv": kv_lens}
        firsts = {int(torch.nonzero((lens[side].cumsum(0) - 1) * a + b >= 2**31).flatten()[0])
                  for side, a, b in reaches if int(lens[side].sum() - 1) * a + b >= 2**31}
        assert firsts and firsts <= set(order) and int(torch.nonzero(past).max()) in order and 0 in order, case_id
        cost = sum(case.q_lens[b] * case.q_heads * width + case.kv_lens[b] * case.kv_heads * width for b in order)
        assert cost <= graded.SAMPLE_BUDGET, case_id
        assert len(order) > int(past[order].sum()) + 1, case_id  # some drawn at random
        assert order != _sample_of(case_id, seed=case.seed + 1)[0][0], case_id
    (order, past), *_ = sampled["offset_overflow:200"]
    assert set(torch.nonzero(past).flatten().tolist()) < set(order)
    assert len(firsts) == 2  # offset_overflow:201: dout's limit and q's (and the results') lie apart


def test_the_sample_reference_is_the_whole_reference_at_its_rows(scaled_limits):
    """Sequences are independent: the reference of the sub-batch equals the whole case's at the sampled rows
    (to float64 rounding: the reference groups sequences into buckets by length, which the sample changes)."""
    ctx = case_context(CASE, "cpu")
    sample = ctx.sample
    assert sample is not None and 0 < len(sample.order) < ctx.problem.batch and sample.past_limit > 0
    inputs = ctx.inputs
    whole = reference(inputs.q, inputs.k, inputs.v, ctx.problem, inputs.dout)
    for name, (value, bound, _) in ctx.reference.tensors().items():
        torch.testing.assert_close(value, sample.view(name, whole.values[name]), rtol=1e-12, atol=1e-300,
                                   msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(bound, sample.view(name, whole.bounds[name]), rtol=1e-6, atol=0,
                                   msg=lambda m, name=name: f"{name} bound: {m}")


def test_sampled_grading_passes_the_clean_emulator_and_catches_rows_read_wrapped(scaled_limits):
    records = [r for test in ("forward", "backward", "invariants") for r in check_case("emulator", CASE, test, CPU)]
    assert records and all(r["status"] == "pass" for r in records), [r for r in records if r["status"] != "pass"]
    sample = case_context(CASE, "cpu").sample
    assert all(r["graded"] == sample.describe() for r in records)
    whole = dict(records[0], case="uniform:0", graded=None)  # a case graded whole adds no line
    assert results.sampled_summary([*records, whole]) == [f"{CASE} {sample.describe()}"]
    assert f"graded on {len(sample.order)} of {sample.batch} sequences" in sample.describe()

    wrapped = check_case("tests.test_graded:wrapped_rows", CASE, "forward", CPU)
    out = next(r for r in wrapped if r["tensor"] == "out")
    assert out["status"] == "fail" and not out["checks"]["bound"]
    problem = case_context(CASE, "cpu").problem
    out_ends = problem.out_offsets_host[1:].long() * problem.q_heads * max(problem.head_dim, problem.head_dim_v)
    first_past = int(torch.searchsorted(out_ends, graded.INDEX_LIMIT, right=True))
    assert out["worst"]["sequence"] in sample.order and out["worst"]["sequence"] >= first_past
    assert sample.describe() in failure_message(wrapped)


def test_broadcast_dq_is_not_graded_on_a_sample(monkeypatch):
    """With broadcast_q dq is every sequence's sum: a sample's reference cannot grade it, so it is skipped with
    the reason, and dk and dv are graded."""
    monkeypatch.setattr(graded, "WHOLE_LIMIT", 0)
    case_context.cache_clear()
    try:
        records = {r["tensor"]: r for r in check_case("emulator", "broadcast_q:1", "backward", CPU)}
    finally:
        case_context.cache_clear()
    assert records["dq"]["status"] == "skip" and "every sequence's sum" in records["dq"]["message"]
    assert records["dk"]["status"] == records["dv"]["status"] == "pass"


@pytest.mark.parametrize("case_id", ["uniform:0", "broadcast_q:1", "fused_qkv:0", "noncontig_dout:2", "tail:0",
                                     "gqa:1", "empty_runs:0", "batch_zero:0", "window_causal:1"])
def test_the_plan_is_the_problem_and_sample_of_the_drawn_case(case_id, monkeypatch):
    """verify.context.case_plan builds a case's Problem and sample without drawing its values (stand-in tensors,
    meta layout): both must be what the drawn inputs give, the sample taken on every sequence's rows
    (WHOLE_LIMIT 0) and with INDEX_LIMIT inside the case, so that the layout's strides decide what it holds."""
    inputs = make_inputs(case_from_id(case_id))
    drawn = problem_of(inputs)
    monkeypatch.setattr(graded, "WHOLE_LIMIT", 0)
    monkeypatch.setattr(graded, "INDEX_LIMIT", max(1, inputs.dout.shape[0] * inputs.dout.stride(0) // 2))
    plan = case_plan(case_id)
    for field in dataclasses.fields(Problem):
        if field.name in ("device", "confirmation", "lengths_key", "q_offsets", "out_offsets", "kv_offsets"):
            continue  # where the plan's offsets live, and the validation cache's tokens
        want, got = getattr(drawn, field.name), getattr(plan.problem, field.name)
        assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), field.name
    want = graded.sample(drawn, (inputs.q, inputs.k, inputs.v, inputs.dout), case_from_id(case_id).seed)
    if want is None:
        assert plan.sample is None
        return
    assert (plan.sample.order, plan.sample.past_limit, plan.sample.past_total) == (
        want.order, want.past_limit, want.past_total)
    assert plan.sample.rows.keys() == want.rows.keys()
    assert all(torch.equal(plan.sample.rows[name][0], rows) for name, (rows, _) in want.rows.items())


def test_a_case_the_backend_skips_here_draws_no_values(monkeypatch):
    """offset_overflow:200 for the triton backend on the CPU: its verify_skip (beyond the interpreter's work limit)
    is asked with the case's plan, so the case's 22 GB of float32 values are never drawn; the skip still says how
    the case would be graded."""
    def drawing(*args, **kwargs):
        raise AssertionError("a skipped case drew its values")

    monkeypatch.setattr(context, "make_inputs", drawing)
    records = check_case("triton", "offset_overflow:200", "forward", CPU)
    assert [(r["tensor"], r["status"]) for r in records] == [("*", "skip")]
    assert records[0]["message"].startswith("not run here:") and "interpreter" in records[0]["message"]
    assert records[0]["graded"] == case_plan("offset_overflow:200").sample.describe()


def test_a_case_past_the_host_memory_is_skipped_before_its_values_are_drawn(monkeypatch):
    """The bf16 model (no verify_skip) on offset_overflow:200 on a CPU host with 24 GB available: its values, 22 GB
    in float32 and 11 GB cast to bf16, are never drawn (the OS killed the worker drawing them on the 24 GB CPU
    machine, a crash the suite would pin on the backend), and the skip says how much it needs."""
    def drawing(*args, **kwargs):
        raise AssertionError("a case past the host memory drew its values")

    monkeypatch.setattr(context, "make_inputs", drawing)
    monkeypatch.setattr(context, "available_host_memory", lambda: 24 * 10**9)
    records = check_case("bf16-model", "offset_overflow:200", "forward", CPU)
    assert [(r["tensor"], r["status"]) for r in records] == [("*", "skip")]
    assert records[0]["message"].startswith("not run here:")
    assert "33.0 GB, more than the 24.0 GB" in records[0]["message"]


@pytest.mark.parametrize("spare", [-1, 0])
def test_the_host_memory_rule_is_asked_of_a_case_not_yet_drawn(monkeypatch, spare):
    """A case whose drawing (its float32 values and their casts, `drawn_bytes`) needs one byte more than the host has
    is skipped, one that fits exactly is run; once drawn (cached), its later tests run whatever the memory left."""
    case_id = "uniform:0"
    needed = context.drawn_bytes(case_from_id(case_id), "cpu")
    monkeypatch.setattr(context, "available_host_memory", lambda: needed + spare)
    case_context.cache_clear()
    try:
        statuses = {r["status"] for r in check_case("bf16-model", case_id, "forward", CPU)}
        assert statuses == ({"skip"} if spare < 0 else {"pass"})
        if spare == 0:
            monkeypatch.setattr(context, "available_host_memory", lambda: 0)
            assert {r["status"] for r in check_case("bf16-model", case_id, "backward", CPU)} == {"pass"}
    finally:
        case_context.cache_clear()


def test_drawn_bytes_counts_the_casts_a_device_leaves_on_the_host():
    """offset_overflow:200's q, k, v and dout: 4 bytes an element in float32 plus 2 for every bf16 cast on a CPU
    run; on a GPU run the casts leave the host one at a time, so only the largest counts."""
    case = case_from_id("offset_overflow:200")
    elements = [t.numel() for t in layout_of(case)]
    assert context.drawn_bytes(case, "cpu") == 6 * sum(elements)
    assert context.drawn_bytes(case, "cuda") == 4 * sum(elements) + 2 * max(elements)
