"""Property-based search for failing cases: `python -m verify fuzz` draws cases from the fuzzer's families with
Hypothesis (`fixtures.strategies.cases`), runs the suite's checks on each (forward, backward and invariants,
`verify.checks.check_case`, in this process) for the chosen backends, and when a case fails, shrinks it along
the family's axes (fewer and shorter sequences, fewer heads, plain values, mask and layout, seed 0) to the
smallest case that still fails. For each family with a failure it prints that case's spec id, what failed
where and by how much, and the commands that replay it and add it to the regression corpus.

    python -m verify fuzz --backend triton --examples 8
    python -m verify fuzz --backend mykernels.varlen:attention --family empty_runs --family causal_q_ne_kv
    python -m verify fuzz --backend tlx --seconds 600 --examples 100000

Each family gets a search of its own, so that every family is drawn from (one search over all of them would
spend most of its cases on a few: Hypothesis' generation repeats what it has drawn) and a failure shrinks
within its family. The families take turns in rounds of at most ROUND_EXAMPLES cases each, in an order shuffled
by the seed, until each has had --examples cases or --seconds have passed. With --steer, each search also
climbs towards larger bound ratios (`hypothesis.target`), so that a kernel only nearly wrong on some shapes
gets more cases like them. The profiles' case lists are fixed; this finds what they do not hold. Cases are the
small tier's (the interpreter runs each in seconds); --max-work lowers or raises the cap.

Exit status:
    0  no case failed
    1  a case failed (for each family, the smallest found is reported); a backend crashed (the first crash ends
       the search, not shrunk: the device may be unusable); or a case failed once and passed when run again
       (the backend is not deterministic there: reported as found)
    2  a usage error
"""

from __future__ import annotations

import importlib
import math
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings, target
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import Flaky

from fixtures.families import TIERS, stable_seed
from fixtures.strategies import SMALL_FAMILIES, cases
from verify import environment, results
from verify.checks import backend_fn, check_case, failure_message
from verify.limits import BOUND_LIMIT
from verify.runner import BackendCrash

NONE_FOUND, FOUND, USAGE = 0, 1, 2
TESTS = ("forward", "backward", "invariants")
FAILED = ("fail", "crash")
ROUND_EXAMPLES = 4  # cases a family's search draws before the next family's turn, in a time-limited search


class CaseFails(AssertionError):
    """A drawn case failed a check: Hypothesis shrinks it."""


class _Stop(BaseException):
    """Ends the whole search at once (Hypothesis lets a BaseException through unshrunk): a device fault, or the
    time budget."""


@dataclass
class Finding:
    family: str
    failing: list[tuple[str, list[dict]]] = field(default_factory=list)  # (case id, records), in the order run
    flaky: str | None = None  # Hypothesis' error, when the last failing case passed when run again
    cut_short: bool = False  # the time budget ended its shrinking


