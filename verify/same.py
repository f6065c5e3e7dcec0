"""Whether two runs of the suite found the same, record for record:

    python -m verify same --a pm1.jsonl --b pm2.jsonl
    python -m verify same --a shard0.jsonl shard1.jsonl shard2.jsonl --b whole.jsonl

Every result record (backend, case, test, tensor) must be in both, with equal statuses, checks, statistics,
worst locations, kernel configs and messages; the fields that belong to how the run went (which worker ran
a test, when, how long its parts took: verify.results.RUN_FIELDS) are left out, and so is each file's
environment header, whose differences (another machine, another shard) are printed as notes. The summary
table is made of those fields, so equal records give equal summaries. For a run spread over several GPUs
against one GPU's, or the shards of a CI matrix (given together) against one host's run of the whole
profile. Exit status: 0 the same, 1 not, 2 usage error.
"""

from __future__ import annotations

from pathlib import Path

from verify.results import RUN_FIELDS, read

# Environment fields that say which run or shard a file is, not what it ran on.
RUN_ENVIRONMENT = frozenset({"started_at", "merged_at", "shard"})


def split(records: list[dict]) -> tuple[list[dict], dict[tuple, dict]]:
    """(environment headers, {key: the record without its run fields}); a key found twice is an error."""
    headers, content = [], {}
    for record in records:
        if record.get("kind") == "environment":
            headers.append(record)
            continue
        key = (record.get("kind"), record.get("backend"), record.get("case"), record.get("test"),
               record.get("tensor"))
        if key in content:
            raise ValueError(f"record {'|'.join(map(str, key))} appears twice on one side")
        content[key] = {name: value for name, value in record.items() if name not in RUN_FIELDS}
    return headers, content


def differences(a: dict[tuple, dict], b: dict[tuple, dict]) -> list[str]:
    """One line per record missing from a side or per field that differs, in key order."""
    lines = []
    for key in sorted(a.keys() | b.keys(), key=lambda k: tuple(map(str, k))):
        name = "|".join(map(str, key[1:]))
        if key not in b:
            lines.append(f"only in a: {name}")
        elif key not in a:
            lines.append(f"only in b: {name}")
        else:
            for field in sorted(a[key].keys() | b[key].keys()):
                if a[key].get(field) != b[key].get(field):
                    lines.append(f"{name}: {field}: a {_short(a[key].get(field))} b {_short(b[key].get(field))}")
    return lines


def environment_notes(a_headers: list[dict], b_headers: list[dict]) -> list[str]:
    """The environment fields (GPU, driver, versions, source digest, ...) whose values differ between the
    sides, each with the values found on each side."""
    def values(headers):
        found: dict[str, set] = {}
        for header in headers:
            for field, value in header.items():
                if field not in RUN_ENVIRONMENT and field != "kind":
                    found.setdefault(field, set()).add(str(value))
        return found
    a_values, b_values = values(a_headers), values(b_headers)
    return [f"environment {field}: a {sorted(a_values.get(field, ()))} b {sorted(b_values.get(field, ()))}"
            for field in sorted(a_values.keys() | b_values.keys()) if a_values.get(field) != b_values.get(field)]


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def add_arguments(parser) -> None:
    parser.add_argument("--a", nargs="+", required=True, metavar="FILE", help="results files of the first run")
    parser.add_argument("--b", nargs="+", required=True, metavar="FILE", help="results files of the second run")
    parser.add_argument("--limit", type=int, default=20, help="differences printed at most (default 20)")


def main(args) -> int:
    sides = []
    for paths in (args.a, args.b):
        missing = [path for path in paths if not Path(path).is_file()]
        if missing:
            print(f"verify same: no such results file: {', '.join(missing)}")
            return 2
        try:
            sides.append(split([record for path in paths for record in read(Path(path))]))
        except ValueError as error:
            print(f"verify same: {error}")
            return 2
    (a_headers, a), (b_headers, b) = sides
    for note in environment_notes(a_headers, b_headers):
        print(f"note: {note}")
    found = differences(a, b)
    if not found:
        print(f"same: {len(a)} records, equal in every field but the run's own ({', '.join(sorted(RUN_FIELDS))})")
        return 0
    print(f"different: {len(found)} differences ({len(a)} records in a, {len(b)} in b)")
    for line in found[:args.limit]:
        print(f"  {line}")
    if len(found) > args.limit:
        print(f"  ... and {len(found) - args.limit} more")
    return 1
