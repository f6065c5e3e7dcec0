"""What produced a result: device, driver, CUDA, torch, triton (or fbtriton), jfa commit."""

from __future__ import annotations

import functools
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
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   cuda=torch.version.cuda, driver=devices.nvml_driver_version())
    return env
