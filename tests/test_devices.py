"""GPU pinning of xdist workers and CI sharding, with simulated device lists."""

import json
import os
import subprocess
import sys

import pytest

from verify import devices


def test_visible_devices_from_environment_or_count():
    assert devices.visible_devices({"CUDA_VISIBLE_DEVICES": "2,5"}, device_count=8) == ["2", "5"]
    assert devices.visible_devices({}, device_count=3) == ["0", "1", "2"]
    assert devices.visible_devices({"CUDA_VISIBLE_DEVICES": ""}, device_count=4) == []
    assert devices.visible_devices({}, device_count=0) == []


@pytest.mark.parametrize("gpus,workers", [(["0"], 4), (["0", "1"], 4), (["3", "1", "7", "0"], 8), (["0", "1"], 3)])
def test_round_robin_assignment_spreads_workers(gpus, workers):
    assigned = [devices.assign_gpu(f"gw{i}", gpus) for i in range(workers)]
    counts = {gpu: assigned.count(gpu) for gpu in gpus}
    assert set(assigned) <= set(gpus)
    assert max(counts.values()) - min(counts.values()) <= 1  # balanced
    assert assigned[: len(gpus)] == gpus[: workers]  # the first workers take distinct GPUs


def test_no_gpu_means_no_pinning_and_bad_ids_raise():
    assert devices.assign_gpu("gw3", []) is None
    with pytest.raises(ValueError):
        devices.worker_index("main")


def test_auto_workers():
    assert devices.auto_workers(0, 4, 2) == 2
    assert devices.auto_workers(1, 4, 16) == 4
    assert devices.auto_workers(8, 4, 16) == 16  # at most one per CPU
    assert devices.auto_workers(2, 3, 64) == 6


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_usable_cpus_follow_the_affinity_not_the_host():
    """A process confined to one CPU (taskset, a cpuset) sizes its share from that one, not from the host."""
    confined = "import os; from verify import devices; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " \
               "print(devices.usable_cpus(), os.cpu_count())"
    usable, host = map(int, subprocess.check_output([sys.executable, "-c", confined], text=True).split())
    assert usable == 1 and host == os.cpu_count()
    assert devices.usable_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("cpus,count", [(list(range(16)), 4), (list(range(32)), 8), ([0, 1, 4, 5, 6], 2),
                                        (list(range(8, 24)), 3), (list(range(2)), 1)])
def test_cpu_shares_partition_the_cpus_into_contiguous_near_equal_slices(cpus, count):
    shares = [devices.cpu_share(cpus, i, count) for i in range(count)]
    assert sum(shares, []) == cpus  # disjoint, complete, in order: each slice contiguous in the list
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_more_workers_than_cpus_take_one_cpu_each_round_robin():
    assert [devices.cpu_share([3, 9], i, 5) for i in range(5)] == [[3], [9], [3], [9], [3]]


def test_a_replacement_worker_past_the_count_gets_a_slice_not_nothing():
    """xdist replaces a crashed worker under a new id (gw4 of 4 workers); an empty CPU set would fail
    sched_setaffinity and lose the rest of the crashed worker's tests."""
    cpus = list(range(16))
    assert devices.cpu_share(cpus, 4, 4) == devices.cpu_share(cpus, 0, 4) == [0, 1, 2, 3]
    assert devices.cpu_share(cpus, 7, 4) == [12, 13, 14, 15]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