@dataclass
class Search:
    """What the properties saw, read back after Hypothesis returns or raises."""

    backends: list[str]
    tests: list[str]
    device: torch.device
    deadline: float | None
    verbose: bool
    steer: bool
    runs: int = 0
    by_family: Counter = field(default_factory=Counter)
    passed: set[str] = field(default_factory=set)  # case ids run and passed: not run again in a later round
    worst_bound: tuple[float, str] = (-math.inf, "")  # largest bound ratio of a passing record, and where
    findings: dict[str, Finding] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)  # every case's, in the order run, for --results-out
    crash: tuple[str, list[dict]] | None = None
    out_of_time: bool = False

    def check(self, family: str, case_id: str) -> None:
        """Every test of every backend on one case (once: a case that passed is not run again); raises
        CaseFails if a record fails, _Stop on a device fault or past the deadline."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.out_of_time = True
            raise _Stop
        if case_id in self.passed:
            return
        self.runs += 1
        self.by_family[family] += 1
        if self.verbose:  # the id first: a case that kills the process is the last one named
            print(f"[{self.runs}] {family} {case_id}: ", end="", flush=True)
        start = time.perf_counter()
        records = []
        for spec in self.backends:
            for test in self.tests:
                try:
                    records += check_case(spec, case_id, test, self.device)
                except BackendCrash as crash:  # the device is unusable now: report this case, unshrunk
                    records.append(crash.record)
                    self.crash = case_id, records
                    self.records += records
                    if self.verbose:
                        print("CRASH", flush=True)
                    raise _Stop from crash
        self.records += records
        failing = [r for r in records if r["status"] in FAILED]
        bound = max((b for r in records if (b := results.number((r.get("stats") or {}).get("bound_ratio")))
                     is not None and math.isfinite(b)), default=None)
        if self.verbose:
            print(("FAIL" if failing else "pass") + ("" if bound is None else f", worst bound ratio {bound:.3g}")
                  + f" ({time.perf_counter() - start:.1f} s)", flush=True)
        if failing:
            self.findings.setdefault(family, Finding(family)).failing.append((case_id, records))
            raise CaseFails(case_id)
        self.passed.add(case_id)
        if bound is not None:
            self.worst_bound = max(self.worst_bound, (bound, case_id))
            if self.steer:
                target(bound, label="worst bound ratio")


def search_family(args, state: Search, family: str, round_seed: int, examples: int) -> None:
    """One Hypothesis search of one family's cases: up to `examples` drawn, a failure shrunk."""

    @seed(round_seed)
    @settings(max_examples=examples, deadline=None,
              # a folder per family: a failure kept for one family is replayed in its own search only
              database=DirectoryBasedExampleDatabase(args.database / family) if args.database else None,
              phases=[phase for phase in Phase if phase != Phase.target or args.steer],
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, verbosity=Verbosity.quiet,
              print_blob=False)
    @given(cases([family], max_work=args.max_work))
    def property_(case):
        state.check(family, case.id)

    try:
        property_()
    except CaseFails:
        pass
    except Flaky as error:
        state.findings[family].flaky = type(error).__name__
    except _Stop:
        if family in state.findings and state.out_of_time:
            state.findings[family].cut_short = True
        raise


def search(args, device: torch.device) -> Search:
    """The families' searches in turn, round after round, until each has drawn args.examples cases, a backend
    crashes or the time budget ends."""
    order = list(dict.fromkeys(args.family)) or list(SMALL_FAMILIES)
    random.Random(args.seed).shuffle(order)
    state = Search(backends=args.backend, tests=args.test or list(TESTS),
                   device=device, deadline=None if args.seconds is None else time.monotonic() + args.seconds,
                   verbose=args.verbose, steer=args.steer)
    per_round = args.examples if args.seconds is None else min(args.examples, ROUND_EXAMPLES)
    with warnings.catch_warnings():
        # numpy's warnings inside the interpreted kernels on the invariants' NaN-poisoned inputs: pytest
        # collects them in the suite's runs; here they would only break up the lines of the report
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        try:
            for round_ in range(math.ceil(args.examples / per_round)):
                for family in order:
                    if family not in state.findings:
                        search_family(args, state, family, stable_seed(f"fuzz:{args.seed}:{family}", round_),
                                      min(per_round, args.examples - round_ * per_round))
        except _Stop:
            pass
    return state


