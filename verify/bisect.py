"""Precision-regression bisection. `python -m verify bisect` runs chosen cases on chosen backends at the
checked-out commit and exits as `git bisect run` wants:

    0    good: every record passes the suite's checks (or, with --baseline, the gate's ratchet)
    1    bad: a check fails (a gate regression with --baseline), or the backend crashes (unless --crash skip)
    125  skip: the package fails to install (--setup), import or build at this commit; the test runner
         rejects its arguments or collects nothing; the backend is unavailable; no GPU with --require-gpu
    128  a mistake in this command's own arguments: aborts `git bisect run` instead of marking commits bad

    git bisect start BAD GOOD
    git bisect run python -m verify bisect --backend triton --case uniform:3 --family gem_like:2

The suite runs in a subprocess (python -m pytest verify/, the repository at the commit first on the path),
and the verdict is read from its exit status and results file, so any commit can be judged: an ImportError
at collection is a skip, a signal or a dead xdist worker a crash. For history older than this command,
run it from a separate checkout with --repo: `git worktree add /tmp/jfa-tool HEAD`, then
`git bisect run env -C /tmp/jfa-tool python -m verify bisect --repo "$PWD" ...`.

Kernel configurations (--configs): bisect over the autotune configurations of ONE commit to find the config
that loses precision. A backend (the registered backend object, or the function a module:function spec
names) offers them through two attributes:

    configs() -> list[dict]      the configurations its autotuner chooses among, in a fixed order
    use_config(index)            a context manager: every call inside it runs configs()[index]

Forcing must happen in the process that runs the kernel, so each config runs in its own subprocess
(`python -m verify bisect --config INDEX ...`), which checks the cases in-process inside use_config(INDEX):
no environment variable protocol is needed, and a config that crashes the process or poisons the device
takes only its own verdict down. Each config gets a verdict; the command exits 1 if any config is bad.
tests/planted.py's Emulator implements the protocol, with one config planted bad.
"""

from __future__ import annotations

import importlib
import json
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from verify import environment, gate, results
from verify.checks import check_case
from verify.runner import BackendCrash

GOOD, BAD, SKIP, ABORT = 0, 1, 125, 128
TESTS = ("forward", "backward", "invariants")
SMALL_CASES = 3  # --family NAME runs indices 0..2 of its first tier
_IMPORT_ERROR = re.compile(r"\b(ImportError|ModuleNotFoundError|SyntaxError|IndentationError)\b.*")


@dataclass
class Verdict:
    code: int
    reason: str

    @property
    def word(self) -> str:
        return {GOOD: "good", BAD: "bad", SKIP: "skip"}.get(self.code, "abort")


# Judging records -------------------------------------------------------------------------------------------
def describe(record: dict) -> str:
    """One line: what a record says, where its worst element is, and how to replay it."""
    head = f"{record['backend']} on {record['case']} [{record['test']}] {record['tensor']}"
    labels = gate.failure_labels(record)
    parts = [f"{head}: " + (f"failed {','.join(labels)}" if labels else "passes")]
    stats = record.get("stats") or {}
    if "bound_ratio" in stats:
        baseline = results.number(stats.get("baseline_ratio"))
        parts.append(f"bound ratio {results.number(stats['bound_ratio']):.3g}"
                     + ("" if baseline is None else f", baseline ratio {baseline:.3g}"))
    worst = record.get("worst")
    if worst and record["test"] != "invariants" and labels:
        column = "" if worst.get("column") is None else f" column {worst['column']}"
        parts.append(f"worst at sequence {worst['sequence']} row {worst['row']} head {worst['head']}{column}")
    elif record.get("message"):
        parts.append(record["message"].splitlines()[0][:160])
    if labels and record.get("replay"):
        parts.append(f"replay: {record['replay']}")
    return "; ".join(parts)


def _bound(record: dict) -> float:
    value = results.number((record.get("stats") or {}).get("bound_ratio"))
    return -1.0 if value is None or value != value else value


