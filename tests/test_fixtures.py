"""The fuzzing fixtures: replayable ids, valid tensors, each family's defining property, profiles, the
Hypothesis strategy, the corpus and the command line."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fixtures import FAMILIES, case_from_id, make_inputs, profile_case_ids, spec_case
from fixtures import corpus as corpus_module
from fixtures.__main__ import main
from fixtures.case import OFFSETS_PAST_END, tail_rows
from fixtures.families import HEAD_DIMS, TIERS
from fixtures.profiles import PROFILES, SMOKE_CORPUS_WORK, SMOKE_FAMILIES
from fixtures.spec import spec_id
from fixtures.strategies import SMALL_FAMILIES, cases
from fixtures.values import HUGE_EQUAL, LOGIT_FLOOR, VALUE_FAMILIES

ROOT = Path(__file__).resolve().parents[1]
SMALL, MEDIUM = range(100), range(100, 200)
LARGE_ONLY = [name for name, family in FAMILIES.items() if family.tiers == ("large",)]
PINNED = {"kv_empty_q_nonempty": {0, 1, 2, 100, 101}}  # FAILURES.md inputs, not the family's random shape


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_layout = a.shape == b.shape and a.stride() == b.stride()
    return same_layout and torch.equal(a.view(torch.int16), b.view(torch.int16))


def sequences(case, inputs):
    """Per sequence: q rows, k rows expanded to the query heads (float64), and the visibility mask, computed
    here from the op's rule independently of fixtures.values."""
    q_start = kv_start = 0
    for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True):
        q = inputs.q[:q_len] if case.broadcast_q else inputs.q[q_start:q_start + q_len]
        k = inputs.k[kv_start:kv_start + kv_len].repeat_interleave(case.q_heads // case.kv_heads, dim=1)
        i, j = torch.arange(q_len)[:, None], torch.arange(kv_len)[None]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool)
        if case.window is not None:
            mask &= (i - j).abs() <= case.window
        if case.causal:
            mask &= j <= i + kv_len - q_len
        yield q.double(), k.double(), mask
        q_start, kv_start = q_start + q_len, kv_start + kv_len


def scaled_logits(case, q, k):
    return case.softmax_scale * torch.einsum("ihd,jhd->hij", q, k)


# Ids and replay


@pytest.mark.parametrize("name", SMALL_FAMILIES)
def test_family_ids_replay_and_round_trip(name):
    for index in [*SMALL, *range(100, 105)]:
        case = FAMILIES[name].draw(index)
        assert case.id == f"{name}:{index}" and case.family == name
        assert case_from_id(case.id) == case
        explicit = case_from_id(spec_id(case))
        assert replace(explicit, id=case.id, family=name) == case


@pytest.mark.parametrize("name", SMALL_FAMILIES)
def test_small_cases_replay_bitwise(name):
    for index in range(3):
        case_id = f"{name}:{index}"
        first, second = make_inputs(case_from_id(case_id)), make_inputs(case_from_id(case_id))
        for tensor in ("q", "k", "v", "dout"):
            assert bitwise_equal(getattr(first, tensor), getattr(second, tensor)), (case_id, tensor)
        assert torch.equal(first.kv_offsets, second.kv_offsets) and first.kwargs == second.kwargs


