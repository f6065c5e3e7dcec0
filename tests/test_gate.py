"""The gate on real records: the clean emulator passes the committed CPU baseline and so does a legitimate
block-size change, every planted bug fails it, --update is a ratchet, and misuse exits 2."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from fixtures import profile_case_ids
from tests import planted
from verify import environment, gate, results
from verify.__main__ import main
from verify.checks import check_case

CPU = torch.device("cpu")
BASELINE = gate.default_baseline("cpu-interpreter")
CLEAN_CASES = sorted({case for bug in planted.BUGS for case in bug.families})
FORWARD_BACKWARD = ("forward", "backward")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """pytest -n runs a worker per core already: torch's thread per core in each would oversubscribe them
    (about 10x slower on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_results(path, backend: str, cases, tests=FORWARD_BACKWARD, device_class: str | None = None):
    """What the suite writes, computed in this process with verify.checks.check_case."""
    header = dict(kind="environment", **environment.collect("cpu"), profile=None, backends=[backend])
    if device_class:
        header["device_class"] = device_class
    records = [r for case in cases for test in tests for r in check_case(backend, case, test, CPU)]
    path.write_text("".join(results.dumps(r) + "\n" for r in [header, *records]))
    return path


def run_gate(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["gate", *map(str, argv)])
    return code, out.getvalue()


def entry(key: str) -> dict:
    return gate.load_baseline(BASELINE)["entries"][key]


def test_committed_baseline_is_a_ci_run_one_entry_per_line():
    text = BASELINE.read_text()
    baseline = json.loads(text)
    assert baseline["device_class"] == "cpu-interpreter"
    assert {b: e["profile"] for b, e in baseline["environments"].items()} == {
        "bf16-model": "ci", "emulator": "ci", "triton": "ci"}
    keys = list(baseline["entries"])
    assert keys == sorted(keys)
    entry_lines = [line for line in text.splitlines() if line.startswith('    "') and "|" in line.split(":")[0]]
    assert len(entry_lines) == len(keys)  # one line each: a changed statistic is a one-line diff
    for backend in ("bf16-model", "emulator", "triton"):
        cases = {key.split("|")[1] for key in keys if key.startswith(backend + "|")}
        assert cases == set(profile_case_ids("ci")), backend


def test_clean_emulator_passes_the_committed_baseline(tmp_path):
    path = write_results(tmp_path / "clean.jsonl", "emulator", CLEAN_CASES)
    code, output = run_gate("--results", path)
    assert code == 0, output
    assert f"compared {len(results.read(path)) - 1} records with the baseline; 0 new" in output
    assert "REGRESSIONS" not in output and "gate: PASS" in output


def test_a_gzipped_results_file_reads_as_the_file_it_holds(tmp_path):
    """scripts/gpu_session.sh keeps a run's records as .jsonl.gz: the gate reads it as the plain file, and a
    planted bug still fails through it."""
    import gzip

    bug = next(bug for bug in planted.BUGS if bug.name == "missing_rescale")
    plain = write_results(tmp_path / "bug.jsonl", f"planted-{bug.name}", bug.families, ("forward",))
    packed = tmp_path / "bug.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert results.read(packed) == results.read(plain)
    code, output = run_gate("--results", packed, "--compare-as", "emulator")
    assert code == 1 and "check:bound" in output, output


def test_suite_run_through_the_gate_passes(tmp_path):
    """The gate's own suite run (pytest in a subprocess), every test of one case."""
    out = tmp_path / "results.jsonl"
    proc = subprocess.run([sys.executable, "-m", "verify", "gate", "--case", "uniform:1", "--backend", "emulator",
                           "--plugin", "tests.planted", "-n", "0", "--out", str(out)], cwd=gate.REPO,
                          env=gate.suite_env(gate.REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compared 17 records with the baseline; 0 new" in proc.stdout  # out, lse, dq, dk, dv, 12 invariants
    assert "baseline: emulator" in proc.stdout
    device_line = next(line for line in proc.stdout.splitlines() if line.startswith("device_class"))
    assert device_line.split() == ["device_class", "cpu-interpreter", "cpu-interpreter"]


# Calibration cases: the record whose bound ratio moved most between block sizes (fp16:2 dq) and a spread.
CALIBRATION_CASES = ("fp16:2", "scaled:2", "independent_qkv:3", "gem_like:1", "logits_below_min:0", "uniform:0")


def test_legitimate_block_size_change_passes_and_truncating_config_fails(tmp_path):
    with planted.EMULATOR.use_config(1):  # BLOCK_N 32: a different accumulation order, still correct
        path = write_results(tmp_path / "bn32.jsonl", "emulator", CALIBRATION_CASES)
    code, output = run_gate("--results", path)
    assert code == 0, output
    assert any(r.get("config") == {"BLOCK_N": 32, "p_rounding": "nearest"} for r in results.read(path))
    with planted.EMULATOR.use_config(planted.Emulator.TRUNCATING_CONFIG):
        path = write_results(tmp_path / "truncating.jsonl", "emulator", CALIBRATION_CASES, ("forward",))
    code, output = run_gate("--results", path)
    assert code == 1
    assert "check:bias" in output and "  bias  " in output  # the check and the statistic both move


@pytest.mark.parametrize("bug", planted.BUGS, ids=lambda bug: bug.name)
def test_planted_bug_fails_the_gate(bug, tmp_path):
    test, check = bug.caught_by.split(":")
    path = write_results(tmp_path / "bug.jsonl", bug.spec, bug.families, (test,))
    code, output = run_gate("--results", path, "--compare-as", "emulator")
    assert code == 1, output
    assert f"check:{check}" in output, output


def test_diff_table_names_case_tensor_before_after_location_and_replay(tmp_path):
    path = write_results(tmp_path / "base2.jsonl", "tests.planted:lse_base2", ["uniform:0"], ("forward",))
    code, output = run_gate("--results", path, "--compare-as", "emulator")
    assert code == 1
    record = next(r for r in results.read(path) if r.get("tensor") == "lse")
    before = entry("emulator|uniform:0|forward|lse")["bound_ratio"]
    after = gate.entry_of(record)["bound_ratio"]
    worst = record["worst"]
    row = next(line for line in output.splitlines() if "bound_ratio" in line and " lse " in line)
    assert row.split()[:5] == ["uniform:0", "tests.planted:lse_base2", "forward", "lse", "bound_ratio"]
    assert gate.fmt(before) in row and gate.fmt(after) in row and after > 100 * before
    assert f"seq {worst['sequence']} row {worst['row']} head {worst['head']}" in row
    assert "replay: pytest verify/ --jfa-backend 'tests.planted:lse_base2' --jfa-case 'uniform:0'" in output


def _scaled(record: dict, **factors) -> dict:
    stats = dict(record["stats"], **{name: record["stats"][name] * f for name, f in factors.items()})
    return dict(record, stats=stats)


def test_update_records_improvements_and_leaves_regressions(tmp_path):
    path = write_results(tmp_path / "run.jsonl", "emulator", ["uniform:0"], ("forward",))
    baseline = tmp_path / "baseline.json"
    assert run_gate("--results", path, "--baseline", baseline, "--update")[0] == 0  # creates it
    header, out, lse = results.read(path)
    assert (out["tensor"], lse["tensor"]) == ("out", "lse")
    original = gate.load_baseline(baseline)["entries"]
    # out: bound ratio 10x better (an improvement) but max ulp 3x worse (beyond the factor 2 of TOLERANCE);
    # lse: rel_l2 slightly better (within the tolerance, still recorded by --update)
    changed = [header, _scaled(out, bound_ratio=0.1, max_ulp=3.0), _scaled(lse, rel_l2=0.9)]
    path.write_text("".join(results.dumps(r) + "\n" for r in changed))
    code, output = run_gate("--results", path, "--baseline", baseline)
    assert code == 1 and "IMPROVED" in output and "REGRESSIONS (1)" in output and "1 statistics lower" in output
    code, output = run_gate("--results", path, "--baseline", baseline, "--update")
    assert code == 1 and "1 regressions left out" in output
    entries = gate.load_baseline(baseline)["entries"]
    key_out, key_lse = "emulator|uniform:0|forward|out", "emulator|uniform:0|forward|lse"
    assert entries[key_out]["bound_ratio"] == pytest.approx(original[key_out]["bound_ratio"] * 0.1, rel=1e-3)
    assert entries[key_out]["max_ulp"] == original[key_out]["max_ulp"]  # the regression is not recorded
    assert entries[key_lse]["rel_l2"] < original[key_lse]["rel_l2"]
    code, output = run_gate("--results", path, "--baseline", baseline, "--update", "--accept-regressions")
    assert code == 0 and "1 regressions accepted" in output
    entries = gate.load_baseline(baseline)["entries"]
    assert entries[key_out]["max_ulp"] == pytest.approx(original[key_out]["max_ulp"] * 3, rel=1e-3)
    assert run_gate("--results", path, "--baseline", baseline)[0] == 0
    assert [u["accepted_regressions"] for u in gate.load_baseline(baseline)["updates"]] == [0, 0, 1]


def test_missing_keys_are_reported_and_fail_only_with_strict(tmp_path):
    both = write_results(tmp_path / "both.jsonl", "emulator", ["uniform:0", "uniform:1"], ("forward",))
    baseline = tmp_path / "baseline.json"
    run_gate("--results", both, "--baseline", baseline, "--update")
    one = write_results(tmp_path / "one.jsonl", "emulator", ["uniform:0"], ("forward",))
    code, output = run_gate("--results", one, "--baseline", baseline)
    assert code == 0 and "2 baseline keys are not in this run" in output
    assert "emulator|uniform:1|forward|lse" in output and "emulator|uniform:1|forward|out" in output
    code, output = run_gate("--results", one, "--baseline", baseline, "--strict")
    assert code == 1


def test_adding_a_backend_is_one_update(tmp_path):
    baseline = tmp_path / "baseline.json"
    run_gate("--results", write_results(tmp_path / "a.jsonl", "emulator", ["uniform:0"]), "--baseline", baseline,
             "--update")
    before = baseline.read_text().splitlines()
    code, output = run_gate("--results", write_results(tmp_path / "b.jsonl", "bf16-model", ["uniform:0"]),
                            "--baseline", baseline, "--update")
    assert code == 0 and "5 new keys" in output
    environments = gate.load_baseline(baseline)["environments"]
    assert environments["bf16-model"]["backends"] == ["bf16-model"]  # each backend keeps the run that recorded it
    assert environments["emulator"]["backends"] == ["emulator"]
    after = baseline.read_text().splitlines()
    added = [line for line in after if line not in before]
    assert sum('"bf16-model|uniform:0|' in line for line in added) == 5
    assert all(line in after for line in before if '"emulator|' in line)  # the other entries are untouched


def test_an_update_records_a_backends_environment_only_with_its_values(tmp_path):
    """--update gives a backend the run's environment only where the run changed some of that backend's entries,
    and a run that changes none (the same values again; a regression left out) leaves the file as it was: the
    environment of a baseline backend stays that of the run whose values its entries hold."""
    baseline = tmp_path / "baseline.json"
    for backend in ("emulator", "bf16-model"):
        run_gate("--results", write_results(tmp_path / f"{backend}.jsonl", backend, ["uniform:0"], ("forward",)),
                 "--baseline", baseline, "--update")
    recorded = baseline.read_text()
    code, output = run_gate("--results", tmp_path / "emulator.jsonl", "--baseline", baseline, "--update")
    assert code == 0 and "nothing to record" in output and baseline.read_text() == recorded
    header, *records = (json.loads(line) for line in (tmp_path / "emulator.jsonl").read_text().splitlines())
    worse = [_scaled(r, max_ulp=3.0) for r in records]  # a regression, left out without --accept-regressions
    (tmp_path / "worse.jsonl").write_text("".join(results.dumps(r) + "\n" for r in [header, *worse]))
    code, output = run_gate("--results", tmp_path / "worse.jsonl", "--baseline", baseline, "--update")
    assert code == 1 and "nothing to record" in output and baseline.read_text() == recorded
    # One run of both backends, better only on bf16-model's values: only bf16-model takes its environment.
    _, *model_records = (json.loads(line) for line in (tmp_path / "bf16-model.jsonl").read_text().splitlines())
    both = dict(header, backends=["emulator", "bf16-model"], jfa_commit="f" * 40)
    better = [*records, *(_scaled(r, bound_ratio=0.5) for r in model_records)]
    (tmp_path / "both.jsonl").write_text("".join(results.dumps(r) + "\n" for r in [both, *better]))
    assert run_gate("--results", tmp_path / "both.jsonl", "--baseline", baseline, "--update")[0] == 0
    environments = gate.load_baseline(baseline)["environments"]
    assert environments["bf16-model"]["backends"] == ["emulator", "bf16-model"]
    assert environments["bf16-model"]["jfa_commit"] == "f" * 40
    assert environments["emulator"]["backends"] == ["emulator"]


def test_usage_errors_exit_2(tmp_path, monkeypatch):
    one = write_results(tmp_path / "one.jsonl", "emulator", ["uniform:0"], ("forward",))
    assert run_gate("--results", one, "--accept-regressions")[0] == 2
    assert run_gate("--results", tmp_path / "nothing.jsonl")[0] == 2
    two = tmp_path / "two.jsonl"
    two.write_text(one.read_text() + "".join(results.dumps(dict(r, backend="bf16-model")) + "\n"
                                             for r in results.read(one)[1:]))
    code, output = run_gate("--results", two, "--compare-as", "emulator")
    assert code == 2 and "needs a run of one backend" in output
    h200 = write_results(tmp_path / "h200.jsonl", "emulator", ["uniform:0"], ("forward",), "nvidia-h200")
    monkeypatch.setattr(gate, "BASELINES", tmp_path)  # a device class without a baseline file yet
    code, output = run_gate("--results", h200)
    assert code == 2 and "no baseline" in output and "nvidia-h200.json" in output
    # A baseline stored under the wrong name: its device class differs from the run's.
    (tmp_path / "nvidia-h200.json").write_text(BASELINE.read_text())
    code, output = run_gate("--results", h200)
    assert code == 2 and "differs from the baseline's 'cpu-interpreter'" in output
    assert run_gate("--results", h200, "--baseline", tmp_path / "nvidia-h200.json")[0] == 0  # explicit: allowed
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(io.StringIO()):
        main(["gate", "--no-such-option"])
    assert exit_info.value.code == 2


def test_environment_is_printed_side_by_side(tmp_path):
    path = write_results(tmp_path / "run.jsonl", "emulator", ["uniform:0"], ("forward",))
    code, output = run_gate("--results", path)
    header = results.read(path)[0]
    baseline_env = gate.load_baseline(BASELINE)["environments"]["emulator"]
    for name in ("device_class", "torch", "triton", "jfa_commit"):
        line = next(line for line in output.splitlines() if line.startswith(name + " "))
        assert str(header[name]) in line and str(baseline_env[name]) in line
    assert os.path.basename(str(BASELINE)) in output


def test_a_crash_is_a_regression_and_its_fix_retires_the_entry(tmp_path):
    good = write_results(tmp_path / "good.jsonl", "emulator", ["uniform:0"], ("forward",))
    header, *records = results.read(good)
    crash = dict(kind="result", backend="emulator", case="uniform:0", family="uniform", test="forward", tensor="*",
                 status="crash", message="worker 'gw0' crashed while running 'verify/test_numerics.py::test_case'")
    crashed = tmp_path / "crashed.jsonl"
    crashed.write_text(results.dumps(header) + "\n" + results.dumps(crash) + "\n")
    baseline = tmp_path / "baseline.json"
    run_gate("--results", good, "--baseline", baseline, "--update")
    code, output = run_gate("--results", crashed, "--baseline", baseline)
    assert code == 1 and "2 baseline keys are not in this run" in output  # out and lse
    row = next(line for line in output.splitlines() if line.startswith("uniform:0"))
    assert row.split()[:7] == ["uniform:0", "emulator", "forward", "*", "status", "-", "crash"]
    assert "worker 'gw0' crashed" in row
    run_gate("--results", crashed, "--baseline", baseline, "--update", "--accept-regressions")
    code, output = run_gate("--results", good, "--baseline", baseline, "--update")
    assert code == 0 and "IMPROVED" in output and "crash" in output
    assert "emulator|uniform:0|forward|*" not in gate.load_baseline(baseline)["entries"]


def test_a_run_that_died_before_merging_is_judged_from_its_parts(tmp_path):
    """xdist can end with an internal error after replacing a crashed worker: the parts are all there is."""
    crash = dict(kind="result", backend="emulator", case="uniform:0", family="uniform", test="forward", tensor="*",
                 status="crash", message="worker 'gw1' crashed")
    (tmp_path / "results.jsonl.main.part").write_text(results.dumps(crash) + "\n")
    code, output = run_gate("--results", tmp_path / "results.jsonl")
    assert code == 1 and "REGRESSIONS (1)" in output and "crash" in output


def test_parts_are_read_under_the_environment_their_workers_recorded(tmp_path):
    """Each worker writes the environment it ran in before its first records; the parts of a run that died
    before merging are judged under it (one header), and under this machine's when no worker wrote one."""
    crash = dict(kind="result", backend="emulator", case="uniform:0", family="uniform", test="forward", tensor="*",
                 status="crash", message="worker 'gw1' crashed")
    worker = dict(kind="environment", device_class="nvidia-h200", torch="2.11.0+cu130")
    (tmp_path / "results.jsonl.main.part").write_text(results.dumps(crash) + "\n")
    records = gate.read_run(tmp_path / "results.jsonl", backends=["emulator"])
    assert records[0]["device_class"] == "cpu-interpreter" and records[1:] == [crash]
    (tmp_path / "results.jsonl.gw0.part").write_text(results.dumps(worker) + "\n")
    records = gate.read_run(tmp_path / "results.jsonl", backends=["emulator"])
    assert records == [dict(worker, backends=["emulator"]), crash]


def test_source_digest_names_the_code_not_the_checkout(tmp_path):
    """The digest follows the suite's and kernels' sources, whatever git says: equal for a copy elsewhere,
    different after one byte of a kernel or of the corpus changes, blind to files outside its folders."""
    def tree(root, kernel="x = 1\n"):
        for folder in environment.SOURCE_DIRS:
            (root / folder).mkdir(parents=True)
            (root / folder / "__init__.py").write_text(f"# {folder}\n")
        (root / "jfa" / "kernel.py").write_text(kernel)
        (root / "fixtures" / "corpus.txt").write_text("uniform:0\n")
        return root

    first = environment.source_digest(tree(tmp_path / "a"))
    assert environment.source_digest(tree(tmp_path / "b")) == first
    assert environment.source_digest(tree(tmp_path / "c", kernel="x = 2\n")) != first
    (tmp_path / "a" / "fixtures" / "corpus.txt").write_text("uniform:1\n")
    assert environment.source_digest(tmp_path / "a") != first
    (tmp_path / "b" / "README.md").write_text("not code")
    (tmp_path / "b" / "verify" / "baselines").mkdir()
    (tmp_path / "b" / "verify" / "baselines" / "cpu.json").write_text("{}")
    assert environment.source_digest(tmp_path / "b") == first
    assert environment.collect("cpu")["jfa_source"] == environment.source_digest()


def test_paths_summary_counts_cases_per_reported_kernel_path():
    """The run's summary and the gate name, per backend that reports its config, how many cases took each
    forward path and backward route, so a gate run that never reached a kernel says so; backends without a
    config (and other record kinds) add nothing."""
    def record(case, test, tensor, config, backend="tlx"):
        return dict(kind="result", backend=backend, case=case, family=case.split(":")[0], test=test,
                    tensor=tensor, status="pass", config=config)

    tlx, routed = dict(path="tlx", backward="TLX passes"), dict(path="triton", backward="triton")
    records = [dict(kind="environment"),
               *(record(c, t, n, tlx) for c in ("a:0", "b:0") for t, n in (("forward", "out"), ("backward", "dq"))),
               record("c:0", "backward", "dk", routed), record("c:0", "invariants", "*", routed),
               record("a:0", "forward", "out", None, backend="triton")]
    assert results.paths_summary(records) == ["tlx forward paths (cases): tlx 2; triton 1",
                                              "tlx backward paths (cases): TLX passes 2; triton 1"]
    assert results.paths_summary([record("a:0", "forward", "out", None, backend="triton")]) == []