def judge(records: list[dict], crash: str = "bad", baseline: dict | None = None,
          compare_as: str | None = None) -> Verdict:
    """Crashes first (bad, or skip with crash="skip"), then failed checks (or, with a baseline, the gate's
    regressions); the worst offending record names the reason."""
    rows = [r for r in records if r.get("kind") == "result"]
    crashed = [r for r in rows if r["status"] == "crash"]
    if crashed:
        return Verdict(SKIP if crash == "skip" else BAD,
                       f"{len(crashed)} crashed; {describe(crashed[0])}" + (" (--crash skip)" if crash == "skip"
                                                                            else ""))
    if baseline is not None:
        regressions = gate.compare(rows, baseline["entries"], compare_as=compare_as).regressions
        if regressions:
            worst = max(regressions, key=lambda c: -1.0 if c.allowed is None else float(c.after) / c.allowed)
            return Verdict(BAD, f"{len(regressions)} regressions against the baseline; worst: {worst.statistic} "
                                f"{gate.fmt(worst.before)} -> {gate.fmt(worst.after)} "
                                f"(allowed {gate.fmt(worst.allowed)}); {describe(worst.record)}")
        return Verdict(GOOD, f"{len(rows)} records within the baseline; worst: {describe(max(rows, key=_bound))}")
    failing = [r for r in rows if r["status"] == "fail"]
    if failing:
        return Verdict(BAD, f"{len(failing)} of {len(rows)} records fail; worst: {describe(max(failing, key=_bound))}")
    return Verdict(GOOD, f"{len(rows)} records pass; worst: {describe(max(rows, key=_bound))}")


def classify(returncode: int | None, output: str, records: list[dict], backends: list[str], crash: str = "bad",
             baseline: dict | None = None, compare_as: str | None = None) -> Verdict:
    """The verdict on one suite run from its exit status (None: timed out), output and records."""
    rows = [r for r in records if r.get("kind") == "result"]
    if returncode is None or returncode < 0:
        what = "hung (timed out)" if returncode is None else f"was killed by {signal.Signals(-returncode).name}"
        if not any(r["status"] == "crash" for r in rows):
            return Verdict(SKIP if crash == "skip" else BAD, f"the suite {what}" + (
                f"; {describe(rows[-1])} was the last record" if rows else ""))
        return judge(rows, crash)
    if any(r["status"] == "crash" for r in rows):
        return judge(rows, crash)
    if not rows:
        import_error = _IMPORT_ERROR.search(output)
        if import_error:
            return Verdict(SKIP, f"import fails at this commit: {import_error.group(0).strip()[:200]}")
        if returncode == 4:
            return Verdict(SKIP, f"the test runner rejected its arguments: {_last_error(output)}")
        if returncode == 5:
            return Verdict(SKIP, "the test runner collected no tests")
    unavailable = [b for b in backends if not any(r["backend"] == b for r in rows)]
    if unavailable:
        match = re.search(rf"{re.escape(unavailable[0])} unavailable: (.*)", output)
        reason = match.group(1).strip() if match else f"no records (pytest exit {returncode}): {_last_error(output)}"
        return Verdict(SKIP, f"backend {unavailable[0]} unavailable: {reason}")
    verdict = judge(rows, crash, baseline, compare_as)
    if verdict.code == GOOD and returncode not in (0, 1):
        return Verdict(SKIP, f"the test runner failed (exit {returncode}): {_last_error(output)}")
    if verdict.code == GOOD and returncode == 1 and baseline is None:
        return Verdict(SKIP if crash == "skip" else BAD, f"the suite failed without a failing record: "
                                                          f"{_last_error(output)}")
    return verdict


def _last_error(output: str) -> str:
    lines = [line for line in output.splitlines() if "rror" in line] or output.splitlines() or ["(no output)"]
    return lines[-1].strip()[:200]


# Selecting cases -------------------------------------------------------------------------------------------
def family_cases(spec: str) -> list[str]:
    """NAME -> the first SMALL_CASES indices of the family's first tier; NAME:N -> the first N."""
    from fixtures.families import FAMILIES, INDICES_PER_TIER, TIER_NAMES

    name, _, count = spec.partition(":")
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}: one of {', '.join(sorted(FAMILIES))}")
    first = TIER_NAMES.index(FAMILIES[name].tiers[0]) * INDICES_PER_TIER
    return [f"{name}:{first + i}" for i in range(int(count) if count else SMALL_CASES)]


def case_ids(args) -> list[str]:
    ids = list(args.case)
    for family in args.family:
        ids += family_cases(family)
    if args.profile:
        from fixtures import profile_case_ids

        ids += profile_case_ids(args.profile)
    return list(dict.fromkeys(ids))


