"""The suite must flag every planted bug with the check named for it, and pass the clean emulator."""

from __future__ import annotations

import pytest
import torch

from tests import planted
from verify.checks import check_case

CPU = torch.device("cpu")


def failed_checks(records: list[dict]) -> set[str]:
    return {name for r in records for name, ok in (r.get("checks") or {}).items() if not ok}


@pytest.mark.parametrize("bug", planted.BUGS, ids=lambda bug: bug.name)
def test_planted_bug_is_caught(bug):
    test, check = bug.caught_by.split(":")
    caught_on = [case for case in bug.families
                 if check in failed_checks(check_case(bug.spec, case, test, CPU))]
    assert caught_on, f"{bug.name} ({bug.description}) passed the {check} check on {bug.families}"


CLEAN_CASES = sorted({case for bug in planted.BUGS for case in bug.families})


@pytest.mark.parametrize("case", CLEAN_CASES)
def test_clean_emulator_passes(case):
    for test in ("forward", "backward", "invariants"):
        records = check_case("emulator", case, test, CPU)
        bad = [(r["tensor"], r.get("message") or r.get("checks")) for r in records if r["status"] != "pass"]
        assert not bad, f"emulator {test} on {case}: {bad}"
