"""What produced a result: device, driver, CUDA, torch, triton (or fbtriton), jfa commit and source digest, and
the CPU arithmetic settings (instruction set, MKL_CBWR)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
from pathlib import Path

import torch

from verify import devices

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


# The code a result depends on: the kernels, the reference, the fixtures (with the corpus) and the suite.
SOURCE_DIRS = ("jfa", "reference", "fixtures", "verify")


def source_digest(root: Path = REPO) -> str:
    """12 hex digits of a sha256 over the .py and .txt files of SOURCE_DIRS (relative path and content, in
    path order). It names the code a result came from where git cannot: a dirty tree has no commit, and a
    GPU machine's copy of a working tree carries stale git metadata (H200 records named a commit hours older
    than the code they ran)."""
    digest = hashlib.sha256()
    files = sorted(f for d in SOURCE_DIRS for pattern in ("*.py", "*.txt") for f in (root / d).rglob(pattern))
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def device_class(device: torch.device) -> str:
    """A short name for baselines: 'cpu-interpreter' or the GPU's name, e.g. 'nvidia-h200'."""
    if device.type != "cuda":
        return "cpu-interpreter"
    return torch.cuda.get_device_name(device).lower().replace(" ", "-")


@functools.cache
def collect(device_type: str) -> dict:
    import triton

    device = torch.device(device_type)
    env = {
        "device_class": device_class(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "jfa_commit": _git("rev-parse", "HEAD"),
        "jfa_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "jfa_source": source_digest(),
        # What picks the CPU's arithmetic paths (the reference and the bf16 model on a CPU): see verify/__init__.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   cuda=torch.version.cuda, driver=devices.nvml_driver_version())
    return env
