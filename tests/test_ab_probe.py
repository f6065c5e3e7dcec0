"""scripts/ab_probe.py's row options and summary (its measuring needs a CUDA GPU: the `ab` stage of
scripts/gpu_session.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ab_probe.py"
_SPEC = importlib.util.spec_from_file_location("ab_probe", _SCRIPT)
ab_probe = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab_probe)


def test_row_options():
    assert ab_probe.row_options("gem") == dict(row="gem", causal=False, window=None, schedule=None, backend="triton")
    assert ab_probe.row_options("gem:causal:w256:grid") == dict(row="gem", causal=True, window=256, schedule="grid",
                                                                backend="triton")
    assert ab_probe.row_options("long:tlx")["backend"] == "tlx"
    with pytest.raises(ValueError, match="row option 'x' of 'gem:x'"):
        ab_probe.row_options("gem:x")


def _record(tag, row, op, ms, bits="a"):
    return dict(tag=tag, row=row, op=op, kernels_ms=ms, bits=bits)


def test_summary_means_rounds_and_compares_bits():
    records = [_record("base:1", "gem", "fwd", 4.0), _record("mine:1", "gem", "fwd", 3.0),
               _record("base:2", "gem", "fwd", 2.0), _record("mine:2", "gem", "fwd", 3.0),
               _record("base:1", "gem:causal", "fwd+bwd", 10.0, "a"),
               _record("mine:1", "gem:causal", "fwd+bwd", 8.0, "b"),
               _record("base:1", "long", "fwd", 1.0)]
    lines = ab_probe.summary(records)
    assert lines[1].split() == ["gem", "fwd", "3.000", "3.000", "1.000", "same"]
    assert lines[2].split() == ["gem:causal", "fwd+bwd", "10.000", "8.000", "0.800", "DIFFER"]
    assert lines[3].split() == ["long", "fwd", "(one", "side", "only)"]
    assert len(lines) == 4
