"""The benchmark's derived figures and table (its timing needs a GPU; these parts do not)."""

from __future__ import annotations

import math

from jfa import bench


def test_derived_figures_and_table(capsys):
    """Backward is the difference of the two timings; rates follow from them; the forward's device time
    reaches the table."""
    record = {"row": "gem", "backend": "triton", "fwd_flops": 4e12, "bwd_flops": 1e13, "fwd_ms": 2.0,
              "fwdbwd_ms": 7.0, "fwd_device_ms": 1.625, "fwd_extra_bytes": 2**20, "fwdbwd_extra_bytes": 3 * 2**20}
    bench.derive(record, fwd_bytes=4e9, bwd_bytes=1e10)
    assert record["bwd_ms"] == 5.0
    assert math.isclose(record["fwd_tflops"], 2000.0) and math.isclose(record["bwd_tflops"], 2000.0)
    assert math.isclose(record["fwd_gbps"], 2000.0) and math.isclose(record["bwd_gbps"], 2000.0)
    bench.print_table([record])
    line = capsys.readouterr().out.splitlines()[-1].split()
    assert line[:2] == ["gem", "triton"] and line[2] == "2.000" and line[5] == "5.000" and line[-1] == "1.625"