@pytest.mark.parametrize("name", SMALL_FAMILIES)
def test_inputs_are_valid(name):
    for index in range(4):
        case = FAMILIES[name].draw(index)
        inputs = make_inputs(case)
        check_offsets(inputs.kv_offsets, case.kv_lens, inputs.k.shape[0])
        if case.broadcast_q:
            assert inputs.q_offsets is None and inputs.q.shape[0] == case.q_lens[0]
        else:
            check_offsets(inputs.q_offsets, case.q_lens, inputs.q.shape[0])
        assert inputs.q.shape == (case.q_tokens, case.q_heads, case.head_dim)
        assert inputs.v.shape == (case.kv_tokens, case.kv_heads, case.head_dim_v)
        assert inputs.dout.shape == (case.out_rows, case.q_heads, case.head_dim_v)
        assert inputs.kwargs["max_q_len"] == max(case.q_lens, default=0)
        assert inputs.kwargs["max_kv_len"] == max(case.kv_lens, default=0)
        assert inputs.to_kwargs()["kv_offsets"] is inputs.kv_offsets
        for tensor in (inputs.q, inputs.k, inputs.v, inputs.dout):
            assert str(tensor.dtype) == f"torch.{case.dtype}" and torch.isfinite(tensor).all()
            assert tensor.numel() == 0 or tensor.count_nonzero() > 0


def check_offsets(offsets, lens, rows):
    assert offsets.dtype == torch.int32 and offsets.shape == (len(lens) + 1,)
    assert offsets[0] == 0 and offsets[-1] == rows and (offsets.diff() >= 0).all()
    assert offsets.diff().tolist() == list(lens)


# What each family is


def no_work(case, b):
    return case.q_lens[b] == 0 or case.kv_lens[b] == 0


def lens(case):
    return case.q_lens + case.kv_lens


def pairs(case):
    return list(zip(case.q_lens, case.kv_lens, strict=True))


PROPERTIES = {
    "uniform": lambda c: c.q_lens == c.kv_lens and min(c.q_lens) >= 1,
    "gem_like": lambda c: c.q_lens == c.kv_lens and min(c.q_lens) >= 0.4 * max(c.q_lens),
    "one_huge_many_tiny": lambda c: max(c.q_lens) >= 80 and sorted(c.q_lens)[-2] <= 64 and c.batch >= 12,
    "many_tiny": lambda c: c.batch >= 24 and min(lens(c)) >= 1 and max(lens(c)) <= 64,
    "singletons": lambda c: set(c.q_lens) == {1},
    "empty_leading": lambda c: no_work(c, 0) and not all(no_work(c, b) for b in range(c.batch)),
    "empty_middle": lambda c: (not no_work(c, 0) and not no_work(c, c.batch - 1)
                               and any(no_work(c, b) for b in range(1, c.batch - 1))),
    "empty_trailing": lambda c: no_work(c, c.batch - 1) and not no_work(c, 0),
    "empty_runs": lambda c: any(no_work(c, b) and no_work(c, b + 1) for b in range(c.batch - 1)),
    "all_empty": lambda c: c.batch >= 1 and set(lens(c)) == {0},
    "batch_zero": lambda c: c.batch == 0,
    "block_edges": lambda c: all(n >= 15 and n % 16 in (15, 0, 1) for n in lens(c)),
    "power_law": lambda c: c.batch >= 1 and min(lens(c)) >= 1,
    "independent_qkv": lambda c: any(q > kv for q, kv in pairs(c)) and any(q < kv for q, kv in pairs(c)),
    "kv_empty_q_nonempty": lambda c: any(q > 0 and kv == 0 for q, kv in pairs(c)),
    "broadcast_q": lambda c: c.broadcast_q and len(set(c.q_lens)) == 1,
    "grid_limit": lambda c: c.batch > 65535 and max(lens(c)) <= 8,
    "causal": lambda c: c.causal and c.window is None and c.q_lens == c.kv_lens,
    "causal_q_ne_kv": lambda c: c.causal and PROPERTIES["independent_qkv"](c),
    "window": lambda c: c.window is not None and not c.causal,
    "window_causal": lambda c: c.window is not None and c.causal,
    "low_rank": lambda c: c.values == "low_rank" and c.batch >= 2 and c.head_dim in (128, 256),
    "fused_qkv": lambda c: c.layout == "fused_qkv",
    "noncontig_dout": lambda c: c.layout == "noncontig_dout",
    "tail": lambda c: c.layout == "tail",
    "gqa": lambda c: c.q_heads // c.kv_heads <= 8,
    "head_dims": lambda c: c.head_dim in HEAD_DIMS and c.head_dim_v in HEAD_DIMS,
    "fp16": lambda c: c.dtype == "float16",
    "offset_overflow": lambda c: (c.q_tokens * c.q_heads * c.head_dim > 2**31 and max(c.q_lens[4:]) <= 64
                                  and c.q_lens[0] >= 2048),
}
PROPERTIES.update({name if name != "uniform" else "uniform_values": (lambda c, name=name: c.values == name)
                   for name in VALUE_FAMILIES})


