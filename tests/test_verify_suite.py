"""The verify suite end to end, as a user runs it: pytest -n 2 verify/ in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import crashing

REPO = Path(__file__).resolve().parent.parent
SEGFAULT_CASE = "spec:q=3.4,kv=3.4,h=2/1,d=64,bf16,values=normal,layout=contiguous,seed=1"
FAULT_CASE = "spec:q=4.5,kv=4.5,h=2/1,d=64,bf16,values=normal,layout=contiguous,seed=2"
GOOD_CASES = ["uniform:0", "broadcast_q:0"]


def run_suite(tmp_path: Path, *args: str, **environ: str | None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`environ`: variables set for the run (None: unset)."""
    results = tmp_path / "results.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), **environ)
    env = {name: value for name, value in env.items() if value is not None}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "verify/",
                           "--jfa-results", str(results), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    records = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    return proc, records


def test_crashing_backend_fails_its_cases_and_the_run_goes_on(tmp_path):
    assert sum(int(n) for n in SEGFAULT_CASE.split("q=")[1].split(",")[0].split(".")) == crashing.SEGFAULT_ROWS
    assert sum(int(n) for n in FAULT_CASE.split("q=")[1].split(",")[0].split(".")) == crashing.FAULT_ROWS
    cases = [SEGFAULT_CASE, FAULT_CASE, *GOOD_CASES]
    proc, records = run_suite(tmp_path, "--jfa-backend", "tests.crashing:attention",
                              *[arg for case in cases for arg in ("--jfa-case", case)])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert records[0]["kind"] == "environment"
    by_case: dict[str, set[str]] = {}
    for r in records[1:]:
        by_case.setdefault(r["case"], set()).add(r["status"])
    assert by_case[SEGFAULT_CASE] == {"crash"} and by_case[FAULT_CASE] == {"crash"}, by_case
    for case in GOOD_CASES:
        assert by_case[case] == {"pass"}, (case, by_case)
    # The crash is reported with the case id, and the summary table is printed.
    assert "crashed" in proc.stdout and SEGFAULT_CASE in proc.stdout
    assert "jfa verify summary" in proc.stdout and "tests.crashing:attention" in proc.stdout


def test_planted_bug_fails_with_location_and_replay(tmp_path):
    proc, records = run_suite(tmp_path, "--jfa-backend", "tests.planted:lse_base2", "--jfa-case", "uniform:0")
    assert proc.returncode == 1
    assert "on uniform:0 [forward] lse: failed" in proc.stdout and "worst at sequence" in proc.stdout
    assert "replay: pytest verify/ --jfa-backend 'tests.planted:lse_base2' --jfa-case 'uniform:0'" in proc.stdout
    failed = [r for r in records[1:] if r["status"] == "fail"]
    assert {(r["test"], r["tensor"]) for r in failed} == {("forward", "lse")}


def test_shards_partition_the_profile(tmp_path):
    """Two shards run disjoint case lists whose union is the unsharded list."""
    seen = []
    for shard in ("0/2", "1/2"):
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "verify/", "--jfa-profile",
                               "smoke", "--jfa-backend", "bf16-model", "--shard", shard], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
        seen.append({line for line in proc.stdout.splitlines() if "::test_case[" in line})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "verify/", "--jfa-profile", "smoke",
                           "--jfa-backend", "bf16-model"], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    whole = {line for line in proc.stdout.splitlines() if "::test_case[" in line}
    assert seen[0] and seen[1] and not seen[0] & seen[1] and seen[0] | seen[1] == whole


