"""Which GPU (and how many CPUs) each xdist worker uses, and which cases each CI shard runs: pure functions
unit-tested with simulated device lists, and the few queries of the driver and the OS that feed them."""

from __future__ import annotations

import ctypes
import functools
import os
import re


@functools.cache
def _nvml(library: str = "libnvidia-ml.so.1"):
    """The NVIDIA driver's management library, initialised once per process (and left so, as torch leaves
    it), or None without a driver."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    return nvml if nvml.nvmlInit_v2() == 0 else None


def nvml_gpu_count() -> int:
    """How many GPUs the NVIDIA driver reports, 0 without a driver: asked through NVML, as torch does under
    PYTORCH_NVML_BASED_CUDA_CHECK, so that the xdist controller needs neither torch (seconds to import,
    before any worker starts) nor a CUDA context."""
    nvml, count = _nvml(), ctypes.c_uint(0)
    return count.value if nvml is not None and nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else 0


def nvml_driver_version() -> str | None:
    """The NVIDIA driver's version ("580.159.04"), None without a driver: what `nvidia-smi` prints, without
    starting it (a fraction of a second in each worker)."""
    nvml, version = _nvml(), ctypes.create_string_buffer(96)
    if nvml is None or nvml.nvmlSystemGetDriverVersion(version, ctypes.c_uint(len(version))) != 0:
        return None
    return version.value.decode()


def choose_kernel_runtime() -> None:
    """Before anything imports triton (jfa.mask does): on a machine without a usable GPU, the Triton kernels
    run under the interpreter, which triton.jit picks when it decorates a function. torch answers through
    NVML, which leaves CUDA uninitialised (a worker may still pin its GPU afterwards); it imports torch."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def visible_devices(environ=os.environ, device_count: int | None = None) -> list[str]:
    """The GPUs this host may use: CUDA_VISIBLE_DEVICES if set, else 0..device_count-1."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(device_count or 0)]


def worker_index(worker_id: str) -> int:
    """'gw7' -> 7."""
    match = re.fullmatch(r"gw(\d+)", worker_id)
    if not match:
        raise ValueError(f"not an xdist worker id: {worker_id!r}")
    return int(match.group(1))


def assign_gpu(worker_id: str, devices: list[str]) -> str | None:
    """Round-robin: worker i uses devices[i % n], so n·k workers put k on each GPU."""
    if not devices:
        return None
    return devices[worker_index(worker_id) % len(devices)]


def usable_cpu_list() -> list[int]:
    """The CPUs this process may run on: its affinity (taskset, a container's cpuset), not os.cpu_count(),
    which counts the whole host; a worker's share and `-n auto` are sized from it."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def available_host_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory this process could still take: the kernel's MemAvailable, or less where a cgroup v2
    limit (a container's) leaves less; None where neither is known (not Linux)."""
    known = []
    try:
        with open(meminfo) as lines:
            known += [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as limit, open(os.path.join(cgroup, "memory.current")) as used:
            limit_text = limit.read().strip()
            if limit_text != "max":
                known.append(max(0, int(limit_text) - int(used.read())))
    except OSError:
        pass
    return min(known, default=None)


def usable_cpus() -> int:
    return len(usable_cpu_list())


def cpu_share(cpus: list[int], index: int, count: int) -> list[int]:
    """Worker `index` of `count`'s CPUs: the index-th of `count` contiguous slices of `cpus` whose sizes differ
    by at most one, or one CPU, taken round-robin, when there are more workers than CPUs. An index past the
    count (xdist names a crashed worker's replacement gw<count>, gw<count+1>, ...) wraps around."""
    index %= count
    if count >= len(cpus):
        return [cpus[index % len(cpus)]]
    return cpus[index * len(cpus) // count:(index + 1) * len(cpus) // count]


def worker_cpus(process: str, workers: int, mode: str) -> int:
    """This process's number of threads for CPU work, its share of the usable CPUs. With mode "share" an xdist
    worker ("gwN") first confines itself to its own slice (cpu_share), so that the workers' threads stay off
    each other's cores; with "all" (or outside xdist) every process may run anywhere."""
    cpus = usable_cpu_list()
    if mode == "share" and process != "main" and hasattr(os, "sched_setaffinity"):
        cpus = cpu_share(cpus, worker_index(process), workers)
        os.sched_setaffinity(0, cpus)
        return len(cpus)
    return max(1, len(cpus) // workers)


def auto_workers(n_gpus: int, workers_per_gpu: int, n_cpus: int) -> int:
    """`-n auto`: workers_per_gpu on each GPU (at most one per CPU), or one per CPU without GPUs."""
    if n_gpus == 0:
        return max(1, n_cpus)
    return max(1, min(n_cpus, n_gpus * workers_per_gpu))


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' with 0 <= i < n."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise ValueError(f"--shard must be i/n with 0 <= i < n, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def shard(case_ids: list[str], index: int, count: int) -> list[str]:
    """The cases of shard `index` of `count`: every count-th case of the profile's fixed order, so the n
    shards partition the list exactly and a case's tests stay on one host (its reference is computed once)."""
    return [case_id for position, case_id in enumerate(case_ids) if position % count == index]
