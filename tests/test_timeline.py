"""verify.timeline: per-worker time accounting from a run's records."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verify.timeline import per_worker, table


def record(worker, case, test, tensor, finished_at, duration_s, context_s, stats_s, **started):
    return dict(kind="result", backend="b", case=case, test=test, tensor=tensor, worker=worker,
                finished_at=finished_at, duration_s=duration_s, context_s=context_s, stats_s=stats_s, **started)


def test_per_worker_counts_each_test_once_and_sums_its_tensors_statistics():
    records = [
        {"kind": "environment"},
        # gw0: a forward with two tensors (statistics per tensor), then a cached-context backward
        record("gw0", "a:0", "forward", "out", 110.0, 4.0, 5.0, 0.5, worker_started_at=95.0),
        record("gw0", "a:0", "forward", "lse", 110.0, 4.0, 5.0, 0.5, worker_started_at=95.0),
        record("gw0", "a:0", "backward", "dq", 120.0, 6.0, 0.0, 1.0, worker_started_at=95.0),
        # gw1's records predate worker_started_at: no start-up is attributed to it
        record("gw1", "b:0", "invariants", "padding", 130.0, 20.0, 10.0, 0.0),
        dict(kind="result", backend="b", case="c:0", test="forward", tensor="out"),  # an untimed record
    ]
    workers = per_worker(records)
    assert set(workers) == {"gw0", "gw1"}
    gw0, gw1 = workers["gw0"], workers["gw1"]
    assert (gw0.tests, gw0.contexts, gw0.test_s, gw0.context_s, gw0.stats_s) == (2, 1, 10.0, 5.0, 2.0)
    assert gw0.busy_s == pytest.approx(17.0) and gw0.last_finish == 120.0
    assert (gw1.tests, gw1.contexts, gw1.busy_s) == (1, 1, 30.0)

    # The run starts at gw0's session start, 95; its first test starts at 110 - 4 - 5 - 1 = 100.
    assert gw0.startup_s == pytest.approx(5.0) and gw1.startup_s == 0.0
    rows = {line.split()[0]: line.split() for line in table(workers).splitlines()[2:4]}
    # 25 s span: 5 s start-up, 17 s busy (the first test, the forward, 9 s of it plus 1 s of statistics), 3 s other
    assert rows["gw0"][-4:] == ["5.0", "10.0", "3.0", "25.0"]
    assert rows["gw1"][-4:] == ["0.0", "30.0", "5.0", "35.0"]  # first test starts at 100, 5 s after the run
    assert "the last worker ends 10.0 s after the first" in table(workers)


def test_untimed_results_say_so():
    untimed = dict(kind="result", backend="b", case="a:0", test="forward", tensor="out", duration_s=1.0)
    assert "no timed records" in table(per_worker([untimed]))


def test_the_run_line_splits_launch_to_merge_into_start_up_tests_and_end():
    records = [record("gw0", "a:0", "forward", "out", 110.0, 4.0, 5.0, 1.0, worker_started_at=98.0,
                      worker_launched_at=93.0),
               record("gw1", "b:0", "forward", "out", 130.0, 10.0, 0.0, 0.0, worker_started_at=97.0,
                      worker_launched_at=92.5)]
    workers = per_worker(records)
    assert workers["gw0"].imports_s == pytest.approx(5.0) and workers["gw1"].imports_s == pytest.approx(4.5)
    assert "imports s" in table(workers) and "run:" not in table(workers)  # no header: no run line
    # Started at 92: the first test starts at 100 (110 - 4 - 5 - 1), the last ends at 130, merged at 133.
    run = table(workers, dict(kind="environment", started_at=92.0, merged_at=133.0)).splitlines()[-1]
    assert run == ("run: 41.0 s from its start to merged results = start-up 8.0 s (the workers' sessions began "
                   "5.0-6.0 s after the start) + tests 30.0 s + end 3.0 s")


def test_a_resumed_run_lists_the_stopped_runs_workers_apart(tmp_path, capsys):
    """A run stopped by a time limit (workers started at 10, last test at 300) and resumed (started at 400, merged
    at 460): the merged file holds both runs' records under the resuming run's header. Each run gets a table of
    its own, and the run line covers the resuming run alone (taken together, gw0's span ran from 10 to 450 and the
    start-up read 100 - 400 = -300 s)."""
    import argparse
    import json

    from verify import timeline

    records = [dict(kind="environment", started_at=400.0, merged_at=460.0),
               record("gw0", "a:0", "forward", "out", 100.0, 80.0, 10.0, 0.0, worker_started_at=10.0),
               record("gw1", "b:0", "forward", "out", 300.0, 250.0, 30.0, 0.0, worker_started_at=11.0),
               record("gw0", "c:0", "forward", "out", 450.0, 40.0, 5.0, 0.0, worker_started_at=403.0)]
    path = tmp_path / "resumed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert timeline.main(argparse.Namespace(results=[str(path)])) == 0
    stopped, resumed = capsys.readouterr().out.split("this run:")
    assert "the stopped run(s) this one resumed" in stopped and "run:" not in stopped
    assert [line.split()[:2] for line in stopped.splitlines()[3:5]] == [["gw0", "1"], ["gw1", "1"]]
    assert [line.split()[:2] for line in resumed.splitlines() if line.startswith("gw")] == [["gw0", "1"]]
    assert resumed.strip().splitlines()[-1] == (
        "run: 60.0 s from its start to merged results = start-up 5.0 s (the workers' sessions began 3.0-3.0 s "
        "after the start) + tests 45.0 s + end 10.0 s")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")
def test_process_started_at_is_when_the_process_started():
    before = time.time()
    started = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); from verify.timeline import "
                              "process_started_at; print(process_started_at())"], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    after = time.time()
    # To Linux's clock tick (10 ms), between the spawn and the end, and not when it was asked (0.5 s later).
    assert before - 0.02 <= float(started) <= after - 0.5 + 0.02


def test_the_timeline_command_imports_no_torch(tmp_path):
    """`python -m verify timeline` reads JSON: it must not pay torch's seconds of import (only gate and bisect
    import it, and only when chosen)."""
    import json

    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        record("gw0", "a:0", "forward", "out", 110.0, 4.0, 5.0, 0.5, worker_started_at=95.0)]) + "\n")
    code = ("import sys\nfrom verify.__main__ import main\nstatus = main(['timeline', sys.argv[1]])\n"
            "print(status, sorted(m for m in ('torch', 'triton', 'numpy', 'jfa') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert "gw0" in out.stdout and out.stdout.strip().splitlines()[-1] == "0 []", out.stdout + out.stderr


def test_the_commands_usage_error_statuses_match_their_modules():
    from verify import __main__ as cli
    from verify import bisect

    assert cli.COMMANDS["bisect"][1] == bisect.ABORT
    assert set(cli.NEEDS_TORCH) <= set(cli.COMMANDS)
