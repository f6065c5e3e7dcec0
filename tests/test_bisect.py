"""`python -m verify bisect` for real: a throwaway git repository holding a copy of this project and a
candidate kernel (the tests.planted emulator) through a series of commits, one of which plants a precision
regression (P truncated instead of rounded); `git bisect run` must name that commit, skip the commit whose
import fails, and the kernel-config mode must name the planted bad config."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.planted import Emulator
from verify.bisect import BAD, GOOD, SKIP, classify

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("jfa", "reference", "fixtures", "verify")
CANDIDATE = '''"""The kernel under bisection: the tests.planted emulator, registered as 'candidate'."""
import os

import jfa
from tests.planted import Emulator

KERNEL = Emulator({arguments})
jfa.register_backend("candidate", KERNEL)


def attention(*args, **kwargs):
    return jfa.attention(*args, backend="candidate", **kwargs)


attention.configs = KERNEL.configs
attention.use_config = KERNEL.use_config


def crashing(*args, **kwargs):
    os.abort()
'''
# (file, content, message) per commit; the planted regression is commit PLANTED.
COMMITS = (
    ("candidate.py", CANDIDATE.format(arguments=""), "candidate kernel"),
    ("NOTES.md", "Block sizes to try: 16, 32.\n", "notes"),
    ("candidate.py", "import kernel_toolchain_not_installed  # noqa\n" + CANDIDATE.format(arguments=""),
     "candidate: needs the new toolchain (import fails here)"),
    ("candidate.py", CANDIDATE.format(arguments="block_n=32"), "candidate: BLOCK_N 32"),
    ("candidate.py", CANDIDATE.format(arguments='bug="truncated_p", block_n=32'), "candidate: cheaper P rounding"),
    ("NOTES.md", "Block sizes to try: 16, 32, 64.\n", "notes: 64"),
)
IMPORT_FAILS, BLOCK_32, PLANTED = 2, 3, 4
BISECT = [sys.executable, "-m", "verify", "bisect", "--case", "uniform:0", "--test", "forward"]


def git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com")
    proc = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True)
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def origin(tmp_path_factory) -> tuple[Path, list[str]]:
    """The repository and its commit ids, oldest first."""
    repo = tmp_path_factory.mktemp("origin")
    ignore = shutil.ignore_patterns("__pycache__", "*.part", "jfa-results")
    for package in PACKAGES:
        shutil.copytree(REPO / package, repo / package, ignore=ignore)
    (repo / "tests").mkdir()
    shutil.copy(REPO / "tests" / "planted.py", repo / "tests" / "planted.py")
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    git(repo, "init", "-q", "-b", "main")
    commits = []
    for index, (name, content, message) in enumerate(COMMITS):
        (repo / name).write_text(content)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", message)
        commits.append(git(repo, "rev-parse", "HEAD"))
        assert index or (repo / "verify" / "bisect.py").exists()
    return repo, commits


def clone(origin, tmp_path: Path, commit: str | None = None) -> Path:
    """A private checkout (tests run in parallel; git bisect moves HEAD)."""
    repo = tmp_path / "repo"
    tmp_path.mkdir(parents=True, exist_ok=True)
    git(tmp_path, "clone", "-q", str(origin[0]), str(repo))
    if commit:
        git(repo, "checkout", "-q", commit)
    return repo


def bisect(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BISECT, *args], cwd=repo, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(repo)))


def test_git_bisect_run_names_the_planted_commit_and_skips_the_broken_one(origin, tmp_path):
    repo = clone(origin, tmp_path)
    commits = origin[1]
    git(repo, "bisect", "start", commits[-1], commits[0])
    run = subprocess.run(["git", "bisect", "run", *BISECT, "--backend", "candidate:attention"], cwd=repo,
                         capture_output=True, text=True, timeout=600)
    log = git(repo, "bisect", "log")
    assert f"{commits[PLANTED]} is the first bad commit" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"# skip: [{commits[IMPORT_FAILS]}]" in log, log  # 125: git bisect skipped it
    assert "bisect: skip (125)" in run.stdout and "kernel_toolchain_not_installed" in run.stdout
    bad_line = next(line for line in run.stdout.splitlines() if line.startswith("bisect: bad (1)"))
    assert "candidate:attention on uniform:0 [forward] out: failed bias" in bad_line
    assert "worst at sequence" in bad_line and "replay: pytest verify/" in bad_line


def test_import_failure_is_a_skip(origin, tmp_path):
    proc = bisect(clone(origin, tmp_path, origin[1][IMPORT_FAILS]), "--backend", "candidate:attention")
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert "unavailable" in proc.stdout and "No module named 'kernel_toolchain_not_installed'" in proc.stdout


def test_crash_is_bad_unless_crash_skip(origin, tmp_path):
    repo = clone(origin, tmp_path)
    # one xdist worker: it dies, the controller records the crash
    proc = bisect(repo, "--backend", "candidate:crashing", "-n", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "crashed" in proc.stdout and "uniform:0" in proc.stdout
    # no xdist: the suite itself dies of SIGABRT before writing anything
    proc = bisect(repo, "--backend", "candidate:crashing", "--crash", "skip")
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert "SIGABRT" in proc.stdout


def test_baseline_rule_passes_a_block_size_change_and_fails_the_planted_commit(origin, tmp_path):
    gate_rule = ("--backend", "candidate:attention", "--baseline", "verify/baselines/cpu-interpreter.json",
                 "--compare-as", "emulator")
    proc = bisect(clone(origin, tmp_path / "a", origin[1][BLOCK_32]), *gate_rule)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = bisect(clone(origin, tmp_path / "b", origin[1][PLANTED]), *gate_rule)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "regressions against the baseline" in proc.stdout and "bias" in proc.stdout


def test_configs_names_the_planted_bad_config(origin, tmp_path):
    proc = bisect(clone(origin, tmp_path, origin[1][0]), "--configs", "--backend", "candidate:attention")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts = [re.match(r"config \d+ \{.*?\}: (\w+):", line).group(1) for line in proc.stdout.splitlines()
                if line.startswith("config ")]
    bad = Emulator.TRUNCATING_CONFIG
    assert verdicts == ["bad" if i == bad else "good" for i in range(len(Emulator.CONFIGS))], proc.stdout
    assert f"bad configs [{bad}]" in proc.stdout and '"p_rounding": "truncate"' in proc.stdout


def test_usage_mistakes_abort_git_bisect(origin, tmp_path):
    proc = bisect(clone(origin, tmp_path), "--backend", "candidate:attention", "--no-such-option")
    assert proc.returncode == 128
    proc = subprocess.run([sys.executable, "-m", "verify", "bisect", "--backend", "x"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 and "choose cases" in proc.stderr


def test_setup_failure_and_missing_gpu_are_skips():
    proc = subprocess.run([*BISECT, "--backend", "emulator", "--setup", "exit 3"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 125 and "setup failed (exit 3)" in proc.stdout
    if not torch.cuda.is_available():
        proc = subprocess.run([*BISECT, "--backend", "emulator", "--require-gpu"], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 125 and "no GPU" in proc.stdout


RECORD = dict(kind="result", backend="b", case="uniform:0", family="uniform", test="forward", tensor="out",
              status="pass", checks={"bound": True}, stats={"bound_ratio": 0.5})


@pytest.mark.parametrize("returncode, output, records, crash, expected", [
    (4, "ERROR: usage: pytest [options]\npytest: error: unrecognized arguments: --jfa-profile", [], "bad", SKIP),
    (2, "E   ModuleNotFoundError: No module named 'jfa.tile_scheduler'", [], "bad", SKIP),
    (5, "no tests ran", [], "bad", SKIP),
    (0, "SKIPPED [1] verify/test_numerics.py: b unavailable: needs an sm_90 GPU", [], "bad", SKIP),
    (None, "", [], "bad", BAD),  # timed out: a hang
    (None, "", [], "skip", SKIP),
    (-11, "", [RECORD], "bad", BAD),  # SIGSEGV after some records
    (1, "", [dict(RECORD, status="crash", tensor="*", message="worker 'gw0' crashed")], "bad", BAD),
    (1, "", [dict(RECORD, status="fail", checks={"bound": False})], "skip", BAD),
    (0, "", [RECORD], "bad", GOOD),
    (3, "INTERNALERROR> boom", [RECORD], "bad", SKIP),
])
def test_classify(returncode, output, records, crash, expected):
    assert classify(returncode, output, records, ["b"], crash).code == expected