# One commit ------------------------------------------------------------------------------------------------
def bisect_commit(args) -> Verdict:
    repo = args.repo.resolve()
    if args.setup:
        setup = subprocess.run(args.setup, shell=True, cwd=repo, capture_output=True, text=True, check=False)
        if setup.returncode:
            return Verdict(SKIP, f"setup failed (exit {setup.returncode}): {_last_error(setup.stdout + setup.stderr)}")
    if args.require_gpu and not torch.cuda.is_available():
        return Verdict(SKIP, "no GPU (--require-gpu)")
    # A profile alone is expanded by the suite itself, at this commit; with explicit cases it is added to them.
    ids = case_ids(args) if args.case or args.family else []
    with tempfile.TemporaryDirectory(prefix="jfa-bisect-") as tmp:
        path = Path(args.results_out or Path(tmp) / "results.jsonl")
        path.unlink(missing_ok=True)  # never judge a stale file from an earlier run
        command = gate.suite_command(path, profile=None if ids else args.profile, backends=args.backend, cases=ids,
                                     workers=args.workers, plugins=args.plugin,
                                     # "unavailable" keeps the skipped test that says why a backend is missing
                                     pytest_args=["-k", " or ".join([*args.test, "unavailable"])] if args.test else ())
        try:
            proc = subprocess.run(command, cwd=repo, env=gate.suite_env(repo), capture_output=True, text=True,
                                  timeout=args.timeout, check=False)
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as timeout:
            returncode, output = None, _text(timeout.stdout) + _text(timeout.stderr)
        if args.verbose:
            print(output)
        records = gate.read_run(path, args.backend)
    baseline = gate.load_baseline(args.baseline) if args.baseline else None
    return classify(returncode, output, records, args.backend, args.crash, baseline, args.compare_as)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


# Kernel configurations -------------------------------------------------------------------------------------
def configurable(spec: str):
    """The object offering configs()/use_config() for a backend spec, or a ValueError saying why not."""
    if ":" in spec:
        module, attr = spec.split(":", 1)
        backend = getattr(importlib.import_module(module), attr)
    else:
        from jfa import backends

        backend = backends.get(spec)
    if not (callable(getattr(backend, "configs", None)) and callable(getattr(backend, "use_config", None))):
        raise ValueError(f"backend {spec} offers no configs()/use_config() (see python -m verify bisect --help)")
    return backend


def run_config(args) -> Verdict:
    """Checks the cases in this process with config args.config of the single backend forced (on a CPU, under
    the Triton interpreter that verify/__main__.py chose)."""
    for plugin in args.plugin:
        importlib.import_module(plugin)
    spec = args.backend[0]
    backend = configurable(spec)
    config = backend.configs()[args.config]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    with backend.use_config(args.config):
        for case in case_ids(args):
            for test in args.test or TESTS:
                try:
                    records += check_case(spec, case, test, device)
                except BackendCrash as crash:  # the device is unusable now: stop with what we have
                    records.append(crash.record)
                    break
    if args.results_out:
        results.write(args.results_out, dict(environment.collect(device.type), profile=args.profile,
                                             backends=[spec], config=config), records)
    baseline = gate.load_baseline(args.baseline) if args.baseline else None
    return judge(records, args.crash, baseline, args.compare_as)


