"""`python -m verify fuzz`: Hypothesis finds a planted bug among the fuzzer's families and shrinks it to a
small case that still fails; a clean kernel passes; a device fault stops the search at once; a failure that
does not repeat is reported as not deterministic; the time budget ends the search with what it has; usage
errors say which argument is wrong. Every search has a fixed seed and no example database, so it is the same
search on every run."""

from __future__ import annotations

import importlib
import itertools
import re
from collections import Counter

import pytest
import torch
from hypothesis import find

import jfa
import tests.planted  # noqa: F401 - registers the emulator and its planted bugs
from fixtures import case_from_id
from fixtures.strategies import SMALL_FAMILIES, cases
from verify import fuzz, results
from verify.__main__ import main
from verify.checks import check_case

_wrong_calls_left = [1]


def faulting(q, k, v, q_offsets, kv_offsets, **kwargs):
    """The bf16 model, but a sticky device fault (as a CUDA illegal address raises) on more than 5 query rows."""
    if q.shape[0] > 5:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return jfa.attention(q, k, v, q_offsets, kv_offsets, backend="bf16-model", **kwargs)


def sometimes_wrong(q, k, v, q_offsets, kv_offsets, **kwargs):
    """The bf16 model, with out doubled on its first call with more than 3 query rows."""
    out, lse = jfa.attention(q, k, v, q_offsets, kv_offsets, backend="bf16-model", **kwargs)
    if q.shape[0] > 3 and _wrong_calls_left[0]:
        _wrong_calls_left[0] -= 1
        out = out * 2
    return (out, lse) if kwargs.get("return_lse") else out


def fuzz_run(capsys, *args: str) -> tuple[int, str]:
    code = main(["fuzz", *args])
    return code, capsys.readouterr().out


def reported(text: str, label: str) -> str:
    return re.search(rf"{label}[^:]*: (spec:\S+)", text)[1]


def test_finds_a_planted_bug_and_shrinks_it(capsys, tmp_path):
    """broadcast-Q dq keeps the last sequence's contribution instead of the sum: the first failing draw is a
    batch of several sequences and heads; the reported case is the smallest that fails, two kv sequences and
    one head, and it fails again when replayed as the suite runs it. --results-out holds every case's records
    under the run's environment."""
    spec = "planted-broadcast_dq_not_summed"
    code, text = fuzz_run(capsys, "--backend", spec, "--family", "broadcast_q", "--test", "backward",
                          "--examples", "30", "--seed", "0", "--results-out", str(tmp_path / "fuzz.jsonl"))
    assert code == fuzz.FOUND, text
    first = case_from_id(reported(text, "first failing case"))
    smallest = case_from_id(reported(text, "smallest failing case"))
    assert smallest.broadcast_q and len(smallest.kv_lens) == 2 and smallest.q_heads == 1, smallest.id
    assert smallest.work < first.work, (smallest.id, first.id)
    replay = check_case(spec, smallest.id, "backward", torch.device("cpu"))
    assert [r["tensor"] for r in replay if r["status"] == "fail"] == ["dq"], replay
    assert f"--jfa-case '{smallest.id}'" in text and f"corpus add '{smallest.id}'" in text
    header, *records = results.read(tmp_path / "fuzz.jsonl")
    assert header["kind"] == "environment" and header["fuzz"]["seed"] == 0 and header["backends"] == [spec]
    run = int(re.search(r"\(seed 0, (\d+) cases run\)", text)[1])
    assert len(records) == 3 * run  # dq, dk and dv of each case run (a failing case may run again)
    assert any(r["case"] == smallest.id and r["tensor"] == "dq" and r["status"] == "fail" for r in records)


def test_a_clean_kernel_passes_every_family(capsys):
    """One case of every family with small cases: the simplest of each (a search's first draw, what
    hypothesis.find shrinks anything to), once for families whose simplest cases are the same case."""
    code, text = fuzz_run(capsys, "--backend", "emulator", "--examples", "1", "--seed", "1", "--max-work", "20000")
    assert code == fuzz.NONE_FOUND, text
    simplest = {name: find(cases([name], max_work=20000), lambda _: True).id for name in SMALL_FAMILIES}
    shared = Counter(simplest.values())
    ran = dict(re.findall(r"(\w+) (\d+)", text.split("cases run): ")[1].splitlines()[0]))
    assert f"no failure (seed 1, {len(shared)} cases run)" in text, text
    assert set(ran.values()) == {"1"} and {name for name, id_ in simplest.items() if shared[id_] == 1} <= set(ran)
    ratio = float(re.search(r"largest bound ratio (\S+) \(limit 2\)", text)[1])
    assert 0 < ratio < 2, text


