"""The thresholds of verify.stats' checks (the checks are described there) with their derivations, apart from
it so that readers of results files (`python -m verify report`) need no torch."""

from __future__ import annotations

import math

# Calibration (README "Calibration"): the bf16 model's worst bound ratio per family is 0.10-0.95 over the ci
# profile on the CPU and at most 0.98 over premerge on the H200 (DESIGN.md: out 0.23–0.77, dV up to 0.86); a
# correct kernel rounds at the same points in a different order (online rescaling, tiled sums), which the
# first-order bound also covers, so 2 leaves a 2× margin, while every planted bug sits orders above.
BOUND_LIMIT = 2.0
# FlashAttention and PyTorch gate at 2–3× the same-dtype baseline on the global max error; per block of one
# sequence and head the max is taken over fewer elements and fluctuates more, hence 3× plus one ulp (an
# ulp of x is at most 2u|x|) so that blocks the model gets exactly right do not demand exactness.
BASELINE_FACTOR = 3.0
# The bias test: a correct round-to-nearest kernel has no systematic error beyond the model's own. With
# millions of elements any mean is "significant", so the mean must also be large. Measured on the ci
# profile (tests/test_planted.py): truncating P instead of rounding it moves the normalised error towards
# zero by 0.07–0.10, while the bf16 model and the correct emulator stay within 0.007 of zero.
BIAS_P = 1e-6
BIAS_FLOOR = 0.03
BIAS_FACTOR = 2.0
# Elements smaller than this fraction of the tensor's largest reference value are left out of the ulp
# statistic, where an ulp of a near-zero reference is meaninglessly small (and so are those below their own
# error bound: `verify.stats.compare`).
ULP_MAGNITUDE_FLOOR = 2.0**-8
# Bin edges (in ulps of the reference) of the per-tensor ulp-error histogram kept for reports.
ULP_BINS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0, 4096.0, math.inf)
