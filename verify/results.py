"""Result records: JSON lines, one file per process that runs tests (each xdist worker), merged at the end of
the session; and the summary table (backend × family). Imports no torch: the xdist controller merges."""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verify.stats import TensorStats


def tensor_record(stats: TensorStats) -> dict:
    record = asdict(stats)
    return dict(tensor=record.pop("tensor"), status="pass" if stats.passed else "fail",
                checks=record.pop("checks"), worst=record.pop("worst"),
                worst_baseline_block=record.pop("worst_baseline_block"),
                per_sequence=record.pop("per_sequence"), stats=record)


def family_of(case_id: str) -> str:
    """The family of a case id ("family:index", or "spec:..." whose family is spec), read from the id alone:
    for records written where the case cannot be built (a crashed process, the xdist controller)."""
    return case_id.split(":", 1)[0]


def combo_of(nodeid: str) -> tuple[str, str, str] | None:
    """(backend, case id, test) of a verify test's node id "...::test_case[BACKEND|CASE|TEST]", None for
    another test or an unavailable backend's placeholder ("...[BACKEND|unavailable]")."""
    if not nodeid.endswith("]") or "[" not in nodeid:
        return None
    backend, *case_parts, test = nodeid.split("[", 1)[1][:-1].split("|")
    return (backend, "|".join(case_parts), test) if case_parts else None


def part_path(path: Path, process: str) -> Path:
    """The file of one process ("gw0", ..., "main") beside the merged results file `path`."""
    return Path(path).with_name(Path(path).name + f".{process}.part")


