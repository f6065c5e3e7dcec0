"""verify.same: two runs' records compared field by field, the run's own fields left out."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from verify import same
from verify.results import RUN_FIELDS, dumps


def record(case: str, tensor: str = "out", **fields) -> dict:
    base = dict(kind="result", backend="triton", case=case, family=case.split(":")[0], test="forward",
                tensor=tensor, status="pass", stats=dict(bound_ratio=0.25, max_ulp=2.0, bias_mean=1e-3,
                                                         bias_magnitude_mean=2e-3),
                worst=dict(sequence=1, row=3, head=0, column=7), worker="gw0", finished_at=100.0,
                worker_launched_at=90.0, worker_started_at=95.0, duration_s=0.5, context_s=1.5, stats_s=0.1)
    return dict(base, **fields)


def write(path, *records) -> str:
    path.write_text("".join(dumps(r) + "\n" for r in records))
    return str(path)


def run(a, b) -> int:
    return same.main(SimpleNamespace(a=a, b=b, limit=20))


def test_run_fields_and_order_do_not_matter(tmp_path, capsys):
    env = dict(kind="environment", gpu="NVIDIA H200", started_at=1.0, merged_at=2.0, shard="0/1")
    a = write(tmp_path / "a.jsonl", env, record("uniform:0"), record("gqa:1", tensor="dq"))
    moved = {name: 7.0 for name in RUN_FIELDS} | dict(worker="gw5")
    b = write(tmp_path / "b.jsonl", dict(env, started_at=9.0, shard="1/2"), record("gqa:1", tensor="dq", **moved),
              record("uniform:0", **moved))
    assert run([a], [b]) == 0
    assert "same: 2 records" in capsys.readouterr().out


@pytest.mark.parametrize("change, expected", [
    (dict(status="fail"), "uniform:0|forward|out: status: a 'pass' b 'fail'"),
    (dict(stats=dict(bound_ratio=0.26, max_ulp=2.0, bias_mean=1e-3, bias_magnitude_mean=2e-3)), "stats"),
    (dict(worst=dict(sequence=2, row=3, head=0, column=7)), "worst"),
    (dict(config={"BLOCK_M": 64}), "config: a None b {'BLOCK_M': 64}"),
])
def test_a_changed_field_is_named(tmp_path, capsys, change, expected):
    a = write(tmp_path / "a.jsonl", record("uniform:0"))
    b = write(tmp_path / "b.jsonl", record("uniform:0", **change))
    assert run([a], [b]) == 1
    assert expected in capsys.readouterr().out


def test_missing_records_and_environment_notes(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", dict(kind="environment", driver="580"), record("uniform:0"), record("gqa:1"))
    b = write(tmp_path / "b.jsonl", dict(kind="environment", driver="590"), record("uniform:0"),
              record("tiny:2"))
    assert run([a], [b]) == 1
    out = capsys.readouterr().out
    assert "only in a: triton|gqa:1|forward|out" in out and "only in b: triton|tiny:2|forward|out" in out
    assert "note: environment driver: a ['580'] b ['590']" in out


def test_shards_given_together_against_the_whole(tmp_path):
    whole = write(tmp_path / "whole.jsonl", record("uniform:0"), record("gqa:1"), record("tiny:2"))
    s0 = write(tmp_path / "s0.jsonl", record("uniform:0"), record("tiny:2"))
    s1 = write(tmp_path / "s1.jsonl", record("gqa:1"))
    assert run([s0, s1], [whole]) == 0
    assert run([s0], [whole]) == 1


def test_usage_errors(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", record("uniform:0"))
    assert run([a, a], [a]) == 2  # one file given twice: its records twice on one side
    assert "appears twice" in capsys.readouterr().out
    assert run([str(tmp_path / "absent.jsonl")], [a]) == 2
    assert "no such results file" in capsys.readouterr().out


def test_records_read_back_as_written(tmp_path):
    """NaN and inf are stored as strings, so a record equals itself after a round trip."""
    a = write(tmp_path / "a.jsonl", record("uniform:0", stats=dict(bound_ratio=float("nan"), max_ulp=float("inf"),
                                                                    bias_mean=0.0, bias_magnitude_mean=0.0)))
    assert json.loads((tmp_path / "a.jsonl").read_text())["stats"]["bound_ratio"] == "nan"
    assert run([a], [a]) == 0