def report(args, state: Search) -> int:
    """Prints what the search found; returns the exit status."""
    where = f"seed {args.seed}, {state.runs} cases run"
    for finding in state.findings.values():
        case_id, records = finding.failing[-1]
        print(f"fuzz: {finding.family}: {len(finding.failing)} failing cases run")
        print(f"first failing case ({finding.family}): {finding.failing[0][0]}")
        if finding.flaky:
            print(f"failing case ({finding.family}), which passed when run again ({finding.flaky}): the backend "
                  f"is not deterministic there: {case_id}")
        else:
            print(f"smallest failing case ({finding.family}): {case_id}")
        if finding.cut_short:
            print(f"the time budget ({args.seconds:g} s) ended the shrinking: a smaller failing case may exist")
        print(failure_message(records))
        print(_corpus_line(case_id, "fails"))
    if state.crash:
        case_id, records = state.crash
        print(f"fuzz: a backend crashed on {case_id} ({where}); not shrunk: the device may be unusable")
        print(failure_message(records))
        print(_corpus_line(case_id, "crashes"))
        return FOUND
    families = ", ".join(f"{name} {count}" for name, count in sorted(state.by_family.items())) or "no case"
    budget = f"; the time budget ({args.seconds:g} s) ended the search" if state.out_of_time else ""
    if state.findings:
        print(f"fuzz: FOUND in {len(state.findings)} of {len(state.by_family)} families ({where}{budget}): "
              + ", ".join(state.findings))
        return FOUND
    print(f"fuzz: no failure ({where}{budget}): {families}")
    if state.worst_bound[1]:
        print(f"largest bound ratio {state.worst_bound[0]:.3g} (limit {BOUND_LIMIT:g}) on {state.worst_bound[1]}")
    return NONE_FOUND


def _corpus_line(case_id: str, what: str) -> str:
    return f"keep it: python -m fixtures corpus add '{case_id}' --note '<the bug it {what} on>, found by verify fuzz'"


def add_arguments(parser) -> None:
    parser.add_argument("--backend", action="append", default=[], required=True, metavar="NAME",
                        help="a registered name or package.module:function (repeatable)")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (pytest -p in the suite), e.g. tests.planted")
    parser.add_argument("--family", action="append", default=[], metavar="NAME",
                        help="search only these families (repeatable; default every family with small cases)")
    parser.add_argument("--test", action="append", default=[], choices=TESTS,
                        help="only these tests (repeatable; default all three)")
    parser.add_argument("--examples", type=int, default=4, metavar="N",
                        help="cases to draw from each family (default 4; shrinking a failure runs more)")
    parser.add_argument("--seconds", type=float, metavar="S",
                        help="stop after S seconds: no more cases, or the smallest failing case so far")
    parser.add_argument("--max-work", type=int, default=TIERS["small"].max_work, metavar="W",
                        help=f"query-key pairs x heads of a case at most (default {TIERS['small'].max_work:,})")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="the search's seed (default: a random one, printed so the search can be repeated)")
    parser.add_argument("--database", type=Path, metavar="DIR",
                        help="keep failing examples under DIR (Hypothesis' example database, a folder per "
                             "family) and try them first next time")
    parser.add_argument("--results-out", type=Path, metavar="FILE",
                        help="write every case's records there (JSON lines, as the suite's: for verify report)")
    parser.add_argument("--steer", action="store_true",
                        help="climb towards larger bound ratios within each family (hypothesis.target)")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per case run")


def main(args) -> int:
    def usage(message: str) -> int:
        print(f"python -m verify fuzz: error: {message}", file=sys.stderr)
        return USAGE

    for plugin in args.plugin:
        importlib.import_module(plugin)
    unknown = [name for name in args.family if name not in SMALL_FAMILIES]
    if unknown:
        return usage(f"--family {unknown[0]}: not a family with small cases (one of "
                     f"{', '.join(sorted(SMALL_FAMILIES))})")
    if args.examples < 1 or args.max_work < 1:
        return usage("--examples and --max-work must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for spec in args.backend:
        try:
            reason = backend_fn(spec)[1](device)
        except (ValueError, ImportError, AttributeError) as error:
            return usage(f"--backend {spec}: {error}")
        if reason:
            return usage(f"--backend {spec} is unavailable on {device}: {reason}")
    if args.seed is None:
        args.seed = random.randrange(2**32)
    state = search(args, device)
    if args.results_out:
        results.write(args.results_out, dict(environment.collect(state.device.type), backends=args.backend,
                                             fuzz=dict(seed=args.seed, families=args.family or "all",
                                                       examples=args.examples, max_work=args.max_work)),
                      state.records)
    return report(args, state)