def test_a_run_imports_neither_hypothesis_nor_scipy_stats_before_its_first_statistics(tmp_path):
    """Start-up and shut-down are paid by every xdist worker and the controller whatever the run's size:
    the controller must not import scipy.stats (a second, before it starts the workers), and no process
    may import hypothesis in its terminal summary (a second, after the last test). Collecting writes no
    results (it would replace the last run's)."""
    results = tmp_path / "results.jsonl"
    script = ("import sys, pytest; pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'verify/', "
              f"'--jfa-case', 'uniform:0', '--jfa-backend', 'bf16-model', '--jfa-results', {str(results)!r}]); "
              "print('imported:', 'hypothesis' in sys.modules, 'scipy.stats' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    assert "::test_case[" in proc.stdout, proc.stdout + proc.stderr
    assert "imported: False False" in proc.stdout, proc.stdout[-2000:]
    assert not list(tmp_path.iterdir())


def test_shards_run_together_find_what_the_whole_run_finds(tmp_path):
    """Two shards of a case list, run apart (as two CI hosts would), give records equal to one run of the
    whole list in every field but the run's own (`python -m verify same`), a failing case included."""
    cases = [arg for case in (*GOOD_CASES, "singletons:0", "block_edges:1") for arg in ("--jfa-case", case)]
    backends = ["--jfa-backend", "bf16-model", "--jfa-backend", "tests.planted:lse_base2"]
    files = {}
    for name, shard in (("whole", "0/1"), ("s0", "0/2"), ("s1", "1/2")):
        (tmp_path / name).mkdir()
        proc, records = run_suite(tmp_path / name, *cases, *backends, "--shard", shard)
        assert records and any(r.get("status") == "fail" for r in records), proc.stdout[-2000:] + proc.stderr[-2000:]
        files[name] = str(tmp_path / name / "results.jsonl")
    same = [sys.executable, "-m", "verify", "same", "--b", files["whole"], "--a"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([*same, files["s0"], files["s1"]], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "same: " in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run([*same, files["s0"]], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "only in b: " in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("dont_write", ["1", None])
def test_a_run_without_a_bytecode_cache_says_so(tmp_path, dont_write):
    proc, records = run_suite(tmp_path, "--jfa-case", "uniform:0", "--jfa-backend", "bf16-model",
                              PYTHONDONTWRITEBYTECODE=dont_write, PYTHONPYCACHEPREFIX=str(tmp_path / "pycache"))
    assert proc.returncode == 0 and records, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("no bytecode cache" in proc.stdout) == (dont_write is not None), proc.stdout[-1000:]


def test_the_xdist_controller_imports_no_torch(tmp_path):
    """The controller starts the workers only after its own imports, and exits only after its own
    teardown: torch (and with it triton and the kernels) would add seconds to both ends of every run. The
    workers run the tests; the controller still merges their results and prints the summary."""
    results = tmp_path / "results.jsonl"
    script = ("import sys, pytest; code = pytest.main(['-n', '1', '-q', '-p', 'no:cacheprovider', 'verify/', "
              f"'--jfa-case', 'uniform:0', '--jfa-backend', 'bf16-model', '--jfa-results', {str(results)!r}]); "
              "print('exit', int(code), 'controller imported:', sorted(m for m in ('torch', 'triton', 'jfa', "
              "'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    assert "exit 0 controller imported: []" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "jfa verify summary" in proc.stdout
    records = [json.loads(line) for line in results.read_text().splitlines()]
    header = records[0]
    assert header["kind"] == "environment" and header["device_class"] and header["torch"]  # written by the worker
    assert header["profile"] == "smoke" and header["backends"] == ["bf16-model"]
    assert {r["test"] for r in records[1:]} == {"forward", "backward", "invariants"}
    assert all(r["kind"] == "result" for r in records[1:])
    # The run's clock (python -m verify timeline): start <= each worker's launch <= its session <= merge.
    for r in records[1:]:
        assert header["started_at"] <= r["worker_launched_at"] <= r["worker_started_at"] <= header["merged_at"]


def test_resume_runs_only_the_tests_a_stopped_run_left_and_merges_both(tmp_path):
    proc, first = run_suite(tmp_path, "--jfa-backend", "bf16-model", "--jfa-case", "uniform:0")
    assert proc.returncode == 0, proc.stdout[-3000:]
    # A run stopped before its merge: uniform:0's invariants unfinished, broadcast_q:0 not started, and the
    # worker killed while writing a line.
    results = tmp_path / "results.jsonl"
    kept = [r for r in first[1:] if r["test"] != "invariants"]
    part = results.with_name(results.name + ".gw1.part")
    part.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"kind": "result", "back')
    results.unlink()

    proc, merged = run_suite(tmp_path, "--jfa-backend", "bf16-model", "--jfa-case", "uniform:0",
                             "--jfa-case", "broadcast_q:0", "--jfa-resume")
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-3000:]
    assert merged[0]["kind"] == "environment" and not list(tmp_path.glob("results.jsonl.*"))
    keys = [(r["case"], r["test"], r["tensor"]) for r in merged[1:]]
    assert len(keys) == len(set(keys))
    assert {(case, test) for case, test, _ in keys} == {
        (case, test) for case in ("uniform:0", "broadcast_q:0") for test in ("forward", "backward", "invariants")}
    carried = {(r["test"], r["tensor"]): r["finished_at"] for r in merged[1:] if r["case"] == "uniform:0"}
    assert all(carried[(r["test"], r["tensor"])] == r["finished_at"] for r in kept)
