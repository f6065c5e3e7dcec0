"""The pre-merge numerical gate: this run's per-record statistics against a stored baseline per device class,
as a ratchet. A check that newly fails (or a record that newly crashes or raises) fails the gate, and so does
a statistic that worsens beyond TOLERANCE; better values are recorded with --update.

    python -m verify gate [--profile ci] [--backend NAME ...] [--case ID ...]   runs the suite, then compares
    python -m verify gate --results FILE                                        compares an existing run

The baseline file (verify/baselines/<device_class>.json) holds its device class, per backend the environment
of the run that last recorded its values, a log of updates, and one entry per (backend, case, test, tensor)
key, one per line, keys sorted, so that a baseline change reviews as a small diff:

    "emulator|uniform:0|forward|out": {"baseline_ratio": 0.1541, "bias": 0.006603, "bound_ratio": 0.4711, ...}
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verify import checks, environment, results

REPO = Path(__file__).resolve().parent.parent
BASELINES = Path(__file__).resolve().parent / "baselines"
FORMAT = "jfa-baseline/1"

# Regression rule per statistic: after > FACTOR * before + SLACK. Statistics are bitwise reproducible on one
# device class for deterministic kernels (on a CPU once MKL's arithmetic is pinned: verify/__init__), so this
# only has to absorb legitimate kernel changes. Calibration: the tests.planted emulator (a correct tiled flash
# kernel) over the ci profile (143 cases, 715 forward and backward records) at BLOCK_N 16, 32 and 64 (its
# configs 0, 1, 3), each pair compared in both directions:
#   python -m verify gate --profile ci --backend emulator --plugin tests.planted --baseline b16.json --update
#   python -m verify bisect --profile ci --backend emulator --plugin tests.planted --test forward --test backward \
#       --config 1 --results-out c32.jsonl                         (and --config 3, --results-out c64.jsonl)
#   python -m verify gate --results c32.jsonl --baseline b16.json  (its "largest rise per statistic" table; and
#       the other directions after --update of b32.json / b64.json from c32.jsonl / c64.jsonl)
# Largest rise factor seen per statistic (before -> after, record):
#   bound_ratio     x1.74 (fp16:2 backward dq 0.046 -> 0.081); largest absolute rise +0.097 (x1.2, 0.48 -> 0.58)
#   baseline_ratio  x1.56 (gem_like:1 backward dq 0.31 -> 0.48) for values above 0.001; below, up to x17
#                   (logits_below_min:0 dq 3e-5 -> 5e-4), where fp32 logit rounding, not the kernel, dominates
#   max_ulp         x1.65 (fused_qkv spec case, forward out 18 -> 30 ulps); largest absolute +680 at 9099 (x1.07).
#                   Rerun 2026-12-05 once the statistic left out references below their error bound
#                   (verify.stats.compare): x1.65 still the largest (the same record), at most 62% of the band
#   rel_l2          x8.0 (logits_below_min spec case, backward dq 0.60 -> 4.8) and x3.3 in that family, where the
#                   global L2 error follows the logit summation order; x1.19 at most elsewhere. Rerun 2026-12-05
#                   (147 cases, 735 records) once the statistic, like max_ulp, left out references below their
#                   error bound (every gradient element of that family is): x1.12 at most (low_rank:0 backward
#                   dk 0.0028 -> 0.0032); the other statistics' largest rises as above
#   |bias|          +0.0029 at most (broadcast_q:1 forward out 0.0010 -> 0.0039); relative changes near zero
#                   mean nothing (x38 at 1e-5)
# Hence factor 2 for the max statistics (above 1.74, 1.56, 1.65) and for rel_l2 (above 1.12); the slacks keep
# near-zero values from failing on noise and are far below what a bug moves: 0.05 of bound ratio (2.5% of
# BOUND_LIMIT), 0.01 of baseline ratio (1% of its limit), 1 ulp, u = 2^-8 of relative L2 (one extra bf16
# rounding of elements that were exact), and 0.01 of |bias| (a third of limits.BIAS_FLOOR; truncating P moves
# it by 0.07-0.10). Most of the band any of these changes used: max_ulp 62%, baseline_ratio 54%, bound_ratio
# 36%, |bias| 29%, rel_l2 5%. Every planted bug of tests/planted.py still fails (tests/test_gate.py).
TOLERANCE = {
    "bound_ratio": (2.0, 0.05),
    "baseline_ratio": (2.0, 0.01),
    "max_ulp": (2.0, 1.0),
    "rel_l2": (2.0, 2.0**-8),
    "bias": (1.0, 0.01),
}
STATISTICS = tuple(TOLERANCE)
SIGNIFICANT_DIGITS = 4


class UsageError(Exception):
    """A mistake in the command line or the files it names (exit 2)."""


def key_of(record: dict, backend: str | None = None) -> str:
    return "|".join((backend or record["backend"], record["case"], record["test"], record["tensor"]))


def _rounded(value: float | None):
    """Stored precision: enough to see a change, few enough digits to keep the file readable."""
    if value is None:
        return None
    rounded = float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    return rounded if rounded == rounded and abs(rounded) != float("inf") else str(rounded)


def failure_labels(record: dict) -> list[str]:
    """What fails in a record: its failed checks, or "crash", or "exception" (a valid input raised)."""
    if record["status"] == "crash":
        return ["crash"]
    failed = [name for name, ok in (record.get("checks") or {}).items() if not ok]
    if record["status"] == "fail" and not failed:
        return ["exception"]
    return sorted(failed)


def entry_of(record: dict) -> dict:
    """The baseline entry of a result record: status, failures and the statistics of STATISTICS."""
    entry = {"status": record["status"]}
    labels = failure_labels(record)
    if labels:
        entry["failed"] = labels
    stats = record.get("stats") or {}
    if "bound_ratio" in stats:
        values = dict(bound_ratio=results.number(stats["bound_ratio"]),
                      baseline_ratio=results.number(stats.get("baseline_ratio")),
                      max_ulp=results.number(stats["max_ulp"]), rel_l2=results.number(stats["rel_l2"]),
                      bias=max(abs(results.number(stats["bias_mean"])),
                               abs(results.number(stats["bias_magnitude_mean"]))))
        entry.update({name: _rounded(value) for name, value in values.items() if value is not None})
    return entry


# Baseline files --------------------------------------------------------------------------------------------
def default_baseline(device_class: str) -> Path:
    return BASELINES / f"{device_class}.json"


def load_baseline(path: Path) -> dict:
    try:
        baseline = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read baseline {path}: {error}") from error
    if baseline.get("format") != FORMAT:
        raise UsageError(f"{path} is not a {FORMAT} file")
    return baseline


def dumps_baseline(baseline: dict) -> str:
    """JSON with one environment, update and entry per line, keys sorted."""
    def lines(items) -> str:
        return ",\n".join(f"    {item}" for item in items)

    environments = lines(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}"
                         for k, v in sorted(baseline["environments"].items()))
    updates = lines(json.dumps(u, sort_keys=True) for u in baseline["updates"])
    entries = lines(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(baseline["entries"].items()))
    return (f'{{\n  "format": "{FORMAT}",\n  "device_class": {json.dumps(baseline["device_class"])},\n'
            f'  "environments": {{\n{environments}\n  }},\n  "updates": [\n{updates}\n  ],\n'
            f'  "entries": {{\n{entries}\n  }}\n}}\n')


# Comparison ------------------------------------------------------------------------------------------------
@dataclass
class Change:
    key: str
    record: dict  # this run's record (for the location and replay command)
    statistic: str  # a statistic of STATISTICS, or "check:<name>" / "status"
    before: object
    after: object
    allowed: float | None = None  # the largest value the tolerance accepts


@dataclass
class Comparison:
    regressions: list[Change] = field(default_factory=list)
    improvements: list[Change] = field(default_factory=list)  # better beyond the tolerance, or a check fixed
    lower: list[Change] = field(default_factory=list)  # better within the tolerance (recorded by --update)
    closest: dict = field(default_factory=dict)  # statistic -> the rise that used most of its tolerance
    new: dict = field(default_factory=dict)  # key -> entry
    missing: list[str] = field(default_factory=list)
    retired: list[Change] = field(default_factory=list)  # "*" entries of tests that now produce tensor records
    matched: int = 0


def allowed_value(statistic: str, before: float) -> float:
    factor, slack = TOLERANCE[statistic]
    return factor * before + slack


def _as_float(value) -> float | None:
    return None if value is None else float(value)


def compare(records: list[dict], entries: dict, backends: list[str] | None = None,
            compare_as: str | None = None) -> Comparison:
    """Classifies every result record against the baseline entries. With compare_as, the run's records
    (of one backend) are compared as the entries of that backend. Missing keys are those of `backends`
    (default: the run's) that the run lacks."""
    comparison = Comparison()
    seen = set()
    ran = {}  # (backend, case, test) -> a record of it, to retire the "*" entry of a crash, exception or skip
    for record in records:
        if record.get("kind") != "result":
            continue
        key = key_of(record, compare_as)
        seen.add(key)
        if record["tensor"] != "*":
            ran[key.rsplit("|", 1)[0]] = record
        after = entry_of(record)
        before = entries.get(key)
        if before is None:
            comparison.new[key] = after
            comparison.regressions += [Change(key, record, _label_statistic(label), "-", after["status"])
                                       for label in after.get("failed", ())]
            continue
        comparison.matched += 1
        labels_before, labels_after = set(before.get("failed", ())), set(after.get("failed", ()))
        for label in sorted(labels_after - labels_before):
            comparison.regressions.append(Change(key, record, _label_statistic(label), before["status"],
                                                 after["status"]))
        for label in sorted(labels_before - labels_after):
            comparison.improvements.append(Change(key, record, _label_statistic(label), before["status"],
                                                  after["status"]))
        for statistic in STATISTICS:
            old, new = _as_float(before.get(statistic)), _as_float(after.get(statistic))
            if old is None or new is None or new == old or old != old:
                continue
            change = Change(key, record, statistic, old, new, allowed_value(statistic, old))
            if new > old and not _used(change) <= _used(comparison.closest.get(statistic)):
                comparison.closest[statistic] = change
            if not new <= change.allowed:  # NaN and inf after a finite value count as worse
                comparison.regressions.append(change)
            elif old > allowed_value(statistic, new):
                comparison.improvements.append(change)
            elif new < old:
                comparison.lower.append(change)
    wanted = {compare_as} if compare_as else set(backends or {k.split("|", 1)[0] for k in seen})
    for key in sorted(k for k in entries if k.split("|", 1)[0] in wanted and k not in seen):
        triple, tensor = key.rsplit("|", 1)
        if tensor == "*" and triple in ran:
            comparison.retired.append(Change(key, ran[triple], "status", entries[key]["status"], "ran"))
        else:
            comparison.missing.append(key)
    return comparison


def _used(change: Change | None) -> float:
    """How much of the tolerance band above `before` a rise uses (1 = at the limit)."""
    if change is None:
        return -1.0
    return (change.after - change.before) / (change.allowed - change.before)


def _label_statistic(label: str) -> str:
    return "status" if label in ("crash", "exception") else f"check:{label}"


def updated_entries(entries: dict, records: list[dict], comparison: Comparison, accept_regressions: bool,
                    compare_as: str | None = None) -> dict:
    """The baseline entries after --update: new keys added (failing ones only with accept_regressions), each
    statistic lowered where this run is better, fixed checks recorded; worse values only with
    accept_regressions."""
    retired = {change.key for change in comparison.retired}
    merged = {key: dict(entry) for key, entry in entries.items() if key not in retired}
    merged.update({key: entry for key, entry in comparison.new.items() if accept_regressions or "failed" not in entry})
    for record in records:
        key = key_of(record, compare_as) if record.get("kind") == "result" else None
        if key is None or key in comparison.new:
            continue
        before, after = merged[key], entry_of(record)
        if accept_regressions:
            merged[key] = after
            continue
        if set(after.get("failed", ())) <= set(before.get("failed", ())):
            before["status"] = after["status"]
            before.pop("failed", None)
            before.update({"failed": after["failed"]} if "failed" in after else {})
        for statistic in STATISTICS:
            old, new = _as_float(before.get(statistic)), _as_float(after.get(statistic))
            if new is not None and (old is None or new < old):
                before[statistic] = after[statistic]
    return merged


# Output ----------------------------------------------------------------------------------------------------
ENVIRONMENT_KEYS = ("device_class", "gpu", "capability", "driver", "cuda", "torch", "triton", "fbtriton",
                    "python", "cpu_capability", "mkl_cbwr", "jfa_commit", "jfa_dirty", "jfa_source", "profile",
                    "backends")


def environment_table(run: dict, recorded: dict) -> str:
    """This run's environment beside the environments that recorded the compared backends' baselines."""
    columns = {}  # one column per distinct recording environment, named by its backends
    for backend, env in sorted(recorded.items()):
        columns.setdefault(json.dumps(env, sort_keys=True), (env, []))[1].append(backend)
    rows = [("", "this run", *(f"baseline: {','.join(names)}" for _, names in columns.values()))]
    for name in ENVIRONMENT_KEYS:
        values = [run.get(name), *(env.get(name) for env, _ in columns.values())]
        if any(v is not None for v in values):
            rows.append((name, *("-" if v is None else _short(v) for v in values)))
    return table(rows)


def _short(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def location(change: Change) -> str:
    """Where the change shows: the worst element (or the worst block of the baseline ratio), or the
    record's message for invariants and exceptions."""
    record = change.record
    if change.statistic in ("baseline_ratio", "check:baseline") and record.get("worst_baseline_block"):
        block = record["worst_baseline_block"]
        return f"seq {block['sequence']} head {block['head']}"
    worst = record.get("worst")
    if worst and record["test"] != "invariants":
        column = "" if worst.get("column") is None else f" col {worst['column']}"
        return f"seq {worst['sequence']} row {worst['row']} head {worst['head']}{column}"
    return (record.get("message") or "-").splitlines()[0][:80]


def diff_table(changes: list[Change]) -> str:
    """case, backend, test, tensor, statistic, before, after, allowed, where; then the replay commands."""
    rows = [("case", "backend", "test", "tensor", "statistic", "before", "after", "allowed", "worst at")]
    replays = {}
    for change in changes:
        r = change.record
        rows.append((r["case"], r["backend"], r["test"], r["tensor"], change.statistic, fmt(change.before),
                     fmt(change.after), fmt(change.allowed), location(change)))
        replays.setdefault((r["backend"], r["case"]), r.get("replay") or "-")
    return table(rows) + "\n" + "\n".join(f"  replay: {command}" for command in replays.values())


def _missing_summary(missing: list[str], limit: int = 10) -> str:
    lines = [f"{len(missing)} baseline keys are not in this run:"]
    lines += [f"  {key}" for key in missing[:limit]]
    if len(missing) > limit:
        cases = {key.split("|")[1] for key in missing}
        lines.append(f"  ... and {len(missing) - limit} more ({len(cases)} cases in all)")
    return "\n".join(lines)


def read_run(path: Path, backends=()) -> list[dict]:
    """A run's records: the merged results file, or, when the run died before merging (an xdist internal
    error after a worker crash, a signal), the per-worker parts under the environment their workers recorded
    (this machine's when none did)."""
    if path.exists():
        return results.read(path)
    parts = results.parts_of(path)
    if not parts:
        return []
    recorded, records = results.split_environment([r for part in parts for r in results.read(part)])
    if recorded is None:
        recorded = dict(kind="environment", **environment.collect("cuda" if torch.cuda.is_available() else "cpu"))
    return [dict(recorded, backends=list(backends) or None), *records]


# Running the suite -----------------------------------------------------------------------------------------
def suite_command(results_path: Path, *, profile: str | None = None, backends=(), cases=(), workers="auto",
                  plugins=(), pytest_args=()) -> list[str]:
    command = [sys.executable, "-m", "pytest", "verify/", "-q", "-rs", "-p", "no:cacheprovider",
               "--jfa-results", str(results_path)]
    if str(workers) != "0":
        command += ["-n", str(workers)]
    if profile:
        command += ["--jfa-profile", profile]
    for plugin in plugins:
        command += ["-p", plugin]
    for backend in backends:
        command += ["--jfa-backend", backend]
    for case in cases:
        command += ["--jfa-case", case]
    return command + list(pytest_args)


def suite_env(repo: Path) -> dict:
    """The repository under test first on the path (not the one this command was imported from). Each
    process of the suite sizes its own thread share (verify/session.py)."""
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


# The command -----------------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    run = parser.add_argument_group("what to compare (run the suite, or read a results file)")
    run.add_argument("--results", type=Path, metavar="FILE", help="compare this results file instead of running")
    run.add_argument("--profile", choices=("smoke", "ci", "premerge", "nightly"), default="ci",
                     help="case list of the suite run (default ci)")
    run.add_argument("--backend", action="append", default=[], metavar="NAME",
                     help="backend to run: a registered name or package.module:function (repeatable; default: "
                          "every available one)")
    run.add_argument("--case", action="append", default=[], metavar="ID", help="run only these case ids")
    run.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                     help="import MODULE in the suite (pytest -p), e.g. tests.planted to register 'emulator'")
    run.add_argument("-n", "--workers", default="auto", metavar="N", help="pytest-xdist workers (default auto)")
    run.add_argument("--out", type=Path, default=Path("jfa-results/results.jsonl"), metavar="FILE",
                     help="where the suite writes its results (default jfa-results/results.jsonl)")
    base = parser.add_argument_group("baseline")
    base.add_argument("--baseline", type=Path, metavar="FILE",
                      help="baseline file (default verify/baselines/<device class of the run>.json)")
    base.add_argument("--compare-as", metavar="NAME",
                      help="compare the run's single backend with the baseline entries of NAME")
    base.add_argument("--update", action="store_true",
                      help="write improvements and new keys into the baseline (creating it if needed)")
    base.add_argument("--accept-regressions", action="store_true",
                      help="with --update: also write worse values (a reviewed, intended precision change)")
    base.add_argument("--strict", action="store_true", help="fail when baseline keys are missing from the run")


def main(args) -> int:
    try:
        return _gate(args)
    except UsageError as error:
        print(f"gate: error: {error}", file=sys.stderr)
        return 2


def _gate(args) -> int:
    if args.accept_regressions and not args.update:
        raise UsageError("--accept-regressions only makes sense with --update")
    path = args.results
    if path is None:
        path = args.out
        command = suite_command(path, profile=None if args.case else args.profile, backends=args.backend,
                                cases=args.case, workers=args.workers, plugins=args.plugin)
        print("gate: running", " ".join(command), flush=True)
        Path(path).unlink(missing_ok=True)  # never judge a stale file from an earlier run
        returncode = subprocess.run(command, cwd=REPO, env=suite_env(REPO), check=False).returncode
        if returncode not in (0, 1):  # 1: some test failed, which the comparison judges
            print(f"gate: the suite did not complete (pytest exit {returncode}); judging the records it wrote")
    records = read_run(Path(path), args.backend)
    if not records:
        raise UsageError(f"no results in {path}")
    header = records[0] if records and records[0].get("kind") == "environment" else {}
    run_backends = sorted({r["backend"] for r in records if r.get("kind") == "result"})
    if not run_backends:
        raise UsageError(f"{path} holds no result records")
    if args.compare_as and len(run_backends) != 1:
        raise UsageError(f"--compare-as needs a run of one backend, {path} has {run_backends}")
    device_class = header.get("device_class")
    baseline_path = args.baseline or (default_baseline(device_class) if device_class else None)
    if baseline_path is None:
        raise UsageError(f"{path} has no environment header: name the baseline with --baseline")
    baseline = load_baseline(baseline_path) if Path(baseline_path).exists() else None
    if baseline is None and not args.update:
        raise UsageError(f"no baseline {baseline_path} for device class {device_class!r}: record one with --update")
    requested = [args.compare_as] if args.compare_as else header.get("backends") or run_backends
    environments = baseline["environments"] if baseline else {}
    print(f"\nenvironment (baseline {baseline_path}):")
    print(environment_table(header, {b: environments[b] for b in requested if b in environments}))
    if baseline and baseline["device_class"] != device_class and args.baseline is None:
        raise UsageError(f"device class {device_class!r} of the run differs from the baseline's "
                         f"{baseline['device_class']!r}")
    entries = baseline["entries"] if baseline else {}
    for plugin in args.plugin:
        importlib.import_module(plugin)
    comparison = compare(records, entries, requested, args.compare_as)
    # Which kernels the records exercised (a PASS over records that never reached one says nothing of it), and
    # which cases they graded on a sample of their sequences.
    notes = results.paths_summary(records) + results.sampled_summary(records)
    if notes:
        print("\n" + "\n".join(notes))
    failed = _print_comparison(comparison, args.strict)
    if args.update:
        merged = updated_entries(entries, records, comparison, args.accept_regressions, args.compare_as)
        changed = {key for key in merged.keys() | entries.keys() if merged.get(key) != entries.get(key)}
        if not changed:
            # A run that records nothing (its regressions left out, nothing new or lower) leaves the file as it
            # was: its environment would otherwise replace that of the run whose values the entries hold.
            print(f"gate: nothing to record in {baseline_path}")
        else:
            log = dict(jfa_commit=header.get("jfa_commit"), profile=header.get("profile"), backends=run_backends,
                       compare_as=args.compare_as, added=len(merged.keys() - entries.keys()),
                       improved=len(comparison.improvements) + len(comparison.lower) + len(comparison.retired),
                       accepted_regressions=len(comparison.regressions) if args.accept_regressions else 0)
            Path(baseline_path).parent.mkdir(parents=True, exist_ok=True)
            recorded = {k: v for k, v in header.items() if k != "kind"}
            # Each backend's environment is that of the run that last recorded some of its entries.
            environments = {**environments, **{key.split("|", 1)[0]: recorded for key in changed}}
            Path(baseline_path).write_text(dumps_baseline(dict(
                device_class=baseline["device_class"] if baseline else device_class, environments=environments,
                updates=[*(baseline["updates"] if baseline else []), log], entries=merged)))
            left_out = 0 if args.accept_regressions else len(comparison.regressions)
            print(f"gate: updated {baseline_path}: {log['added']} new keys, {log['improved']} improved statistics"
                  + (f", {log['accepted_regressions']} regressions accepted" if log["accepted_regressions"] else "")
                  + (f", {left_out} regressions left out (--accept-regressions records them)" if left_out else ""))
            if args.accept_regressions and failed:
                print("gate: PASS (the regressions above were accepted into the baseline)")
                return 0
    print(f"gate: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0


def _gating(backend: str) -> bool:
    """Peers (torch-varlen, flex) are measured for comparison, not gated; unknown names are gated."""
    try:
        return checks.gating(backend)
    except ValueError:
        return True


def _print_comparison(comparison: Comparison, strict: bool) -> bool:
    print(f"\ncompared {comparison.matched} records with the baseline; {len(comparison.new)} new")
    if comparison.improvements or comparison.retired:
        improved = comparison.improvements + comparison.retired
        print(f"\nIMPROVED beyond the tolerance ({len(improved)}; --update records them):")
        print(diff_table(improved))
    if comparison.lower:
        print(f"\n{len(comparison.lower)} statistics lower within the tolerance (--update records them)")
    if comparison.closest:
        rows = [("statistic", "before", "after", "factor", "tolerance used", "record")]
        for statistic, c in sorted(comparison.closest.items()):
            rows.append((statistic, fmt(c.before), fmt(c.after), f"x{c.after / c.before:.3g}" if c.before else "-",
                         f"{_used(c):.0%}", " ".join(c.key.split("|")[1:])))
        print("\nlargest rise per statistic, against the tolerance (after <= factor * before + slack):")
        print(table(rows))
    if comparison.missing:
        print("\n" + _missing_summary(comparison.missing) + ("" if strict else " (not a failure without --strict)"))
    gated = [change for change in comparison.regressions if _gating(change.record["backend"])]
    measured = [change for change in comparison.regressions if change not in gated]
    if measured:
        print(f"\nworse on peers, which are measured, not gated ({len(measured)}):")
        print(diff_table(measured))
    if gated:
        print(f"\nREGRESSIONS ({len(gated)}):")
        print(diff_table(gated))
    return bool(gated) or (strict and bool(comparison.missing))