def bisect_configs(args) -> int:
    """One subprocess per config of the backend; prints each config's verdict, exits 1 if any is bad."""
    for plugin in args.plugin:
        importlib.import_module(plugin)
    try:
        configs = configurable(args.backend[0]).configs()
    except (ImportError, AttributeError, ValueError) as error:
        print(f"bisect: skip ({SKIP}): {error}")
        return SKIP
    repo = args.repo.resolve()
    verdicts = []
    for index, config in enumerate(configs):
        command = [sys.executable, "-m", "verify", "bisect", "--config", str(index), *_forwarded(args)]
        if args.results_out:
            command += ["--results-out", f"{args.results_out}.config{index}"]
        try:
            proc = subprocess.run(command, cwd=repo, env=gate.suite_env(repo), capture_output=True, text=True,
                                  timeout=args.timeout, check=False)
            returncode = proc.returncode
            line = next((l for l in reversed(proc.stdout.splitlines()) if l.startswith("bisect:")), None)
            reason = line.split(": ", 2)[-1] if line else _last_error(proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired:
            returncode, reason = None, "hung (timed out)"
        if returncode is None or returncode < 0:
            code = SKIP if args.crash == "skip" else BAD
            reason = reason if returncode is None else f"killed by {signal.Signals(-returncode).name}"
        else:
            code = returncode if returncode in (GOOD, BAD, SKIP) else SKIP
        verdicts.append(Verdict(code, reason))
        print(f"config {index} {json.dumps(config, sort_keys=True)}: {verdicts[-1].word}: {reason}", flush=True)
    bad = [i for i, v in enumerate(verdicts) if v.code == BAD]
    if bad:
        print(f"bisect: bad ({BAD}) at {_commit(repo)}: bad configs {bad}: "
              + "; ".join(json.dumps(configs[i], sort_keys=True) for i in bad))
        return BAD
    if all(v.code == SKIP for v in verdicts):
        print(f"bisect: skip ({SKIP}) at {_commit(repo)}: every config was skipped")
        return SKIP
    print(f"bisect: good ({GOOD}) at {_commit(repo)}: {len(configs)} configs, none bad")
    return GOOD


def _forwarded(args) -> list[str]:
    """The options a per-config subprocess needs."""
    argv = ["--crash", args.crash]
    for option, values in (("--case", args.case), ("--family", args.family), ("--backend", args.backend),
                           ("--plugin", args.plugin), ("--test", args.test)):
        for value in values:
            argv += [option, value]
    for option, value in (("--profile", args.profile), ("--baseline", args.baseline),
                          ("--compare-as", args.compare_as)):
        if value:
            argv += [option, str(value)]
    return argv


# The command -----------------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    chosen = parser.add_argument_group("what to run (at least one of --case, --family, --profile)")
    chosen.add_argument("--case", action="append", default=[], metavar="ID", help="a case id (repeatable)")
    chosen.add_argument("--family", action="append", default=[], metavar="NAME[:N]",
                        help=f"the first {SMALL_CASES} (or N) small cases of a family (repeatable)")
    chosen.add_argument("--profile", choices=("smoke", "ci", "premerge", "nightly"), help="a whole profile")
    chosen.add_argument("--test", action="append", default=[], choices=TESTS,
                        help="only these tests (repeatable; default all three)")
    chosen.add_argument("--backend", action="append", default=[], required=True, metavar="NAME",
                        help="a registered name or package.module:function (repeatable)")
    chosen.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (pytest -p in the suite), e.g. tests.planted")
    rule = parser.add_argument_group("what is bad")
    rule.add_argument("--baseline", type=Path, metavar="FILE",
                      help="judge with the gate's ratchet against this baseline file instead of the checks")
    rule.add_argument("--compare-as", metavar="NAME", help="compare the backend as NAME's baseline entries")
    rule.add_argument("--crash", choices=("bad", "skip"), default="bad",
                      help="a crash (signal, device fault, dead worker, timeout) is bad (default) or skipped")
    how = parser.add_argument_group("how")
    how.add_argument("--repo", type=Path, default=Path.cwd(), help="the checkout to test (default: here)")
    how.add_argument("--setup", metavar="CMD", help="shell command to build/install first; failure -> skip")
    how.add_argument("--require-gpu", action="store_true", help="skip (125) when no GPU is visible")
    how.add_argument("-n", "--workers", default="0", metavar="N",
                     help="pytest-xdist workers (default 0: one pytest process, whose death by a signal is a crash)")
    how.add_argument("--timeout", type=float, default=1800, metavar="S", help="a run longer than this is a crash "
                                                                             "(a hang; default 1800)")
    how.add_argument("--results-out", type=Path, metavar="FILE", help="keep the results file here")
    how.add_argument("-v", "--verbose", action="store_true", help="print the suite's output")
    configs = parser.add_argument_group("kernel configurations of one commit")
    configs.add_argument("--configs", action="store_true",
                         help="run the cases once per config of the (single) backend; report the bad ones")
    configs.add_argument("--config", type=int, metavar="INDEX", help="run the cases in-process with config "
                                                                      "INDEX forced (what --configs runs)")


def main(args, parser) -> int:
    if not (args.case or args.family or args.profile):
        parser.error("choose cases with --case, --family or --profile")
    if (args.configs or args.config is not None or args.compare_as) and len(args.backend) != 1:
        parser.error("--configs, --config and --compare-as need exactly one --backend")
    if args.configs:
        return bisect_configs(args)
    try:
        verdict = run_config(args) if args.config is not None else bisect_commit(args)
    except (ImportError, SyntaxError) as error:
        verdict = Verdict(SKIP, f"import fails at this commit: {type(error).__name__}: {error}")
    except (ValueError, IndexError, gate.UsageError) as error:
        parser.error(str(error))
    print(f"bisect: {verdict.word} ({verdict.code}) at {_commit(args.repo)}: {verdict.reason}")
    return verdict.code


def _commit(repo: Path) -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "?"
