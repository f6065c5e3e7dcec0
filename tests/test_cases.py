"""verify.cases: the case ids of a run whose records meet the filters, for pytest's --jfa-case."""

from __future__ import annotations

import gzip
import subprocess
import sys
from types import SimpleNamespace

import pytest

from verify import cases
from verify.results import dumps


def record(case: str, backend: str = "tlx", status: str = "pass", test: str = "backward", **config) -> dict:
    return dict(kind="result", backend=backend, case=case, family=case.split(":")[0], test=test, tensor="dq",
                status=status, config=config or None)


SHORT = "TLX short-query pass, Triton for the rest"
RUN = [
    dict(kind="environment", gpu="NVIDIA H200"),
    record("uniform:10", path="tlx", backward=SHORT),
    record("uniform:9", path="tlx", backward=SHORT),
    record("broadcast_q:100", path="triton", backward="triton"),
    record("broadcast_q:100", backend="triton", status="fail", path="packed"),
    record("gqa:1", status="crash", path="tlx", backward="TLX dQ and dK/dV passes"),
    record("gqa:2", status="skip"),  # a backend that reports no config
]


def arguments(results: list[str], **given) -> SimpleNamespace:
    """The parsed command line of `verify cases RESULTS`, the options `given` and the others at their defaults."""
    return SimpleNamespace(**(dict(results=results, backend=None, route=None, status=None, family=None,
                                   args=False) | given))


def run(tmp_path, given: dict, gz=False) -> int:
    data = "".join(dumps(r) + "\n" for r in RUN).encode()
    path = tmp_path / ("run.jsonl.gz" if gz else "run.jsonl")
    path.write_bytes(gzip.compress(data) if gz else data)
    return cases.main(arguments([str(path)], **given))


@pytest.mark.parametrize("filters, expected", [
    (dict(route="short-query pass"), ["uniform:9", "uniform:10"]),  # seeds in numeric order
    (dict(route="tlx"), ["gqa:1", "uniform:9", "uniform:10"]),  # the forward path is a route too
    (dict(route="triton"), ["broadcast_q:100"]),  # case-sensitive: not "Triton for the rest"
    (dict(backend="triton"), ["broadcast_q:100"]),
    (dict(statuses=["fail", "crash"]), ["broadcast_q:100", "gqa:1"]),
    (dict(families=["gqa"]), ["gqa:1", "gqa:2"]),
    (dict(), ["broadcast_q:100", "gqa:1", "gqa:2", "uniform:9", "uniform:10"]),
])
def test_select(filters, expected):
    assert cases.select(RUN, **filters) == expected


def test_every_filter_must_hold_on_one_record():
    """broadcast_q:100 failed on triton and took the triton route on tlx: no single record is a failing tlx one."""
    assert cases.select(RUN, backend="tlx", statuses=["fail"]) == []
    assert cases.select(RUN, backend="triton", statuses=["fail"]) == ["broadcast_q:100"]


def test_main_prints_ids_or_pytest_arguments(tmp_path, capsys):
    assert run(tmp_path, dict(route="short-query pass")) == 0
    assert capsys.readouterr().out == "uniform:9\nuniform:10\n"
    assert run(tmp_path, dict(route="short-query pass", args=True), gz=True) == 0
    assert capsys.readouterr().out == "--jfa-case uniform:9 --jfa-case uniform:10\n"


def test_no_match_prints_nothing_on_stdout(tmp_path, capsys):
    """An empty $(...) would make pytest run the whole default profile: exit 1, the message on stderr."""
    assert run(tmp_path, dict(route="no such kernel", args=True)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no case" in captured.err


def test_missing_file(tmp_path, capsys):
    assert cases.main(arguments([str(tmp_path / "none.jsonl")])) == 2
    assert "no such results file" in capsys.readouterr().err


def test_command_line(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("".join(dumps(r) + "\n" for r in RUN))
    done = subprocess.run([sys.executable, "-m", "verify", "cases", str(path), "--status", "crash", "--args"],
                          capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout) == (0, "--jfa-case gqa:1\n"), done.stderr
