"""`import verify` pins MKL's CPU arithmetic (verify/__init__): the reference and the bf16 model then round
alike on any x86 CPU with AVX2, so the CPU baseline holds bit for bit from one CI machine to the next."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# A float64 and a float32 GEMM (the reference's and the bf16 model's arithmetic), printed as a digest of their
# bits, after importing verify when asked to.
GEMMS = """
import hashlib, os, sys
if sys.argv[1] == "verify":
    import verify
import torch
g = torch.Generator().manual_seed(0)
a, b = torch.randn(96, 320, dtype=torch.float64, generator=g), torch.randn(320, 200, dtype=torch.float64, generator=g)
c = torch.randn(96, 320, generator=g) @ torch.randn(320, 200, generator=g)
print(hashlib.sha256((a @ b).numpy().tobytes() + c.numpy().tobytes()).hexdigest(), os.environ.get("MKL_CBWR"))
"""


def run_gemms(import_verify: bool, **env) -> tuple[str, str]:
    """(digest, MKL_CBWR as the process ends) in a fresh process whose environment lacks this one's MKL_CBWR
    (tests/conftest.py imported verify here) and has `env`."""
    base = {name: value for name, value in os.environ.items() if name != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", GEMMS, "verify" if import_verify else "plain"], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL: nothing to pin")
def test_pinned_gemms_round_the_same_with_mkl_restricted_to_avx2():
    """On an AVX-512 machine MKL's own kernels round otherwise than its AVX2 ones (seen on the CI machine:
    the unpinned digests differ); pinned, both are the AVX2 branch's. On an AVX2 machine both sides are that
    branch anyway."""
    pinned, setting = run_gemms(True)
    assert setting == "AVX2"
    assert run_gemms(True, MKL_ENABLE_INSTRUCTIONS="AVX2")[0] == pinned


def test_a_callers_mkl_setting_is_kept():
    assert run_gemms(True, MKL_CBWR="COMPATIBLE")[1] == "COMPATIBLE"
    assert run_gemms(False)[1] == "None"  # nothing is set without importing verify


def test_environment_records_the_cpu_arithmetic():
    from verify import environment

    env = environment.collect("cpu")
    assert env["mkl_cbwr"] == os.environ["MKL_CBWR"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