def test_every_family_has_a_property_test():
    assert set(PROPERTIES) == set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_property_and_tier_bounds(name):
    family = FAMILIES[name]
    indices = [*SMALL, *MEDIUM, 200, 201] if "small" in family.tiers else range(200, 204)
    for index in indices:
        if index in PINNED.get(name, ()):
            continue
        case = family.draw(index)
        assert PROPERTIES[name](case), case.id
        tier = TIERS[("small", "medium", "large")[index // 100]]
        assert case.work <= tier.max_work and max(lens(case), default=0) <= tier.max_len, case.id


def test_families_vary_their_other_axes():
    small = [FAMILIES[name].draw(i) for name in SMALL_FAMILIES for i in range(10)]
    assert {c.head_dim for c in small} >= {32, 64, 96, 128}
    assert {c.dtype for c in small} == {"bfloat16", "float16"}
    assert {c.causal for c in small} == {False, True} and any(c.window is not None for c in small)
    assert {c.layout for c in small} == {"contiguous", "fused_qkv", "noncontig_dout", "tail"}
    assert set(range(1, 5)) <= {c.q_heads for c in small} and any(c.q_heads != c.kv_heads for c in small)
    gqa = [FAMILIES["gqa"].draw(i) for i in SMALL]
    assert {c.q_heads // c.kv_heads for c in gqa} == set(range(1, 9))
    head_dims = [FAMILIES["head_dims"].draw(i) for i in SMALL]
    assert {c.head_dim for c in head_dims} == set(HEAD_DIMS)
    assert any(c.head_dim != c.head_dim_v for c in head_dims)


def test_pinned_failure_inputs():
    assert FAMILIES["kv_empty_q_nonempty"].draw(0).q_lens == (0, 1, 0, 1)
    assert FAMILIES["kv_empty_q_nonempty"].draw(0).kv_lens == (0, 3, 0, 5)
    fa_2562 = FAMILIES["kv_empty_q_nonempty"].draw(100)
    assert (fa_2562.q_lens, fa_2562.kv_lens) == ((0, 1208, 840, 0), (2538, 1742, 840, 3072))
    assert fa_2562.head_dim == 256
    assert FAMILIES["kv_empty_q_nonempty"].draw(101).kv_lens == (0, 1, 2045)


@pytest.mark.parametrize("name", LARGE_ONLY)
def test_large_only_families_reject_small_indices(name):
    with pytest.raises(ValueError, match="large tier"):
        case_from_id(f"{name}:3")


# Values


def test_huge_equal_values():
    for dtype, huge in (("bfloat16", 133120.0), ("float16", 30720.0)):
        case = spec_case((5, 0, 9), (7, 3, 9), q_heads=2, kv_heads=1, dtype=dtype, values="huge_equal")
        inputs = make_inputs(case)
        assert HUGE_EQUAL[dtype] == huge
        for tensor in (inputs.q, inputs.k, inputs.v):
            assert (tensor.float() == huge).all()


def test_logits_below_min():
    checked = 0
    for index in range(12):
        case = FAMILIES["logits_below_min"].draw(index)
        for q, k, mask in sequences(case, make_inputs(case)):
            logits = scaled_logits(case, q, k)[:, mask]
            assert (logits < LOGIT_FLOOR).all(), case.id
            checked += logits.numel()
            rows = scaled_logits(case, q, k).masked_fill(~mask, float("nan"))
            wide = mask.sum(1) >= 2
            spread = rows.nan_to_num(nan=-1e9).amax(-1) - rows.nan_to_num(nan=1e9).amin(-1)
            assert (spread[:, wide] > 0).all(), "logits of a row differ"
    assert checked > 0


def test_ties_have_bitwise_tied_maxima():
    rows = 0
    for index in range(12):
        case = FAMILIES["ties"].draw(index)
        for q, k, mask in sequences(case, make_inputs(case)):
            logits = scaled_logits(case, q, k).masked_fill(~mask, -float("inf"))
            wide = mask.sum(1) >= 4
            tied = (logits == logits.amax(-1, keepdim=True)).sum(-1)
            assert (tied[:, wide] >= 2).all(), case.id
            rows += int(wide.sum())
    assert rows > 0


def test_sharp_softmax_with_identical_v_rows():
    for index in range(8):
        case = FAMILIES["sharp_identical_v"].draw(index)
        inputs = make_inputs(case)
        for b, v_rows in enumerate(inputs.v.split(list(case.kv_lens))):
            assert (v_rows == v_rows[:1]).all(), (case.id, b)
        for q, k, mask in sequences(case, inputs):
            seen = mask.any(1)
            if case.broadcast_q or not seen.any():
                continue
            p = torch.softmax(scaled_logits(case, q, k).masked_fill(~mask, -float("inf"))[:, seen], -1)
            assert (p.amax(-1) > 0.5).all(), case.id


def test_low_rank_values_are_heavy_tailed_and_low_rank():
    case = spec_case((200, 90), (200, 90), q_heads=2, kv_heads=1, head_dim=128, values="low_rank", seed=5)
    q = make_inputs(case).q.float()
    for head in range(2):
        x = q[:, head]
        assert x.abs().max() > 8 * x.std()
        energy = torch.linalg.svdvals(x).square()
        assert energy[: 128 // 16 + 1].sum() > 0.95 * energy.sum()


def test_plain_value_families():
    case = spec_case((300,), (300,), q_heads=2, head_dim=64, seed=3)
    uniform = make_inputs(replace(case, values="uniform"))
    assert uniform.q.min() >= 0 and uniform.q.max() <= 1  # [0, 1) in float32, 1 after rounding
    scaled = make_inputs(replace(case, values="scaled"))
    assert 2.5 < scaled.k.float().std() < 11
    assert 0.9 < make_inputs(case).v.float().std() < 1.1


@pytest.mark.parametrize("values", VALUE_FAMILIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_values_finite_and_nonzero_in_each_dtype(values, dtype):
    case = spec_case((0, 7, 40), (5, 0, 33), q_heads=4, kv_heads=2, head_dim=32, dtype=dtype, values=values,
                     causal=True, seed=11)
    for tensor in (make_inputs(case).q, make_inputs(case).v, make_inputs(case).dout):
        assert torch.isfinite(tensor).all() and tensor.count_nonzero() > 0


# Layouts


def allocation_rows(t: torch.Tensor) -> torch.Tensor:
    """All rows of t's allocation, also those past its end."""
    rows = t.untyped_storage().nbytes() // t.element_size() // t.stride(0)
    return t.as_strided((rows, *t.shape[1:]), t.stride())


def test_layouts_keep_values():
    base = spec_case((40, 0, 24), (40, 0, 24), q_heads=4, kv_heads=2, seed=5)
    contiguous = make_inputs(base)
    for layout in ("fused_qkv", "noncontig_dout", "tail"):
        laid_out = make_inputs(replace(base, layout=layout))
        for tensor in ("q", "k", "v", "dout"):
            assert torch.equal(getattr(contiguous, tensor), getattr(laid_out, tensor)), (layout, tensor)


def test_fused_qkv_shares_one_allocation():
    for index in range(5):
        case = FAMILIES["fused_qkv"].draw(index)
        if case.q_tokens == 0:
            continue
        inputs = make_inputs(case)
        pointers = {t.untyped_storage().data_ptr() for t in (inputs.q, inputs.k, inputs.v)}
        assert len(pointers) == 1
        assert inputs.q.stride(0) == (case.q_heads + 2 * case.kv_heads) * case.head_dim


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noncontig_dout(seed):
    case = spec_case((9, 30), (9, 30), q_heads=3, kv_heads=1, layout="noncontig_dout", seed=seed)
    dout = make_inputs(case).dout
    assert not dout.is_contiguous() and torch.isfinite(dout).all()
    assert torch.equal(dout, make_inputs(replace(case, layout="contiguous")).dout)
    assert max(dout.stride()) >= 2 * case.q_heads * case.head_dim_v or dout.stride(-1) == 2


def test_tail_is_nan_past_the_end():
    for index in range(5):
        case = FAMILIES["tail"].draw(index)
        inputs = make_inputs(case)
        for tensor in (inputs.q, inputs.k, inputs.v, inputs.dout):
            allocation = allocation_rows(tensor)
            assert allocation.shape[0] == tensor.shape[0] + tail_rows(case)
            assert allocation[tensor.shape[0]:].isnan().all() and not tensor.isnan().any()


def test_with_nan_tail():
    inputs = make_inputs(case_from_id("empty_runs:4"))
    padded = inputs.with_nan_tail(7)
    for name in ("q", "k", "v", "dout"):
        original, tensor = getattr(inputs, name), getattr(padded, name)
        assert torch.equal(original, tensor)
        assert allocation_rows(tensor).shape[0] == tensor.shape[0] + 7
        assert allocation_rows(tensor)[tensor.shape[0]:].isnan().all()
    for name in ("q_offsets", "kv_offsets"):
        original, offsets = getattr(inputs, name), getattr(padded, name)
        assert torch.equal(original, offsets) and offsets.dtype == original.dtype and offsets.is_contiguous()
        past_end = allocation_rows(offsets)[offsets.shape[0]:]
        assert past_end.tolist() == [int(original[-1]) + 7] * OFFSETS_PAST_END


def test_with_nan_tail_broadcast_q():
    padded = make_inputs(case_from_id("broadcast_q:0")).with_nan_tail(7)
    assert padded.q_offsets is None
    assert allocation_rows(padded.kv_offsets).shape[0] == padded.kv_offsets.shape[0] + OFFSETS_PAST_END


# Spec ids


def test_spec_grammar():
    case = case_from_id("spec:kv=0.3.0.5,q=0.1.0.1,h=9/3,causal,scale=1.0")
    assert (case.q_lens, case.kv_lens, case.q_heads, case.kv_heads, case.head_dim) == (
        (0, 1, 0, 1), (0, 3, 0, 5), 9, 3, 64)
    assert case.causal and case.sm_scale == 1.0 and case.values == "normal" and case.seed == 0
    assert case.id == ("spec:q=0.1.0.1,kv=0.3.0.5,h=9/3,d=64/64,bf16,causal,scale=1.0,values=normal,"
                       "layout=contiguous,seed=0")
    assert case_from_id(case.id) == case
    runs = case_from_id("spec:q=1x2048.5,kv=1x2048.0,d=96/64,fp16,w=3,values=ties,layout=tail,seed=9")
    assert runs.q_lens == (1,) * 2048 + (5,) and "q=1x2048.5" in runs.id and runs.window == 3
    broadcast = case_from_id("spec:bq=128,kv=0.77.3")
    assert broadcast.broadcast_q and broadcast.q_lens == (128, 128, 128) and "bq=128" in broadcast.id
    assert case_from_id("spec:q=-,kv=-").batch == 0
    made = spec_case((3, 3, 3, 4), (1, 2, 3, 4), q_heads=8, kv_heads=2, head_dim=80, sm_scale=0.1, window=0)
    assert "q=3x3.4" in made.id and case_from_id(made.id) == made


@pytest.mark.parametrize("bad", [
    "spec:q=1.2,kv=3", "spec:q=1,kv=1,colour=red", "spec:q=1,kv=1,h=2,h=2", "spec:q=1", "spec:bq=4,kv=-",
    "spec:q=1,kv=1,h=3/2", "spec:q=1,kv=2,layout=fused_qkv", "spec:q=1,kv=1,values=gaussian",
    "spec:q=1,kv=1,w=-1", "spec:q=1x0,kv=-", "spec:q=1,kv=1,scale=inf", "uniform:07", "uniform:300",
    "nonsense:1", "uniform",
])
def test_bad_ids_raise(bad):
    with pytest.raises(ValueError):
        case_from_id(bad)


# Profiles and corpus


def test_profiles():
    profiles = {name: profile_case_ids(name) for name in PROFILES}
    assert profiles == {name: profile_case_ids(name) for name in PROFILES}
    corpus = corpus_module.load()
    for name, ids in profiles.items():
        assert len(ids) == len(set(ids))
        regressions = [i for i in corpus if name != "smoke" or case_from_id(i).work <= SMOKE_CORPUS_WORK]
        assert set(regressions) <= set(ids)
    assert {f"{name}:0" for name in SMOKE_FAMILIES} <= set(profiles["smoke"])
    assert {"batch_zero", "broadcast_q", "causal_q_ne_kv", "huge_equal", "gqa"} <= set(SMOKE_FAMILIES)
    assert set(profiles["ci"]) <= set(profiles["premerge"]) <= set(profiles["nightly"])
    families = {name: {i.partition(":")[0] for i in ids} for name, ids in profiles.items()}
    assert set(SMALL_FAMILIES) <= families["ci"] and set(FAMILIES) <= families["nightly"]
    assert 100 <= len(profiles["ci"]) <= 160
    assert all(int(i.split(":")[1]) < 100 for i in profiles["ci"] if i.partition(":")[0] in FAMILIES)
    assert any(int(i.split(":")[1]) >= 200 for i in profiles["nightly"] if i.partition(":")[0] in FAMILIES)


def test_profile_budgets():
    """smoke's families are tiny; ci (corpus included) stays within a few minutes of the Triton CPU
    interpreter, ~3.5 s per million pair-heads forward + backward at D = 64."""
    def work(ids, dims=False):
        cases = [case_from_id(i) for i in ids]
        return sum(c.work * (max(c.head_dim, c.head_dim_v) / 64 if dims else 1) for c in cases)
    smoke_families = [i for i in profile_case_ids("smoke") if not i.startswith("spec:")]
    assert work(smoke_families) <= 1e6
    assert work(corpus_module.load()) <= 1e7
    assert work(profile_case_ids("ci"), dims=True) <= 5e7


def test_corpus_reproduces_the_failures_inputs():
    cases = [case_from_id(case_id) for case_id in corpus_module.load()]
    assert all(case.id == case_id for case, case_id in zip(cases, corpus_module.load(), strict=True))
    shapes = {(case.q_lens, case.kv_lens) for case in cases}
    assert ((0, 1, 0, 1), (0, 3, 0, 5)) in shapes
    assert ((0, 1208, 840, 0), (2538, 1742, 840, 3072)) in shapes
    assert ((0, 0, 1023), (0, 1, 2045)) in shapes
    assert ((), ()) in shapes and ((0, 0, 0), (0, 0, 0)) in shapes


def test_corpus_add(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("# header\nuniform:1  # old")
    assert corpus_module.add("spec:kv=3,q=2,seed=4", "found by\nhypothesis", path)
    assert corpus_module.add("uniform:1", "again", path) is False
    assert corpus_module.load(path) == [
        "uniform:1", "spec:q=2,kv=3,h=1/1,d=64/64,bf16,values=normal,layout=contiguous,seed=4"]
    assert path.read_text().endswith("seed=4  # found by hypothesis\n")
    before = path.read_text()
    with pytest.raises(ValueError):
        corpus_module.add("uniform:x", "bad", path)
    assert path.read_text() == before


# Hypothesis strategy


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_strategy_draws_valid_replayable_cases(case):
    assert case.id.startswith("spec:") and case_from_id(case.id) == case
    assert case.work <= TIERS["small"].max_work
    inputs = make_inputs(case)
    check_offsets(inputs.kv_offsets, case.kv_lens, inputs.k.shape[0])


@settings(max_examples=20, deadline=None)
@given(cases(["empty_runs", "block_edges"], max_work=5000))
def test_strategy_keeps_families_and_budget(case):
    assert case.work <= 5000 and case_from_id(case.id) == case
    assert any(no_work(case, b) and no_work(case, b + 1) for b in range(case.batch - 1)) or all(
        n % 16 in (15, 0, 1) for n in lens(case))


def test_strategy_rejects_unknown_families():
    with pytest.raises(ValueError):
        cases(["no_such_family"])


# Command line


def test_command_line(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("")
    commands = {
        "list": ["list"], "show": ["show", "broadcast_q:2"], "profile": ["profile", "smoke"],
        "add": ["corpus", "add", "spec:q=4,kv=0", "--note", "kv empty", "--corpus", str(corpus)],
    }
    running = {name: subprocess.Popen([sys.executable, "-m", "fixtures", *args], cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name, args in commands.items()}
    out = {name: (*process.communicate(timeout=120), process.returncode) for name, process in running.items()}
    assert out["list"][2] == 0 and len(out["list"][0].splitlines()) == len(FAMILIES)
    assert all(f"{name} " in out["list"][0] for name in FAMILIES)
    case = case_from_id("broadcast_q:2")
    assert out["show"][2] == 0 and case.id in out["show"][0] and "(shared, broadcast_q)" in out["show"][0]
    assert f"[{case.out_rows}, {case.q_heads}, {case.head_dim_v}]" in out["show"][0]
    smoke = profile_case_ids("smoke")
    assert out["profile"][0].splitlines() == [*smoke, f"# {len(smoke)} cases"]
    assert out["add"][2] == 0 and corpus_module.load(corpus) == [case_from_id("spec:q=4,kv=0").id]


def test_command_line_reports_bad_ids(capsys):
    assert main(["show", "uniform:x"]) == 2 and "unknown case id" in capsys.readouterr().err


def test_profile_where_selects_the_cases_of_a_field_value(capsys):
    """`profile NAME --where FIELD=VALUE`: the cases a change to one values family (or dtype, head dim, ...)
    touches, as printed ids or as the verify suite's --jfa-case arguments; a field it does not know is an error
    naming the fields it does."""
    premerge = profile_case_ids("premerge")
    low_rank = [case_id for case_id in premerge if case_from_id(case_id).values == "low_rank"]
    assert 0 < len(low_rank) < len(premerge)
    assert main(["profile", "premerge", "--where", "values=low_rank"]) == 0
    assert capsys.readouterr().out.splitlines() == [*low_rank, f"# {len(low_rank)} cases"]
    both = [case_id for case_id in low_rank if case_from_id(case_id).head_dim == 256]
    assert 0 < len(both) < len(low_rank)
    assert main(["profile", "premerge", "--where", "values=low_rank", "--where", "head_dim=256", "--pytest-args"]) == 0
    assert capsys.readouterr().out.split() == [word for case_id in both for word in ("--jfa-case", case_id)]
    assert main(["profile", "ci", "--where", "value=low_rank"]) == 2
    assert "FIELD one of family, seed" in capsys.readouterr().err
