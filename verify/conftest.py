"""The verify suite's pytest plugin: options, case × backend parametrisation, one GPU per xdist worker,
per-worker JSON-lines results merged into one file (or kept for --jfa-resume when a run stops before its
end), and the summary table at the end.

    pytest -n auto verify/ [--jfa-profile smoke|ci|premerge|nightly] [--jfa-backend NAME ...]
                           [--jfa-case ID ...] [--shard i/n] [--jfa-results PATH]
                           [--jfa-workers-per-gpu K] [--jfa-resume]
"""

from __future__ import annotations

import os
import sys
import time

# Asking NVML (not the CUDA runtime) whether a GPU exists leaves CUDA uninitialised, so a worker can still
# pin itself to one GPU through CUDA_VISIBLE_DEVICES in pytest_configure.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

# On a CPU, Triton kernels run under the interpreter, which is chosen when triton.jit decorates a function:
# set it before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from fixtures import case_from_id, profile_case_ids  # noqa: E402
from verify import devices, environment, results  # noqa: E402
from verify.checks import TESTS, backend_fn, check_case  # noqa: E402
from verify.runner import BackendCrash  # noqa: E402

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


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _gpus() -> list[str]:
    return devices.visible_devices(device_count=torch.cuda.device_count())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    return devices.auto_workers(len(_gpus()), config.getoption("jfa_workers_per_gpu"), os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    gpu = devices.assign_gpu(node.gateway.id, _gpus())
    if gpu is not None:
        node.workerinput["jfa_gpu"] = gpu


def pytest_configure(config):
    # Hypothesis's pytest plugin imports hypothesis in its terminal summary, at the end of every process that
    # has not (a second or more in each xdist worker and in the controller, after the last test); the suite
    # draws its cases without hypothesis.
    if "hypothesis" not in sys.modules and config.pluginmanager.has_plugin("hypothesispytest"):
        config.pluginmanager.unregister(name="hypothesispytest")
    if _is_worker(config):
        gpu = config.workerinput.get("jfa_gpu")
        if gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        # Each worker's CPU work (reference, model, interpreter) gets its share of the cores: torch's
        # default of one thread per core in every worker oversubscribes them (smoke: 131 s against 11.5 s).
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    elif getattr(config.option, "maxschedchunk", "absent") is None:
        # xdist's load scheduler otherwise hands each worker a first chunk of a quarter of its share, in
        # collection order: with the largest cases collected first, one worker got the dozen largest cases
        # and ended the run alone. A chunk of one case's tests deals the cases out one at a time.
        config.option.maxschedchunk = len(TESTS) * len(config.getoption("jfa_backend") or DEFAULT_BACKENDS)
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
    for spec in metafunc.config.getoption("jfa_backend") or DEFAULT_BACKENDS:
        _, unavailable = backend_fn(spec)
        reason = unavailable(session.device)
        if reason is None:
            available.append(spec)
        else:
            params.append(pytest.param((spec, None, None), id=f"{spec}|unavailable",
                                       marks=pytest.mark.skip(reason=f"{spec} unavailable: {reason}")))
    # Case-major order: xdist's load scheduling hands out consecutive tests together, so a case's tests
    # mostly meet its cached reference on one worker. (--dist loadgroup would guarantee it, but xdist
    # cannot replace a crashed worker under loadgroup: pytest-xdist#1189.) Largest cases first (longest
    # processing time first): a big case collected last would keep one worker busy while the others idle.
    for case_id in sorted(session.case_ids, key=lambda case_id: -case_from_id(case_id).work):
        for spec in available:
            for test in TESTS:
                if (spec, case_id, test) not in finished:
                    params.append(pytest.param((spec, case_id, test), id=f"{spec}|{case_id}|{test}"))
    metafunc.parametrize("jfa_combo", params)


class Session:
    """Per-process state: the device, the case list, this process's results file."""

    def __init__(self, config):
        self.config = config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.case_ids = _case_ids(config)
        self.results_path = Path(config.getoption("jfa_results"))
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.part = results.ResultsFile(self.results_path.with_name(self.results_path.name + f".{worker}.part"))
        self.resumed = results.resumed_of(self.results_path)
        self.crashed = False
        self.started_at = time.time()

    def check(self, backend: str, case_id: str, test: str) -> list[dict]:
        try:
            records = check_case(backend, case_id, test, self.device)
        except BackendCrash as crash:
            # The device is unusable in this process: record, fail this test, then leave (pytest_runtest_logfinish)
            # so xdist replaces the worker and the other cases go on.
            self.crashed = True
            self.part.write(dict(kind="result", backend=backend, case=case_id, family=case_from_id(case_id).family,
                                 test=test, tensor="*", status="crash", message=str(crash)))
            pytest.fail(f"{backend} crashed on {case_id} [{test}]: {crash}", pytrace=False)
        # Where and when, so that a run's timeline per worker can be rebuilt from its results (scaling).
        placed = dict(worker=os.environ.get("PYTEST_XDIST_WORKER", "main"), finished_at=time.time(),
                      worker_started_at=self.started_at)
        self.part.write(*(dict(record, **placed) for record in records))
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


def pytest_sessionstart(session):
    # Before xdist starts the workers (its hook runs last), so that every worker collects the same tests.
    if not _is_worker(session.config):
        path = session.config.jfa_session.results_path
        if session.config.getoption("jfa_resume"):
            results.resume(path)
        else:
            for stale in results.parts_of(path):
                stale.unlink()


def pytest_runtest_logreport(report):
    """On the controller: a worker that died (segfault, abort, timeout) fails its test; record it."""
    if _SESSION is None or _is_worker(_SESSION.config) or not report.failed:
        return
    if "crashed" not in str(report.longrepr) or "[" not in report.nodeid:
        return
    param = report.nodeid.split("[", 1)[1].rsplit("]", 1)[0]
    backend, *case_parts, test = param.split("|")
    case_id = "|".join(case_parts)
    _SESSION.part.write(dict(kind="result", backend=backend, case=case_id, family=case_from_id(case_id).family,
                             test=test, tensor="*", status="crash", message=str(report.longrepr)[-2000:]))


def pytest_terminal_summary(terminalreporter, config):
    if _is_worker(config):
        return
    session = config.jfa_session
    path = session.results_path
    parts = results.parts_of(path)
    if not parts:
        return
    header = dict(environment.collect(session.device.type), profile=config.getoption("jfa_profile"),
                  shard=config.getoption("shard"), backends=config.getoption("jfa_backend") or list(DEFAULT_BACKENDS))
    records = results.merge(parts, path, header)
    terminalreporter.section("jfa verify summary")
    terminalreporter.write_line(results.summary_table(records))
    terminalreporter.write_line(f"results: {path} ({len(records)} records)")
