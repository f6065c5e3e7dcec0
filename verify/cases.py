"""The case ids of a run whose records match, to run those cases again:

    python -m verify cases tlx.jsonl.gz --backend tlx --route "short-query pass"
    pytest -n auto verify/ --jfa-backend tlx $(python -m verify cases tlx.jsonl.gz --route "short-query pass" --args)

After a change to one kernel, the cases whose records say they took it (the backend's config: the forward
`path`, the backward route, the same fields as the run summary's "paths (cases)" lines) are the ones that
exercise it: a quick check of the change before the whole profile. `--status fail crash` picks a run's failing
cases. A case is listed when one of its records meets every filter given. One id per line, in family and seed
order, or with `--args` one line of `--jfa-case ID` arguments for pytest. Exit status 1, with nothing on
stdout, when no case matches: an empty `$(...)` would let pytest run the whole default profile instead
(messages go to stderr, for the same reason).
"""

from __future__ import annotations

import sys
from pathlib import Path

from verify.results import STATUS_COLUMNS, read, routes


def matches(record: dict, backend: str | None, route: str | None, statuses: list[str] | None,
            families: list[str] | None) -> bool:
    if record.get("kind") != "result":
        return False
    return ((backend is None or record.get("backend") == backend)
            and (route is None or any(route in name for name in routes(record).values()))
            and (not statuses or record.get("status") in statuses)
            and (not families or record.get("family") in families))


def case_order(case: str) -> tuple:
    """'family:seed' in family order, then by seed as a number."""
    family, _, seed = case.rpartition(":")
    return (family, int(seed)) if seed.isdigit() else (case, -1)


def select(records: list[dict], backend=None, route=None, statuses=None, families=None) -> list[str]:
    found = {r["case"] for r in records if matches(r, backend, route, statuses, families)}
    return sorted(found, key=case_order)


def add_arguments(parser) -> None:
    parser.add_argument("results", nargs="+", metavar="FILE", help="results files (merged, worker parts or .gz)")
    parser.add_argument("--backend", help="only this backend's records")
    parser.add_argument("--route", metavar="TEXT",
                        help="records whose forward path or backward route contains TEXT, case-sensitive "
                             "(e.g. 'short-query pass')")
    parser.add_argument("--status", nargs="+", choices=list(STATUS_COLUMNS), help="records with one of these statuses")
    parser.add_argument("--family", nargs="+", help="records of these families")
    parser.add_argument("--args", action="store_true", help="print `--jfa-case ID` arguments on one line")


def main(args) -> int:
    missing = [path for path in args.results if not Path(path).is_file()]
    if missing:
        print(f"verify cases: no such results file: {', '.join(missing)}", file=sys.stderr)
        return 2
    records = [record for path in args.results for record in read(Path(path))]
    cases = select(records, args.backend, args.route, args.status, args.family)
    if not cases:
        print("verify cases: no case has a record that meets the filters", file=sys.stderr)
        return 1
    print(" ".join(f"--jfa-case {case}" for case in cases) if args.args else "\n".join(cases))
    return 0