def test_a_device_fault_stops_the_search_unshrunk(capsys):
    code, text = fuzz_run(capsys, "--backend", "tests.test_fuzz:faulting", "--family", "uniform", "--test",
                          "forward", "--examples", "40", "--seed", "2", "-v")
    assert code == fuzz.FOUND, text
    crashed = re.search(r"crashed on (spec:\S+) \(seed 2, (\d+) cases run\)", text)
    assert crashed and sum(case_from_id(crashed[1]).q_lens) > 5, text
    # The crashing case is the last one run (nothing ran on the faulted device after it), and not shrunk.
    run_lines = [line for line in text.splitlines() if line.startswith("[")]
    assert len(run_lines) == int(crashed[2]) and run_lines[-1].endswith(f"{crashed[1]}: CRASH"), text
    assert all(line.endswith(")") for line in run_lines[:-1]), text


def test_a_failure_that_does_not_repeat_is_reported(capsys):
    # the module as the backend spec imports it (pytest may have imported this file under another name)
    importlib.import_module("tests.test_fuzz")._wrong_calls_left[:] = [1]
    code, text = fuzz_run(capsys, "--backend", "tests.test_fuzz:sometimes_wrong", "--family", "uniform", "--test",
                          "forward", "--examples", "40", "--seed", "2")
    assert code == fuzz.FOUND, text
    assert "which passed when run again" in text and "not deterministic there" in text, text
    assert re.search(r"\[forward\] out: failed bound", text), text


def test_the_time_budget_ends_the_search(capsys, monkeypatch):
    """A clock that moves 0.4 s a case against a budget of 0.5 s: the first case runs and fails, and the budget
    stops Hypothesis' next run of the property (a shrink or its replay); the report is that case, saying
    that the shrinking was cut short."""
    clock = itertools.count(0, 0.4)
    monkeypatch.setattr(fuzz.time, "monotonic", lambda: next(clock))
    code, text = fuzz_run(capsys, "--plugin", "tests.planted", "--backend", "planted-lse_base2", "--family",
                          "uniform", "--test", "forward", "--examples", "50", "--seconds", "0.5", "--seed", "0")
    assert code == fuzz.FOUND, text
    assert "uniform: 1 failing cases run" in text and "ended the shrinking" in text, text
    assert "FOUND in 1 of 1 families (seed 0, 1 cases run; the time budget (0.5 s) ended the search)" in text
    code, text = fuzz_run(capsys, "--backend", "emulator", "--seconds", "0", "--seed", "0")
    assert code == fuzz.NONE_FOUND and "0 cases run; the time budget (0 s) ended the search" in text, text


def test_a_time_budget_gives_the_families_turns(capsys, monkeypatch):
    """With a time budget, the families' searches take turns of ROUND_EXAMPLES cases until it ends, so every
    family is searched however long the budget: a clock that moves 1 s a case, 30 s, four families."""
    clock = itertools.count()
    monkeypatch.setattr(fuzz.time, "monotonic", lambda: next(clock))
    families = ["uniform", "causal", "window", "gqa"]
    code, text = fuzz_run(capsys, "--backend", "emulator", "--test", "forward", "--examples", "100000",
                          "--seconds", "30", "--seed", "5", *[arg for name in families for arg in ("--family", name)])
    assert code == fuzz.NONE_FOUND and "the time budget (30 s) ended the search" in text, text
    counts = text.split("ended the search): ")[1].splitlines()[0]
    ran = {name: int(count) for name, count in re.findall(r"(\w+) (\d+)", counts)}
    assert set(ran) == set(families) and min(ran.values()) > fuzz.ROUND_EXAMPLES, text


@pytest.mark.parametrize(("args", "message"), [
    (["--backend", "emulator", "--family", "no_such_family"], "--family no_such_family: not a family with small"),
    (["--backend", "emulator", "--family", "offset_overflow"], "--family offset_overflow: not a family with small"),
    (["--backend", "no-such-backend"], "--backend no-such-backend:"),
    (["--backend", "tests.no_such_module:attention"], "--backend tests.no_such_module:attention is unavailable"),
    (["--backend", "emulator", "--examples", "0"], "--examples and --max-work must be at least 1"),
])
def test_usage_errors_name_the_argument(capsys, args, message):
    code = main(["fuzz", *args])
    assert code == fuzz.USAGE
    assert message in capsys.readouterr().err
