"""verify.scheduling: xdist's load scheduling dealing whole cases, simulated with fake workers that finish
their tests in a random interleaving."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("xdist")
from xdist.scheduler import LoadScheduling  # noqa: E402

from verify.scheduling import CaseScheduling, case_of  # noqa: E402

TESTS = ("forward", "backward", "invariants")


def collection(cases: int, rng: random.Random) -> list[str]:
    """Node ids as verify/session.py parametrises them: an unavailable backend's placeholder, then case-major
    tests of two backends; some cases lack tests (a resumed run skips finished ones)."""
    ids = ["verify/test_numerics.py::test_case[tlx|unavailable]"]
    for index in range(cases):
        case = f"spec:q={index}.3,kv=3.{index},h=2/1,d=64,bf16,seed={index}" if index % 5 == 0 else f"uniform:{index}"
        tests = [(backend, test) for backend in ("triton", "bf16-model") for test in TESTS]
        kept = [t for t in tests if rng.random() > 0.2] or tests[:1]
        ids += [f"verify/test_numerics.py::test_case[{backend}|{case}|{test}]" for backend, test in kept]
    return ids


class FakeWorker:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False

    def send_runtest_some(self, indices):
        pass

    def shutdown(self):
        self.shutting_down = True


def simulate(scheduler_class, workers: int, ids: list[str], seed: int, crash_after: int | None = None):
    """Runs the scheduler to the end; returns {test index: worker that ran it} (a crashed worker's current
    test is lost, as in xdist, and its other pending tests are dealt again)."""
    rng = random.Random(seed)
    config = SimpleNamespace(option=SimpleNamespace(tx=[f"{workers}*popen"], maxschedchunk=1))
    config.getvalue = config.getoption = lambda name: getattr(config.option, name)
    scheduler = scheduler_class(config)
    nodes = [FakeWorker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, ids)
    scheduler.schedule()
    ran: dict[int, str] = {}
    # Until every worker has finished its last test (xdist's tests_finished is true one test earlier: it
    # shuts workers down while their last test runs).
    while busy := [node for node, pending in scheduler.node2pending.items() if pending]:
        node = rng.choice(busy)
        index = scheduler.node2pending[node][0]
        if crash_after is not None and len(ran) == crash_after:
            scheduler.remove_node(node)
            crash_after = None
            continue
        ran[index] = node.gateway.id
        scheduler.mark_test_complete(node, index, duration=rng.choice([0.01, 0.5]))
    return ran


def split_cases(ids: list[str], ran: dict[int, str]) -> list[str]:
    workers_of: dict[str, set[str]] = {}
    for index, worker in ran.items():
        workers_of.setdefault(case_of(ids[index]), set()).add(worker)
    return [case for case, workers in workers_of.items() if len(workers) > 1]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("workers", [2, 4, 8])
def test_every_case_runs_on_one_worker_and_every_test_once(workers, seed):
    ids = collection(60, random.Random(seed))
    ran = simulate(CaseScheduling, workers, ids, seed)
    assert sorted(ran) == list(range(len(ids)))
    assert split_cases(ids, ran) == []
    assert len(set(ran.values())) == workers  # and every worker got work


def test_xdist_load_scheduling_alone_splits_cases():
    """What CaseScheduling prevents (so the test above can fail): the same runs under LoadScheduling."""
    splits = 0
    for seed in range(6):
        ids = collection(60, random.Random(seed))
        splits += len(split_cases(ids, simulate(LoadScheduling, 8, ids, seed)))
    assert splits > 0


def test_a_crashed_workers_tests_are_dealt_again():
    ids = collection(40, random.Random(7))
    ran = simulate(CaseScheduling, 4, ids, seed=7, crash_after=30)
    assert len(ran) == len(ids) - 1  # all but the test the worker died in


def test_case_of_reads_the_node_id():
    assert case_of("verify/test_numerics.py::test_case[triton|spec:q=1,kv=1,seed=3|backward]") == \
        "spec:q=1,kv=1,seed=3"
    assert case_of("verify/test_numerics.py::test_case[tlx|unavailable]") == \
        "verify/test_numerics.py::test_case[tlx|unavailable]"
