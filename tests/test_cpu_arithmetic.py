"""`import verify` pins MKL's CPU arithmetic (verify/__init__): the reference and the bf16 model then round
alike on any x86 CPU with AVX2, so the CPU baseline holds bit for bit from one CI machine to the next. The
fixtures' inputs need no pin: a case id gives the same bits whatever MKL's code path."""

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


# Every values family's q, k, v and dout of one case, as a digest, in a process that does not import verify.
INPUTS = """
import hashlib, sys
from fixtures import make_inputs, spec_case
from fixtures.values import VALUE_FAMILIES
assert "verify" not in sys.modules
digest = hashlib.sha256()
for values in VALUE_FAMILIES:
    for dtype in ("bfloat16", "float16"):
        case = spec_case((200, 90), (200, 90), q_heads=2, kv_heads=1, head_dim=128, values=values, seed=5, dtype=dtype)
        inputs = make_inputs(case)
        for tensor in (inputs.q, inputs.k, inputs.v, inputs.dout):
            digest.update(tensor.float().numpy().tobytes())
print(digest.hexdigest())
"""


def run_script(script: str, arg: str = "", **env) -> list[str]:
    """The words `script` prints, run in a fresh process whose environment lacks this one's MKL_CBWR
    (tests/conftest.py imported verify here) and has `env`."""
    base = {name: value for name, value in os.environ.items() if name != "MKL_CBWR"}
    return subprocess.run([sys.executable, "-c", script, arg], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout.split()


def run_gemms(import_verify: bool, **env) -> tuple[str, str]:
    """(digest, MKL_CBWR as the process ends)."""
    digest, setting = run_script(GEMMS, "verify" if import_verify else "plain", **env)
    return digest, setting


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


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL: no other code path to try")
def test_inputs_do_not_depend_on_mkls_code_path():
    """A case id must name the same inputs on every machine, imported with verify or not. MKL's SSE2 path
    (COMPATIBLE) and its AVX2 one round GEMMs and vector math differently on any x86 CPU, so this fails for a
    values family computed through them (low_rank's einsum and torch's sqrt did)."""
    (compatible,) = run_script(INPUTS, MKL_CBWR="COMPATIBLE")  # one digest
    assert run_script(INPUTS, MKL_CBWR="AVX2") == [compatible]