@pytest.mark.parametrize("mode", ["share", "all"])
def test_worker_cpus_pins_a_worker_to_its_share_or_leaves_it(mode):
    """In a fresh process of its own (the affinity is the process's): the second of two workers on the usable
    CPUs takes the second slice under "share" and threads as many as its CPUs; under "all" it keeps every CPU
    and half of them as threads (at least one)."""
    probe = f"import json, os; from verify import devices; n = devices.worker_cpus('gw1', 2, {mode!r}); " \
            "print(json.dumps([n, sorted(os.sched_getaffinity(0))]))"
    threads, pinned = json.loads(subprocess.check_output([sys.executable, "-c", probe], text=True))
    usable = sorted(os.sched_getaffinity(0))
    if mode == "share":
        assert pinned == devices.cpu_share(usable, 1, 2) and threads == len(pinned)
    else:
        assert pinned == usable and threads == max(1, len(usable) // 2)


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_partition_exactly(count):
    ids = [f"case:{i}" for i in range(23)]
    parts = [devices.shard(ids, i, count) for i in range(count)]
    assert sorted(sum(parts, [])) == sorted(ids)
    assert sum(len(p) for p in parts) == len(ids)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("text", ["2/2", "-1/3", "a/b", "1", "0/0"])
def test_bad_shard_is_rejected(text):
    with pytest.raises(ValueError, match="--shard"):
        devices.parse_shard(text)


class FakeNvml:
    """The libnvidia-ml calls that verify.devices makes, with chosen return codes."""

    def __init__(self, count: int, init_status: int = 0, count_status: int = 0, driver: bytes = b"580.159.04"):
        self.count, self.init_status, self.count_status, self.driver = count, init_status, count_status, driver
        self.initialised = 0

    def nvmlInit_v2(self):
        self.initialised += 1
        return self.init_status

    def nvmlDeviceGetCount_v2(self, count_ref):
        count_ref._obj.value = self.count
        return self.count_status

    def nvmlSystemGetDriverVersion(self, buffer, length):
        buffer.value = self.driver
        return 0


@pytest.fixture
def fresh_nvml():
    devices._nvml.cache_clear()
    yield
    devices._nvml.cache_clear()


def test_nvml_without_a_driver(monkeypatch, fresh_nvml):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(devices.ctypes, "CDLL", missing)
    assert devices.nvml_gpu_count() == 0 and devices.nvml_driver_version() is None


@pytest.mark.parametrize("nvml,count,driver", [
    (FakeNvml(2), 2, "580.159.04"), (FakeNvml(8, driver=b"575.1"), 8, "575.1"),
    (FakeNvml(3, init_status=9), 0, None), (FakeNvml(3, count_status=999), 0, "580.159.04")])
def test_nvml_count_and_driver(monkeypatch, fresh_nvml, nvml, count, driver):
    monkeypatch.setattr(devices.ctypes, "CDLL", lambda name: nvml)
    assert devices.nvml_gpu_count() == count
    assert devices.nvml_driver_version() == driver
    assert nvml.initialised == 1  # once per process, and left initialised


@pytest.mark.parametrize(("given", "expected"), [(None, "expandable_segments:True"),
                                                  ("max_split_size_mb:512", "max_split_size_mb:512")])
def test_the_suite_sets_expandable_segments_unless_the_user_chose_a_setting(given, expected):
    """The suite's processes run with the allocator's expandable segments (offset_overflow:201's tlx invariants
    were refused 8.3 GiB with 11.9 GiB reserved but unused without them); a PYTORCH_CUDA_ALLOC_CONF of the user's
    is left as it is. Set on import of the plugin, before any CUDA allocation reads it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if given is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = given
    script = "import os, verify.conftest; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == expected


@pytest.mark.parametrize(("cgroup_files", "expected"), [
    (None, 20_000_000 * 1024),  # no cgroup v2 files: MemAvailable
    ({"memory.max": "max\n", "memory.current": "123\n"}, 20_000_000 * 1024),  # unlimited cgroup
    ({"memory.max": "8000000000\n", "memory.current": "3000000000\n"}, 5_000_000_000),  # the container's limit
    ({"memory.max": "8000000000\n", "memory.current": "9000000000\n"}, 0)])  # past it: nothing left
def test_available_host_memory_is_the_least_of_memavailable_and_the_cgroup_limit(tmp_path, cgroup_files, expected):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683772 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    for name, text in (cgroup_files or {}).items():
        (cgroup / name).write_text(text)
    assert devices.available_host_memory(str(meminfo), str(cgroup)) == expected


def test_available_host_memory_unknown_without_either(tmp_path):
    assert devices.available_host_memory(str(tmp_path / "missing"), str(tmp_path)) is None