class ResultsFile:
    """Appends records to one JSON-lines file (each worker has its own)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, *records: dict) -> None:
        """Appends a test's records in one write, so that a worker killed mid-run (a crash, a time limit)
        leaves whole tests behind, at worst with a torn last line (read)."""
        with self.path.open("a") as handle:
            handle.write("".join(dumps(record) + "\n" for record in records))


# A record's fields that say how the run went (which worker ran the test, when, and how long its parts took),
# not what the test found: they differ between runs of the same cases (verify.same leaves them out).
RUN_FIELDS = frozenset({"worker", "finished_at", "worker_launched_at", "worker_started_at", "duration_s",
                        "context_s", "stats_s"})


def _clean(value):
    """JSON has no inf/nan: store them as strings ("inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def dumps(record: dict) -> str:
    return json.dumps(_clean(record), default=str)


def number(value) -> float | None:
    """A statistic read back from JSON (inf and nan were stored as strings)."""
    if value is None:
        return None
    return float(value)


def read(path: Path) -> list[dict]:
    """A results file's records, or a worker's, whose last line is torn when the worker was killed while
    writing it (that line is left out). A gzip-compressed file (how scripts/gpu_session.sh keeps a run's
    records) is read as the file it holds."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":  # the gzip magic number
        data = gzip.decompress(data)
    lines = [line for line in data.decode().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines) - 1:
                raise
    return records


def parts_of(path: Path) -> list[Path]:
    """The worker files beside the merged results file `path` (path.gw0.part, ..., path.resumed.part)."""
    return sorted(Path(path).parent.glob(Path(path).name + ".*.part"))


def resumed_of(path: Path) -> Path:
    """The file beside the merged results file `path` that holds a stopped run's records (resume)."""
    return part_path(path, "resumed")


def resume(path: Path) -> Path:
    """Gathers the worker files that a stopped run left beside `path` into one, resumed_of(path): the new
    run's workers read which tests it finished (finished_tests), and its merge includes it."""
    parts = parts_of(path)
    records = [record for part in parts for record in read(part)]
    resumed = resumed_of(path)
    staging = resumed.with_name(resumed.name + ".tmp")
    staging.write_text("".join(dumps(record) + "\n" for record in records))
    for part in parts:
        part.unlink()
    staging.rename(resumed)
    return resumed


def finished_tests(resumed: Path) -> set[tuple[str, str, str]]:
    """(backend, case, test) of every test with records in a resumed run's file."""
    if not Path(resumed).exists():
        return set()
    return {(r["backend"], r["case"], r["test"]) for r in read(resumed) if r.get("kind") == "result"}


def split_environment(records: list[dict]) -> tuple[dict | None, list[dict]]:
    """The first environment record among worker files' records (each process that runs tests writes its own
    before its first records; workers of one host agree), or None, and the other records."""
    environments = [r for r in records if r.get("kind") == "environment"]
    return (environments[0] if environments else None), [r for r in records if r.get("kind") != "environment"]


def merge(parts: list[Path], path: Path, run: dict) -> list[dict]:
    """Concatenates worker files (sorted, so the merged file is independent of worker timing) under one
    environment header (split_environment) with the run's fields (profile, shard, backends). Removes the parts
    and returns the result records."""
    environment, records = split_environment([record for part in parts for record in read(part)])
    records.sort(key=lambda r: (r.get("backend", ""), r.get("case", ""), r.get("test", ""), r.get("tensor", "")))
    header = dict(environment or {}, kind="environment", **run)
    with Path(path).open("w") as handle:
        handle.write(dumps(header) + "\n")
        for record in records:
            handle.write(dumps(record) + "\n")
    for part in parts:
        part.unlink()
    return records


def write(path: Path, environment: dict, records: list[dict]) -> None:
    """A results file of one process's run (bisect's in-process configs, fuzz): the environment record first,
    then the records, as `read`, the gate and the report take them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(dumps(record) + "\n" for record in [dict(environment, kind="environment"), *records]))


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    return format(value, spec)


# A result record's status -> the summary column that counts it.
STATUS_COLUMNS = {"pass": "passed", "fail": "failed", "skip": "skipped", "crash": "crashed"}
# The config fields that name the kernels a record's case took, by kind: the forward path, the backward route.
ROUTE_FIELDS = (("forward", "path"), ("backward", "backward"))


def routes(record: dict) -> dict[str, str]:
    """{kind: name} of the kernel paths a result record's config names (`ROUTE_FIELDS`); empty for other
    records and for backends that report no config."""
    config = record.get("config") if record.get("kind") == "result" else None
    if not isinstance(config, dict):
        return {}
    return {kind: config[key] for kind, key in ROUTE_FIELDS if key in config}


def summary_rows(records: list[dict]) -> list[dict]:
    """One row per (backend, family): worst statistics over its cases and tensors, and the verdict."""
    groups: dict[tuple, dict] = defaultdict(lambda: dict(bound=0.0, baseline=None, ulp=0.0, bias=0.0, passed=0,
                                                        failed=0, skipped=0, crashed=0, failing=set()))
    for r in records:
        if r.get("kind") != "result":
            continue
        g = groups[(r["backend"], r.get("family", "-"))]
        status = r["status"]
        g[STATUS_COLUMNS[status]] += 1
        if status in ("fail", "crash"):
            g["failing"].add(r.get("case", "-"))
        stats = r.get("stats") or {}
        if "bound_ratio" in stats:
            g["bound"] = max(g["bound"], number(stats["bound_ratio"]))
            g["ulp"] = max(g["ulp"], number(stats["max_ulp"]))
            if stats.get("baseline_ratio") is not None:
                g["baseline"] = max(g["baseline"] or 0.0, number(stats["baseline_ratio"]))
            g["bias"] = max(g["bias"], abs(number(stats["bias_mean"])), abs(number(stats["bias_magnitude_mean"])))
    rows = []
    for (backend, family), g in sorted(groups.items()):
        verdict = "FAIL" if g["failed"] or g["crashed"] else ("skip" if not g["passed"] else "pass")
        rows.append(dict(backend=backend, family=family, verdict=verdict, **g))
    return rows


def summary_table(records: list[dict]) -> str:
    header = (f"{'backend':<14} {'family':<22} {'bound':>8} {'baseline':>9} {'max ulp':>9} {'|bias|':>7} "
              f"{'pass':>5} {'fail':>5} {'skip':>5} verdict")
    lines = [header, "-" * len(header)]
    for row in summary_rows(records):
        fails = row["failed"] + row["crashed"]
        lines.append(
            f"{row['backend']:<14} {row['family']:<22} {_fmt(row['bound']):>8} {_fmt(row['baseline']):>9} "
            f"{_fmt(row['ulp']):>9} {_fmt(row['bias'], '.2f'):>7} {row['passed']:>5} {fails:>5} "
            f"{row['skipped']:>5} {row['verdict']}"
        )
    return "\n".join(lines)


def paths_summary(records: list[dict]) -> list[str]:
    """Which kernels the run exercised, for backends that report their config (the same for every test of a
    case): per backend the cases of each forward path (config "path") and of each backward route (config
    "backward"). A gate run that never reached a kernel shows it here: a premerge of the tlx backend whose
    cases all say backward "triton" did not test its TLX passes."""
    seen: dict[str, dict[str, dict[str, set]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(set)))
    for r in records:
        for kind, name in routes(r).items():
            seen[r["backend"]][kind][name].add(r.get("case"))
    lines = []
    for backend, kinds in sorted(seen.items()):
        for kind in ("forward", "backward"):
            if kinds[kind]:
                counts = sorted((-len(cases), name) for name, cases in kinds[kind].items())
                lines.append(f"{backend} {kind} paths (cases): " + "; ".join(f"{name} {-n}" for n, name in counts))
    return lines


def sampled_summary(records: list[dict]) -> list[str]:
    """One line per case graded on a sample of its sequences (`verify.graded`): a pass there covers those
    sequences' rows, not the whole case's."""
    graded = {r["case"]: r["graded"] for r in records if r.get("kind") == "result" and r.get("graded")}
    return [f"{case} {note}" for case, note in sorted(graded.items())]
