"""The verify suite's pytest plugin in a process that runs tests (an xdist worker, or pytest without
workers), registered by verify/conftest.py: the case × backend parametrisation, the process's Session
(device, case list, its results file) and the exit after a device fault. Apart from the conftest because it
imports torch, Triton and the kernels, which take seconds and which the xdist controller never needs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from verify import devices

devices.choose_kernel_runtime()  # the conftest has pinned this process's GPU already

import pytest  # noqa: E402
import torch  # noqa: E402

from fixtures import case_from_id, profile_case_ids  # noqa: E402
from verify import environment, results, timeline  # noqa: E402
from verify.checks import TESTS, backend_fn, check_case  # noqa: E402
from verify.runner import BackendCrash  # noqa: E402

PROCESS = os.environ.get("PYTEST_XDIST_WORKER", "main")
# An xdist worker's process start (xdist spawns it directly; pytest started from a shell may have been exec'd
# by it, so the main process's start is not taken).
LAUNCHED_AT = timeline.process_started_at() if PROCESS != "main" else None


def pytest_configure(config):
    # Each worker's CPU work (reference, model, interpreter) gets its share of the cores, or OMP_NUM_THREADS
    # when the caller set it: torch's default of one thread per core in every worker oversubscribes them
    # (smoke: 131 s against 11.5 s). Set before torch starts its threads, which inherit the affinity.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = devices.worker_cpus(PROCESS, workers, config.getoption("jfa_worker_cpus"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or threads))
    global _SESSION
    config.jfa_session = _SESSION = Session(config)


def _case_ids(config) -> list[str]:
    ids = config.getoption("jfa_case") or profile_case_ids(config.getoption("jfa_profile"))
    index, count = devices.parse_shard(config.getoption("shard"))
    return devices.shard(ids, index, count)


def pytest_generate_tests(metafunc):
    if "jfa_combo" not in metafunc.fixturenames:
        return
    session = metafunc.config.jfa_session
    finished = results.finished_tests(session.resumed) if metafunc.config.getoption("jfa_resume") else set()
    available, params = [], []
    for spec in metafunc.config.getoption("jfa_backend"):
        _, unavailable = backend_fn(spec)
        reason = unavailable(session.device)
        if reason is None:
            available.append(spec)
        else:
            params.append(pytest.param((spec, None, None), id=f"{spec}|unavailable",
                                       marks=pytest.mark.skip(reason=f"{spec} unavailable: {reason}")))
    # Case-major order: xdist deals out whole cases (verify.scheduling), so a case's tests meet its cached
    # reference on one worker. Largest cases first (longest processing time first): a big case collected last
    # would keep one worker busy while the others idle.
    for case_id in sorted(session.case_ids, key=lambda case_id: -case_from_id(case_id).work):
        for spec in available:
            for test in TESTS:
                if (spec, case_id, test) not in finished:
                    params.append(pytest.param((spec, case_id, test), id=f"{spec}|{case_id}|{test}"))
    metafunc.parametrize("jfa_combo", params)


class Session:
    """Per-process state: the device, the case list, this process's results file."""

    def __init__(self, config):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.case_ids = _case_ids(config)
        results_path = Path(config.getoption("jfa_results"))
        self.part = results.ResultsFile(results.part_path(results_path, PROCESS))
        self.resumed = results.resumed_of(results_path)
        self.crashed = False
        self.started_at = time.time()
        self.environment_written = False

    def write(self, *records: dict) -> None:
        """Appends records to this process's file, the first time after what produced them: the environment,
        which the merge puts at the head of the results (the controller, without torch, cannot collect it)."""
        if not self.environment_written:
            records = (dict(kind="environment", **environment.collect(self.device.type)), *records)
            self.environment_written = True
        self.part.write(*records)

    def check(self, backend: str, case_id: str, test: str) -> list[dict]:
        try:
            records = check_case(backend, case_id, test, self.device)
        except BackendCrash as crash:
            # The device is unusable in this process: record, fail this test, then leave (pytest_runtest_logfinish)
            # so xdist replaces the worker and the other cases go on.
            self.crashed = True
            self.write(crash.record)
            pytest.fail(f"{backend} crashed on {case_id} [{test}]: {crash}", pytrace=False)
        # Where and when, so that a run's timeline per worker can be rebuilt from its results (scaling).
        placed = dict(worker=PROCESS, finished_at=time.time(), worker_launched_at=LAUNCHED_AT,
                      worker_started_at=self.started_at)
        self.write(*(dict(record, **placed) for record in records))
        return records


@pytest.fixture(scope="session")
def jfa_session(pytestconfig):
    return pytestconfig.jfa_session


@pytest.fixture
def jfa_combo(request):
    return request.param


_SESSION: Session | None = None


def pytest_runtest_logfinish(nodeid, location):
    if _SESSION is not None and _SESSION.crashed:
        os._exit(3)
