"""The numerics suite: forward, backward and invariants for every selected backend × case.

Parametrised by verify/conftest.py from --jfa-profile / --jfa-case / --jfa-backend / --shard.
"""

import pytest

from verify.checks import failure_message, gating


def test_case(jfa_combo, jfa_session):
    backend, case_id, test = jfa_combo
    records = jfa_session.check(backend, case_id, test)
    skipped = [r for r in records if r["status"] == "skip"]
    if skipped and len(skipped) == len(records):
        pytest.skip(skipped[0]["message"])
    message = failure_message(records)
    if message and not gating(backend):
        pytest.xfail(f"peer {backend} fails the contract: {message}")
    if message:
        pytest.fail(message, pytrace=False)
