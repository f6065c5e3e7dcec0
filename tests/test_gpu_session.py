"""scripts/gpu_session.sh on the CPU with stand-in GPUs (an `nvidia-smi` that lists two): a `+` group of
premerge stages gives each stage without CPUS its own share of the cores, and keeps a stage's own CPUS."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_group_premerge_stages_get_their_share_of_the_cores(tmp_path):
    from verify.devices import cpu_share, usable_cpu_list

    stub = tmp_path / "bin"
    stub.mkdir()
    smi = stub / "nvidia-smi"
    smi.write_text('#!/bin/bash\n[[ "$*" == *--list-gpus* ]] && printf "GPU 0: stand-in\\nGPU 1: stand-in\\n"\n')
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{stub}:{os.environ['PATH']}", OUT=str(out),
               PROFILE="smoke", WPG="1")
    cpus = usable_cpu_list()
    own = f"{cpus[0]}"
    group = f"premerge:1:bf16-model:share_a+premerge:1:bf16-model:own_b:{own}"
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", group], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    timings = (out / "timings.txt").read_text()
    first_share = ",".join(map(str, cpu_share(cpus, 0, 2)))
    assert f"premerge share_a on 1 GPU(s), cores {first_share}, backends bf16-model: exit 0" in timings, timings
    assert f"premerge own_b on 1 GPU(s), cores {own}, backends bf16-model: exit 0" in timings, timings
