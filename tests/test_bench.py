"""The benchmark's derived figures and table (its timing needs a GPU; these parts do not)."""

from __future__ import annotations

import json
import math

import pytest

from jfa import bench


def test_derived_figures_and_table(capsys):
    """Rates follow from each pass's own timing (the backward's is not the difference of the other two: 4 ms here,
    where fwd+bwd − fwd is 5); the three timings' device and idle times and SM clocks (one not read) reach the
    table."""
    record = {"row": "gem", "backend": "triton", "fwd_flops": 4e12, "bwd_flops": 8e12, "fwd_ms": 2.0, "bwd_ms": 4.0,
              "fwdbwd_ms": 7.0, "fwd_device_ms": 1.625, "fwd_idle_ms": 0.25, "bwd_device_ms": 3.875,
              "bwd_idle_ms": 0.0625, "fwdbwd_device_ms": 6.5, "fwdbwd_idle_ms": 0.375, "fwd_extra_bytes": 2**20,
              "bwd_extra_bytes": 2**21, "fwdbwd_extra_bytes": 3 * 2**20, "fwd_sm_mhz": 1851.4, "bwd_sm_mhz": 1790.2,
              "fwdbwd_sm_mhz": None}
    bench.derive(record, fwd_bytes=4e9, bwd_bytes=1e10, copy_gbps=4000.0)
    assert record["bwd_ms"] == 4.0
    assert math.isclose(record["fwd_tflops"], 2000.0) and math.isclose(record["bwd_tflops"], 2000.0)
    assert math.isclose(record["fwd_gbps"], 2000.0) and math.isclose(record["bwd_gbps"], 2500.0)
    # At 4000 GB/s the 4 GB forward traffic takes 1 ms and the 10 GB backward traffic 2.5 ms.
    assert math.isclose(record["fwd_floor_ms"], 1.0) and math.isclose(record["bwd_floor_ms"], 2.5)
    assert math.isclose(record["fwd_copy_share"], 0.5) and math.isclose(record["bwd_copy_share"], 0.625)
    bench.print_table([record])
    line = capsys.readouterr().out.splitlines()[-1].split()
    assert line[:2] == ["gem", "triton"] and line[2] == "2.000" and line[5] == "4.000"
    assert line[-3:] == ["1.625/3.875/6.500", "0.250/0.062/0.375", "1851/1790/-"] and line[-5] == "50/62"


def test_idle_time_is_the_uncovered_part_of_the_span():
    """Copies overlapping kernels cover the timeline once; only the gaps between them count."""
    assert bench.idle_time([]) == 0.0
    assert bench.idle_time([(0, 10)]) == 0.0
    # kernel 0-10, copy 5-12 beside it, gap 12-20, kernel 20-30, a copy inside it, gap 30-31, kernel 31-40
    assert bench.idle_time([(31, 40), (20, 30), (0, 10), (5, 12), (22, 25)]) == 8 + 1


def test_rooflines_name_the_best_ratio_a_kernel_could_reach(capsys):
    """FA2 at 3 ms on a row whose traffic takes 0.5 ms at the copy rate: no kernel beats 6x there."""
    record = {"row": "tiny", "backend": "triton", "fwd_floor_ms": 0.5, "bwd_floor_ms": 1.25,
              "fwd_roofline_vs_varlen": 3.0 / 0.5, "bwd_roofline_vs_varlen": 11.0 / 1.25}
    bench.print_rooflines([record, dict(record, backend="torch-varlen")], copy_gbps=4300.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("memory roofline at the device copy rate, 4300 GB/s") and len(out) == 2
    assert "fwd >= 0.500 ms (at most 6.00x FA2), bwd >= 1.250 ms (at most 8.80x FA2)" in out[1]


def test_sm_clock_without_nvml_is_none(monkeypatch):
    """No clock to read (torch.cuda.clock_rate raises without pynvml): the block runs, the clock is None."""
    import torch

    def no_nvml(device=None):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    with bench.SmClock() as clock:
        pass
    assert clock.mhz is None


def test_sm_clock_is_the_mean_of_the_samples(monkeypatch):
    """Clocks read while the block runs are averaged (a clock alternating 1500 and 1700 MHz)."""
    import itertools
    import time

    import torch

    readings = itertools.cycle([1500, 1700])
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: next(readings))
    with bench.SmClock() as clock:
        time.sleep(0.1)
    assert clock.mhz is not None and 1500 <= clock.mhz <= 1700 and len(clock._samples) >= 2


