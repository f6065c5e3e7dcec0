"""verify: the numerics suite for jagged attention kernels (reference comparison, bf16 error-bound
statistics, invariants) plus its gate, bisect, fuzz and report commands.

Importing it pins Intel MKL's CPU arithmetic to one code path, its AVX2 kernels (`MKL_CBWR=AVX2`, unless the
caller set MKL_CBWR): MKL otherwise picks its GEMM kernels by the CPU's instruction set, and the float64
reference and the bf16 model on a CPU then round differently from one machine to the next. Seen on the
2-core CI machine class (2026-12-04): one bf16-model record's max ulp was 1279 with MKL's AVX2 kernels, 2654
with its AVX-512 ones and 3182 with its COMPATIBLE (SSE2) ones, the same code and inputs; the gate's max-ulp
band is 2x, so the CPU baseline passed or failed by the machine it ran on. AVX2 gives the same bits on an
AVX-512 machine restricted to AVX2 (MKL_ENABLE_INSTRUCTIONS) and at 1 or 2 threads, and costs 1.5x AUTO's
GEMM time where COMPATIBLE costs 5x (Intel CPUs since Haswell and AMD ones since Zen have AVX2). MKL reads
the variable at its first call, so this holds for every process that imports verify before its first CPU
matmul (the suite's workers, the gate, bisect, fuzz, the unit tests through tests/conftest.py); GPU runs compute on
the GPU.
"""

import os

os.environ.setdefault("MKL_CBWR", "AVX2")
