"""scripts/ab_probe.py's row options and summary (its measuring needs a CUDA GPU: the `ab` stage of
scripts/gpu_session.sh)."""

from __future__ import annotations

import importlib.util
import json
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


def _record(tag, row, op, ms, bits="a", **times):
    return dict(tag=tag, row=row, op=op, kernels_ms=ms, bits=bits, **times)


def test_summary_means_rounds_and_compares_bits():
    records = [_record("base:1", "gem", "fwd", 4.0), _record("mine:1", "gem", "fwd", 3.0),
               _record("base:2", "gem", "fwd", 2.0), _record("mine:2", "gem", "fwd", 3.0),
               _record("base:1", "gem:causal", "fwd+bwd", 10.0, "a"),
               _record("mine:1", "gem:causal", "fwd+bwd", 8.0, "b"),
               _record("base:1", "long", "fwd", 1.0)]
    lines = ab_probe.summary(records)
    assert lines[1].split() == ["gem", "fwd", "3.000", "3.000", "1.000", "-", "-", "same"]
    assert lines[2].split() == ["gem:causal", "fwd+bwd", "10.000", "8.000", "0.800", "-", "-", "DIFFER"]
    assert lines[3].split() == ["long", "fwd", "(one", "side", "only)"]
    assert len(lines) == 4


def test_summary_puts_all_device_work_and_the_op_beside_the_kernels():
    """A change that moves work from a jfa kernel into torch's (a zero-fill, a copy) looks faster by the
    kernels' ms alone: the ratios of all the device's work and of the op's time show it."""
    records = [_record("base:1", "gem", "fwd+bwd", 10.0, device_ms=11.0, op_ms=12.0),
               _record("mine:1", "gem", "fwd+bwd", 9.0, device_ms=11.0, op_ms=13.2),
               _record("base:2", "gem", "fwd+bwd", 10.0, device_ms=11.0, op_ms=12.0),
               _record("mine:2", "gem", "fwd+bwd", 9.0, device_ms=12.1, op_ms=13.2),
               _record("base:1", "long", "fwd", 2.0, device_ms=2.0, op_ms=3.0),
               _record("mine:1", "long", "fwd", 1.0)]  # a record without them: no ratio
    lines = ab_probe.summary(records)
    assert lines[0].split()[7:9] == ["device", "op"]
    assert lines[1].split() == ["gem", "fwd+bwd", "10.000", "9.000", "0.900", "1.050", "1.100", "same"]
    assert lines[2].split() == ["long", "fwd", "2.000", "1.000", "0.500", "-", "-", "same"]


def test_pass_digests_hash_each_pass_and_leave_unordered_dq_out():
    """The forward's bits and the gradients' are separate; a dq summed in no fixed order does not take part
    (it differs between runs of one tree), while dk and dv still do."""
    import torch

    out = (torch.arange(6, dtype=torch.float32),)
    dq, dk, dv = (torch.full((2, 3), float(i)) for i in range(3))
    ordered = ab_probe.pass_digests(out, (dq, dk, dv), unordered_dq=False)
    unordered = ab_probe.pass_digests(out, (dq, dk, dv), unordered_dq=True)
    assert ordered["fwd"] == unordered["fwd"] != ordered["fwd+bwd"]
    other_dq = ab_probe.pass_digests(out, (dq + 1, dk, dv), unordered_dq=True)
    assert other_dq == unordered
    assert ab_probe.pass_digests(out, (dq + 1, dk, dv), unordered_dq=False) != ordered
    assert ab_probe.pass_digests(out, (dq, dk, dv + 1), unordered_dq=True) != unordered


def test_summary_names_what_the_bits_cover():
    records = [dict(_record("base:1", "gem:tlx", "fwd+bwd", 10.0), dq_compared=False),
               dict(_record("mine:1", "gem:tlx", "fwd+bwd", 9.0), dq_compared=False),
               _record("base:1", "gem", "fwd+bwd", 10.0), _record("mine:1", "gem", "fwd+bwd", 9.0)]
    lines = ab_probe.summary(records)
    assert lines[1].endswith("same (dk, dv; dq is added in no fixed order)")
    assert lines[2].endswith("same")


def test_summary_does_not_compare_digests_of_different_tensors():
    """A base whose backend adds dq in a fixed order against a tree whose backend waives it (or the reverse):
    the two sides digest different tensors, so their bits say nothing about each other."""
    records = [_record("base:1", "gem", "fwd+bwd", 10.0), dict(_record("mine:1", "gem", "fwd+bwd", 9.0),
                                                                 bits="other", dq_compared=False)]
    assert ab_probe.summary(records)[1].endswith("not comparable (dq in one side's digests only)")


def test_summary_compares_each_candidate_side_with_base():
    """Candidate trees measured beside base and mine are sides of their own: each is compared with base alone,
    and its table's header names it."""
    records = [_record("base:1", "gem", "fwd", 4.0), _record("mine:1", "gem", "fwd", 3.0),
               _record("vK4:1", "gem", "fwd", 2.0, bits="b"), _record("base:2", "gem", "fwd", 4.0),
               _record("mine:2", "gem", "fwd", 3.0), _record("vK4:2", "gem", "fwd", 1.0, bits="b")]
    assert ab_probe.sides(records) == ["mine", "vK4"]
    assert ab_probe.summary(records) == ab_probe.summary(records, "mine")
    assert ab_probe.summary(records)[1].split() == ["gem", "fwd", "4.000", "3.000", "0.750", "-", "-", "same"]
    lines = ab_probe.summary(records, "vK4")
    assert lines[0].split()[2:5] == ["base", "ms", "vK4"]
    assert lines[1].split() == ["gem", "fwd", "4.000", "1.500", "0.375", "-", "-", "DIFFER"]


def test_summary_of_one_kernel():
    """--kernel: only the named kernels' device ms (every kernel whose name contains it, summed per record)."""
    def rec(tag, short, other):
        return _record(tag, "broadcast:tlx", "fwd+bwd", short + other,
                       by_kernel={"short_ws_kernel": short, "_fwd_kernel": other, "all": short + other + 1})
    records = [rec("base:1", 2.0, 8.0), rec("mine:1", 1.0, 8.0)]
    assert ab_probe.summary(records)[1].split()[2:5] == ["10.000", "9.000", "0.900"]
    assert ab_probe.summary(records, kernel="short_ws")[1].split()[2:5] == ["2.000", "1.000", "0.500"]
    assert ab_probe.summary(records, kernel="dkv_ws")[1].split()[2:] == ["(one", "side", "only,", "or", "no",
                                                                          "dkv_ws", "kernel)"]


def test_main_prints_a_table_per_candidate(tmp_path, capsys):
    path = tmp_path / "ab.jsonl"
    records = [_record("base:1", "gem", "fwd", 4.0), _record("mine:1", "gem", "fwd", 3.0),
               _record("vA:1", "gem", "fwd", 2.0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert ab_probe.main(["summary", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "mine against base" and out[3] == "vA against base"
    assert out[2].split()[2:5] == ["4.000", "3.000", "0.750"] and out[5].split()[2:5] == ["4.000", "2.000", "0.500"]
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    assert ab_probe.main(["summary", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:2] == ["row", "pass"]  # one side: no name line
    assert ab_probe.main(["summary", str(path), "--kernels"]) == 2