def test_steady_calls_leave_out_the_first_recorded_call():
    """Three recorded calls of two events each: the first call's two go; an uneven count keeps everything."""
    spans = [(0, 1), (5, 9), (10, 11), (12, 16), (17, 18), (19, 23)]
    assert bench.steady_calls(spans[::-1], calls=2) == (spans[2:], 2)
    assert bench.steady_calls(spans[:5], calls=2) == (spans[:5], 3)
    assert bench.steady_calls([], calls=2) == ([], 3)


def _run(triton_version: str, date: str, records: list[dict]) -> dict:
    return {"environment": {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": triton_version, "date": date},
            "copy_gbps": 4250.0, "results": records}


def _timed(row: str, backend: str, fwd_ms: float, **extra) -> dict:
    """A timed record: the backward twice the forward's time, the forward+backward three times, unless `extra`
    says otherwise."""
    record = {"row": row, "backend": backend, "fwd_flops": 4e12, "bwd_flops": 1e13, "fwd_ms": fwd_ms,
              "bwd_ms": 2 * fwd_ms, "fwdbwd_ms": 3 * fwd_ms, "fwd_device_ms": fwd_ms - 0.1, "fwd_idle_ms": 0.05,
              "bwd_device_ms": 2 * fwd_ms - 0.1, "bwd_idle_ms": 0.075, "fwdbwd_device_ms": 3 * fwd_ms - 0.2,
              "fwdbwd_idle_ms": 0.125, "fwd_extra_bytes": 0, "bwd_extra_bytes": 0, "fwdbwd_extra_bytes": 0,
              "fwd_sm_mhz": 1805.4, "bwd_sm_mhz": 1790.0, "fwdbwd_sm_mhz": None, **extra}
    bench.derive(record, fwd_bytes=4e9, bwd_bytes=1e10, copy_gbps=4250.0)
    return record


def _without_backward_timing(record: dict) -> dict:
    """Record with no backward-alone timing: neither its time, device and idle times, clock and memory, nor the
    figures derived from its time (as `jfa.bench` writes a backward that cannot run twice over one graph)."""
    untimed = {key: value for key, value in record.items()
               if key not in ("bwd_ms", "bwd_device_ms", "bwd_idle_ms", "bwd_sm_mhz", "bwd_extra_bytes",
                              "bwd_tflops", "bwd_gbps", "bwd_copy_share")}
    bench.derive(untimed, fwd_bytes=4e9, bwd_bytes=1e10, copy_gbps=4250.0)
    return untimed


def _before_backward_timing(record: dict) -> dict:
    """Record as a run before 2026-12-05 wrote it: the backward the difference of the other two timings, with
    no device time, idle time or clock of its own."""
    old = _without_backward_timing(record)
    old["bwd_ms"] = record["fwdbwd_ms"] - record["fwd_ms"]
    bench.derive(old, fwd_bytes=4e9, bwd_bytes=1e10, copy_gbps=4250.0)
    return old


def test_each_ratio_is_of_its_own_timing(capsys):
    """Against the run's torch-varlen: the backward's ratio is of the backward's own timing, so a forward timed
    slower leaves it as it is (as it leaves the forward+backward's); both tables show it."""
    peer = _timed("broadcast", "torch-varlen", 0.8, bwd_ms=3.0, fwdbwd_ms=4.0)
    timed = _timed("broadcast", "tlx", 0.5, bwd_ms=1.5, fwdbwd_ms=2.0)
    slow_forward = _timed("broadcast", "tlx", 0.6, bwd_ms=1.5, fwdbwd_ms=2.0)
    bench.compare_with_peer([peer, timed, slow_forward])
    assert timed["bwd_vs_varlen"] == slow_forward["bwd_vs_varlen"] == 2.0 and peer["bwd_vs_varlen"] == 1.0
    assert timed["fwdbwd_vs_varlen"] == slow_forward["fwdbwd_vs_varlen"] == 2.0 and peer["fwdbwd_vs_varlen"] == 1.0
    assert math.isclose(timed["fwd_vs_varlen"], 1.6) and math.isclose(slow_forward["fwd_vs_varlen"], 0.8 / 0.6)
    # A run's markdown computes the ratios row by row, each against its own row's torch-varlen (a run written
    # before the forward+backward ratio existed gets it too).
    tiny_peer, tiny = _timed("tiny", "torch-varlen", 0.3, fwdbwd_ms=3.0), _timed("tiny", "tlx", 0.25, fwdbwd_ms=1.0)
    header, _, tiny_peer_line, tiny_line, peer_line, timed_line, _ = bench.markdown_table([_run(
        "3.7.4+fb", "2026-12-04", [peer, timed, slow_forward, tiny_peer, tiny])]).splitlines()[:7]
    assert header.split(" | ")[7:9] == ["bwd ×FA2", "fwd+bwd ×FA2"]
    assert timed_line.split(" | ")[7:9] == ["2.00", "2.00"] and peer_line.split(" | ")[7:9] == ["1.00", "1.00"]
    assert tiny_line.split(" | ")[7:9] == ["1.20", "3.00"] and tiny_peer_line.split(" | ")[8] == "1.00"
    bench.print_table([timed])
    header, _, line = capsys.readouterr().out.splitlines()
    assert "f+b xFA2" in header and line.split()[7:9] == ["2.00", "2.00"]


def test_a_backward_not_timed_alone_shows_as_missing(capsys):
    """A backend whose backward cannot run twice over one graph (flex's compiled backward with donated buffers)
    has no backward-alone figures: '-' in both tables, no backward ratio; its forward and forward+backward keep
    theirs, and the row's rooflines still come from torch-varlen."""
    peer = _timed("tiny", "torch-varlen", 0.8, bwd_ms=3.0, fwdbwd_ms=4.0)
    untimed = {**_without_backward_timing(_timed("tiny", "flex", 2.0, fwdbwd_ms=8.0)),
               "bwd_untimed": "RuntimeError: donated buffers"}
    assert "bwd_tflops" not in untimed and "fwd_tflops" in untimed
    bench.compare_with_peer([peer, untimed])
    assert "bwd_vs_varlen" not in untimed and untimed["fwd_vs_varlen"] == 0.4 and untimed["fwdbwd_vs_varlen"] == 0.5
    assert math.isclose(untimed["bwd_roofline_vs_varlen"], 3.0 / untimed["bwd_floor_ms"])
    bench.print_table([untimed])
    line = capsys.readouterr().out.splitlines()[-1].split()
    assert line[5:10] == ["-", "-", "-", "0.50", "2000"] and line[10:12] == ["-", "47/-"]
    assert line[-3:] == ["1.900/-/5.800", "0.050/-/0.125", "1805/-/-"]
    cells = bench.markdown_table([_run("3.7.4+fb", "2026-12-05", [peer, untimed])]).splitlines()[3].split(" | ")
    assert cells[5:9] == ["-", "-", "-", "0.50"] and cells[-3:] == ["1.900 / - / 5.800", "0.050 / - / 0.125",
                                                                    "1805 / - / - |"]


class _Refusing:
    """A pass that raises at its `refuse_at`-th call (1-based; None never), counting its calls."""

    def __init__(self, refuse_at):
        self.refuse_at, self.calls = refuse_at, 0

    def __call__(self):
        self.calls += 1
        if self.calls == self.refuse_at:
            raise RuntimeError("This backward function was compiled with non-empty donated buffers")


@pytest.mark.parametrize("refuse_at", [1, 2])
def test_a_backward_refusing_a_retained_graph_is_reported_not_raised(refuse_at):
    """flex's compiled backward refused retain_graph=True at its first call on the H100 (2026-12-05), which the
    first version of this check, catching only the second call, let through to lose flex's whole record."""
    fn = _Refusing(refuse_at)
    assert bench.warm_up(fn, may_refuse=True) == ("RuntimeError: This backward function was compiled with "
                                                   "non-empty donated buffers")
    assert fn.calls == refuse_at
    with pytest.raises(RuntimeError, match="donated buffers"):
        bench.warm_up(_Refusing(refuse_at), may_refuse=False)


def test_a_pass_that_runs_twice_is_warmed_up_twice():
    fn = _Refusing(None)
    assert bench.warm_up(fn, may_refuse=True) is None and fn.calls == 2


def test_markdown_table_joins_runs_row_by_row():
    """Each row's records run by run, marked with their run's footnote; triton under fbtriton named so; GB/s only
    on memory-bound rows; a skipped backend says why; the footnotes name each run and how it timed the backward
    (a run from before the backward's own timing shows '-' for the backward's device and idle times and clock)."""
    fb = _run("3.7.4+fb", "2026-12-04T00:08", [_timed("tiny", "triton", 2.0, fwd_vs_varlen=1.5),
                                                _timed("gem", "tlx", 1.0, fwd_vs_varlen=1.52, bwd_vs_varlen=1.5)])
    stock = _run("3.6.0", "2026-12-04T00:05", [_before_backward_timing(_timed("gem", "triton", 2.0)),
                                                {"row": "gem", "backend": "flex", "skipped": "not installed"}])
    lines = bench.markdown_table([fb, stock]).splitlines()
    body = [line for line in lines if line.startswith("| ") and not line.startswith(("| row", "| ---"))]
    assert [line.split(" | ")[:2] for line in body] == [
        ["| gem", "tlx ¹"], ["| ", "triton ²"], ["| ", "flex ²"], ["| tiny", "triton under fbtriton ¹"]]
    gem_tlx = body[0].split(" | ")
    assert gem_tlx[2:5] == ["1.000", "4000.0", "1.52"]
    assert gem_tlx[-3:] == ["0.900 / 1.900 / 2.800", "0.050 / 0.075 / 0.125", "1805 / 1790 / - |"]
    gem_triton = body[1].split(" | ")
    assert gem_triton[4] == "-"  # no torch-varlen in its run: no ratio
    assert gem_triton[5] == "4.000" and gem_triton[-3:] == ["1.900 / - / 5.800", "0.050 / - / 0.125", "1805 / - / - |"]
    assert "not installed" in body[2]
    assert {line.count("|") for line in body} == {lines[0].count("|")}  # every line has the header's cells
    assert body[3].split(" | ")[3] == "2000.0 (2000 GB/s)" and "GB/s" not in body[0]
    assert lines[-2].startswith("¹ NVIDIA H200") and "3.7.4+fb" in lines[-2] and "4,250 GB/s" in lines[-2]
    assert lines[-1].startswith("² ") and "3.6.0" in lines[-1]
    assert lines[-2].endswith("the backward timed alone.") and lines[-1].endswith("the backward (fwd+bwd) − fwd.")


def test_a_failed_backend_takes_one_markdown_line():
    """A backend that raised keeps its row of the table: the error's first line, its '|' escaped and its length
    capped (a compiler's error runs over many lines, and a newline ends a markdown row)."""
    error = ("RuntimeError: This backward function was compiled with non-empty donated buffers | which "
             + "x" * 300 + "\nTraceback line 2\nline 3")
    run = _run("3.6.0", "2026-12-05", [_timed("gem", "triton", 2.0), {"row": "gem", "backend": "flex", "error": error}])
    lines = bench.markdown_table([run]).splitlines()
    failed = [line for line in lines if line.startswith("|  | flex |")]
    assert len(failed) == 1 and "Traceback" not in bench.markdown_table([run])
    assert failed[0].count("|") - failed[0].count("\\|") == lines[0].count("|")
    cell = failed[0].split(" | ")[2]
    assert cell.startswith("RuntimeError: This backward") and "buffers \\| which" in cell
    assert len(cell) == 161 and cell.endswith("…")  # 160 characters and the escape's backslash


def test_markdown_of_one_run_has_no_marks(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run("3.6.0", "2026-12-04", [_timed("long", "triton", 2.0)])))
    assert bench.main(["--markdown", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| long | triton | 2.000 |") and out[-1].startswith("NVIDIA H200")
