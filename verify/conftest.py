"""The verify suite's pytest plugin: options, one GPU per xdist worker, whole cases dealt to workers, the
per-process JSON-lines results merged into one file (or kept for --jfa-resume when a run stops before its
end), and the summary table at the end. What runs the tests is verify/session.py, registered here in the
processes that run them: the xdist controller imports neither torch nor the kernels, so it starts the
workers at once and exits at once.

    pytest -n auto verify/ [--jfa-profile smoke|ci|premerge|nightly] [--jfa-backend NAME ...]
                           [--jfa-case ID ...] [--shard i/n] [--jfa-results PATH]
                           [--jfa-workers-per-gpu K] [--jfa-resume]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# When pytest loaded the suite: the run's clock starts here (the process's own start, in /proc, predates an
# exec, so a shell that execs pytest as its last command would move it back to the shell's start).
LOADED_AT = time.time()

# Asking NVML (not the CUDA runtime) whether a GPU exists leaves CUDA uninitialised, so a worker can still
# pin itself to one GPU through CUDA_VISIBLE_DEVICES in pytest_configure.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# Expandable segments: a freed block of one size stays usable for a request of another (segments grow and shrink
# in pages), where the default allocator can refuse a large request with more than it asks reserved in blocks too
# small: offset_overflow:201's tlx invariants were refused 8.3 GiB on an H100 with 11.9 GiB reserved but unused
# (2026-12-07). A setting of the user's is kept.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import pytest  # noqa: E402

from verify import devices, results  # noqa: E402

DEFAULT_BACKENDS = ("tlx", "triton", "bf16-model", "torch-varlen", "flex")
PROFILES = ("smoke", "ci", "premerge", "nightly")


def pytest_addoption(parser):
    group = parser.getgroup("jfa", "jfa verify suite")
    group.addoption("--jfa-profile", default="smoke", choices=PROFILES, help="case list size (default smoke)")
    group.addoption("--jfa-backend", action="append", default=[], metavar="NAME",
                    help="backend to verify: a registered name or package.module:function (repeatable; "
                         f"default: all of {', '.join(DEFAULT_BACKENDS)}, unavailable ones skipped)")
    group.addoption("--jfa-case", action="append", default=[], metavar="ID",
                    help="run this case id instead of the profile (repeatable)")
    group.addoption("--shard", default="0/1", metavar="i/n", help="run shard i of n of the case list")
    group.addoption("--jfa-results", default="jfa-results/results.jsonl", metavar="PATH",
                    help="merged JSON-lines results (default jfa-results/results.jsonl)")
    group.addoption("--jfa-resume", action="store_true",
                    help="continue a run that stopped before its end (a time limit, a lost machine) with the same "
                         "arguments: keep the worker files beside --jfa-results and run only the tests without "
                         "records in them; the merged results hold both runs'")
    group.addoption("--jfa-workers-per-gpu", type=int, default=4, metavar="K",
                    help="with -n auto on a GPU host: K xdist workers per GPU (default 4)")
    group.addoption("--jfa-worker-cpus", default="share", choices=("share", "all"),
                    help="share (default): each xdist worker runs on its own slice of the usable CPUs; all: every "
                         "worker may run on any of them (each with its share of threads either way)")


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _is_controller(config) -> bool:
    """Whether this process is xdist's controller, which hands tests to workers and runs none (the
    condition under which xdist starts its distributed session)."""
    return (not _is_worker(config) and not config.getoption("collectonly")
            and getattr(config.option, "dist", "no") != "no" and bool(getattr(config.option, "tx", None)))


def _gpus() -> list[str]:
    return devices.visible_devices(device_count=devices.nvml_gpu_count())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    return devices.auto_workers(len(_gpus()), config.getoption("jfa_workers_per_gpu"), devices.usable_cpus())


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    gpu = devices.assign_gpu(node.gateway.id, _gpus())
    if gpu is not None:
        node.workerinput["jfa_gpu"] = gpu


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from verify.scheduling import CaseScheduling

    return CaseScheduling(config, log)


_CONTROLLER_PART: results.ResultsFile | None = None


def pytest_configure(config):
    # Hypothesis's pytest plugin imports hypothesis in its terminal summary, at the end of every process that
    # has not (a second or more in each xdist worker and in the controller, after the last test); the suite
    # draws its cases without hypothesis.
    if "hypothesis" not in sys.modules and config.pluginmanager.has_plugin("hypothesispytest"):
        config.pluginmanager.unregister(name="hypothesispytest")
    if not config.getoption("jfa_backend"):
        config.option.jfa_backend = list(DEFAULT_BACKENDS)
    if _is_worker(config):
        gpu = config.workerinput.get("jfa_gpu")
        if gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    else:
        # Before the workers start (xdist starts them at session start), so that every worker collects the
        # same tests: gather a stopped run's files to resume it, or remove a stopped run's stale files.
        path = Path(config.getoption("jfa_results"))
        if config.getoption("jfa_resume"):
            results.resume(path)
        else:
            for stale in results.parts_of(path):
                stale.unlink()
    global _CONTROLLER_PART
    _CONTROLLER_PART = None
    if _is_controller(config):
        _CONTROLLER_PART = results.ResultsFile(results.part_path(Path(config.getoption("jfa_results")), "main"))
        if config.option.maxschedchunk is None:
            # One case per batch (verify.scheduling): a case's tests go to one worker, and the cases are dealt
            # one at a time in collection order, largest first, so no worker is left with the largest ones.
            config.option.maxschedchunk = 1
    else:
        config.pluginmanager.import_plugin("verify.session")


def pytest_runtest_logreport(report):
    """On the controller: a worker that died (segfault, abort, timeout) fails its test; record it."""
    if _CONTROLLER_PART is None or not report.failed or "crashed" not in str(report.longrepr):
        return
    combo = results.combo_of(report.nodeid)
    if combo is None:
        return
    backend, case_id, test = combo
    _CONTROLLER_PART.write(dict(kind="result", backend=backend, case=case_id, family=results.family_of(case_id),
                                test=test, tensor="*", status="crash", message=str(report.longrepr)[-2000:]))


def pytest_terminal_summary(terminalreporter, config):
    if _is_worker(config):
        return
    path = Path(config.getoption("jfa_results"))
    parts = results.parts_of(path)
    if not parts:
        return
    run = dict(profile=config.getoption("jfa_profile"), shard=config.getoption("shard"),
               backends=config.getoption("jfa_backend"), started_at=LOADED_AT, merged_at=time.time())
    records = results.merge(parts, path, run)
    terminalreporter.section("jfa verify summary")
    terminalreporter.write_line(results.summary_table(records))
    for line in results.paths_summary(records) + results.sampled_summary(records):
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"results: {path} ({len(records)} records)")
    if sys.dont_write_bytecode:
        # Seen on the lent H200 machine: every worker's imports of torch, sympy (through torch.autograd.grad)
        # and scipy took 8.7 s instead of 2.4 s, a fixed cost of every run however many GPUs share the work.
        terminalreporter.write_line("note: Python writes no bytecode cache here (PYTHONDONTWRITEBYTECODE or -B), so "
                                    "every test process compiles torch, sympy and scipy from source (seconds each); "
                                    "unset it and set PYTHONPYCACHEPREFIX to a writable folder for faster starts")
