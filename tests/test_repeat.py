"""verify.repeat: repeated runs must be bitwise identical; a run-dependent backend is caught, a clean one passes."""

from __future__ import annotations

import pytest
import torch

from tests import planted  # noqa: F401 - registers the emulator and the planted bugs
from verify import repeat

CPU = torch.device("cpu")


@pytest.mark.parametrize("case_id", ["uniform:1", "gem_like:0"])
def test_a_dq_that_changes_from_run_to_run_is_caught_in_deterministic_mode_only(case_id):
    """A backend whose every call's dq differs (out, lse, dk and dv alike): the second run is named, at dq, with
    --deterministic; the default mode, where the contract lets dq vary, finds nothing; the emulator's runs are
    identical in both."""
    problems = repeat.repeat("tests.helpers:drifting_model", case_id, 4, True, CPU)
    assert len(problems) == 1 and problems[0].startswith("run 1: dq: "), problems
    assert repeat.repeat("tests.helpers:drifting_model", case_id, 4, False, CPU) == []
    for deterministic in (True, False):
        assert repeat.repeat("emulator", case_id, 4, deterministic, CPU) == []


def test_the_perturbation_comes_before_every_run_but_the_first():
    calls = []
    assert repeat.repeat("emulator", "uniform:0", 4, False, CPU, perturb=lambda: calls.append(1)) == []
    assert len(calls) == 3


def test_perturb_without_a_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        repeat.main(["--backend", "emulator", "--perturb", "--case", "uniform:0"])
    assert exit_info.value.code == 2
    assert "--perturb needs a CUDA device (the runs are on cpu)" in capsys.readouterr().err
