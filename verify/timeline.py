"""Where a verify run's wall time went, per xdist worker, from the run's own results:

    python -m verify timeline results.jsonl [more.jsonl ...]

Each test's records carry `worker`, `finished_at` (epoch seconds), `duration_s` (the backend's calls),
`context_s` (building the case's inputs, float64 reference and bf16 baseline; 0 when the worker had them
cached), `stats_s` (the statistics of each tensor), `worker_launched_at` (when the worker's process
started) and `worker_started_at` (when its session began, after its imports). Per worker: its tests, the
time in each of those parts, its imports, its start-up (from its session's start to its first test's start:
collection, waiting for the other workers), its first test's time (counted in the parts too; where one-time
costs land: lazy imports and initialisation, seconds above what the same test costs later) and what is
left of its span (from the run's first worker start to its own last finish) outside them: scheduling,
result writing, idling. A run that scales badly shows either one worker finishing far after the others
(imbalance), a large unaccounted share on every worker, or long first tests (fixed costs). The merged
file's header adds when the run started (pytest loaded the suite, after Python's and pytest's own imports)
and when its results were merged, so the last line splits the run into start-up, tests and end. A resumed run's
file also holds the stopped run's records: their workers come first, in a table of their own.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from verify.results import read


def process_started_at() -> float | None:
    """When this process started, in epoch seconds (to Linux's clock tick, 10 ms), from /proc; None where
    there is no /proc. For xdist's workers, which it spawns directly; a process that a shell exec'd reports
    the shell's start."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        start_ticks = int(after_name[19])  # field 22 of stat, starttime, counted from field 3
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class WorkerTime:
    tests: int = 0
    contexts: int = 0
    test_s: float = 0.0
    context_s: float = 0.0
    stats_s: float = 0.0
    first_start: float = float("inf")
    first_s: float = 0.0  # the first test's time: one-time costs (imports, lazy initialisation) land there
    last_finish: float = 0.0
    started_at: float = float("inf")
    launched_at: float = float("inf")

    @property
    def imports_s(self) -> float:
        return self.started_at - self.launched_at if self.launched_at < float("inf") else 0.0

    @property
    def startup_s(self) -> float:
        return self.first_start - self.started_at if self.started_at < float("inf") else 0.0

    @property
    def busy_s(self) -> float:
        return self.test_s + self.context_s + self.stats_s


def per_worker(records: list[dict]) -> dict[str, WorkerTime]:
    """Worker -> its time, one entry per (backend, case, test) that carries timing fields."""
    tests: dict[tuple, dict] = {}
    for r in records:
        if r.get("kind") != "result" or "finished_at" not in r or "worker" not in r:
            continue
        key = (r["backend"], r["case"], r["test"], r["worker"])
        entry = tests.setdefault(key, dict(worker=r["worker"], finished_at=r["finished_at"],
                                           duration_s=r.get("duration_s") or 0.0,
                                           context_s=r.get("context_s") or 0.0, stats_s=0.0,
                                           started_at=r.get("worker_started_at") or float("inf"),
                                           launched_at=r.get("worker_launched_at") or float("inf")))
        entry["stats_s"] += r.get("stats_s") or 0.0
    workers: dict[str, WorkerTime] = defaultdict(WorkerTime)
    for t in tests.values():
        w = workers[t["worker"]]
        w.tests += 1
        w.contexts += t["context_s"] > 0.05  # a cache hit costs microseconds
        w.test_s += t["duration_s"]
        w.context_s += t["context_s"]
        w.stats_s += t["stats_s"]
        busy = t["duration_s"] + t["context_s"] + t["stats_s"]
        if t["finished_at"] - busy < w.first_start:
            w.first_start, w.first_s = t["finished_at"] - busy, busy
        w.last_finish = max(w.last_finish, t["finished_at"])
        w.started_at = min(w.started_at, t["started_at"])
        w.launched_at = min(w.launched_at, t["launched_at"])
    return dict(workers)


def table(workers: dict[str, WorkerTime], header: dict | None = None) -> str:
    if not workers:
        return "no timed records (results written before the suite recorded worker and finished_at)"
    start = min(min(w.first_start, w.started_at) for w in workers.values())
    end = max(w.last_finish for w in workers.values())
    lines = [f"{'worker':8s} {'tests':>5s} {'contexts':>8s} {'tests s':>8s} {'context s':>9s} {'stats s':>8s} "
             f"{'imports s':>9s} {'start-up s':>10s} {'first s':>8s} {'other s':>8s} {'ends at s':>9s}"]
    lines.append("-" * len(lines[0]))
    for name in sorted(workers, key=lambda n: (len(n), n)):
        w = workers[name]
        span = w.last_finish - start
        lines.append(f"{name:8s} {w.tests:5d} {w.contexts:8d} {w.test_s:8.1f} {w.context_s:9.1f} {w.stats_s:8.1f} "
                     f"{w.imports_s:9.1f} {w.startup_s:10.1f} {w.first_s:8.1f} {span - w.busy_s - w.startup_s:8.1f} "
                     f"{span:9.1f}")
    busy = sum(w.busy_s for w in workers.values())
    lines.append(f"span of the tests {end - start:.1f} s over {len(workers)} workers; busy {busy:.1f} worker-s "
                 f"({busy / len(workers):.1f} s each on average); the last worker ends "
                 f"{end - min(w.last_finish for w in workers.values()):.1f} s after the first")
    started, merged = (header or {}).get("started_at"), (header or {}).get("merged_at")
    if started is not None and merged is not None:
        first_test = min(w.first_start for w in workers.values())
        sessions = [w.started_at - started for w in workers.values() if w.started_at < float("inf")]
        lines.append(f"run: {merged - started:.1f} s from its start to merged results = start-up "
                     f"{first_test - started:.1f} s (the workers' sessions began {min(sessions, default=0):.1f}-"
                     f"{max(sessions, default=0):.1f} s after the start) + tests {end - first_test:.1f} s + end "
                     f"{merged - end:.1f} s")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("results", nargs="+", help="results files (JSON lines) of one run, or the worker files "
                        "(*.part) of a run stopped before it merged them")


def resumed_apart(records: list[dict], started_at: float) -> tuple[list[dict], list[dict]]:
    """A run's records split into those of the stopped runs it resumed (--jfa-resume: their workers' sessions
    began before it started) and its own. Taken together, each worker name's two sessions would read as one, its
    span across the pause between the runs, and the run line's start-up negative."""
    def earlier(r: dict) -> bool:
        return (r.get("worker_started_at") or float("inf")) < started_at
    return [r for r in records if earlier(r)], [r for r in records if not earlier(r)]


def main(args) -> int:
    records = [r for path in args.results for r in read(Path(path))]
    headers = [r for r in records if r.get("kind") == "environment" and "started_at" in r]
    header = headers[0] if len(headers) == 1 else None
    if header is not None:
        resumed, records = resumed_apart(records, header["started_at"])
        if resumed:
            print(f"the stopped run(s) this one resumed:\n{table(per_worker(resumed))}\n\nthis run:")
    print(table(per_worker(records), header))
    return 0
