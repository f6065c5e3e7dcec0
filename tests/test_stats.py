"""verify.stats: the bias statistics against scipy's one-sample t-test on the same samples."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from verify.stats import _bias


@pytest.mark.parametrize("shift", [0.0, 0.02, -0.3])
def test_bias_is_scipys_ttest_on_the_normalised_errors(shift):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    shape = (4000, 3)
    err = (torch.randn(shape, generator=generator, dtype=torch.float64) + shift) * 1e-3
    ref = torch.randn(shape, generator=generator, dtype=torch.float64)
    bound = torch.rand(shape, generator=generator, dtype=torch.float64) * 1e-3
    use = torch.rand(shape, generator=generator) > 0.2
    ref[0, 0] = 0.0  # sign 0: an element that counts toward neither direction

    mean, toward_mean, p_value = _bias(err, ref, bound, use & (bound > 0))

    sample = (err / bound)[use & (bound > 0)].numpy()
    toward = sample * np.sign(ref[use & (bound > 0)].numpy())
    assert mean == pytest.approx(sample.mean(), rel=1e-12)
    assert toward_mean == pytest.approx(toward.mean(), rel=1e-12)
    expected = min(scipy.stats.ttest_1samp(sample, 0.0).pvalue, scipy.stats.ttest_1samp(toward, 0.0).pvalue)
    assert p_value == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_bias_of_constant_and_tiny_samples():
    ones = torch.ones(10, dtype=torch.float64)
    use = torch.ones(10, dtype=torch.bool)
    assert _bias(0.5 * ones, ones, ones, use) == (0.5, 0.5, 1.0)  # no spread: no test
    one = torch.zeros(10, dtype=torch.bool)
    one[3] = True
    assert _bias(0.5 * ones, ones, ones, one) == (0.0, 0.0, 1.0)  # fewer than two elements


def test_ulp_statistic_leaves_out_references_below_their_bound():
    """max_ulp counts an element only where its reference is at least its error bound: a result that cancels to
    about zero (its reference below the bound, as dk with identical V rows) has no meaningful ulps, and its count
    would follow the reference's own float64 rounding. The other elements keep their ulps; an element at least
    ULP_MAGNITUDE_FLOOR of the largest but below its bound is the one left out."""
    from verify.limits import ULP_MAGNITUDE_FLOOR
    from verify.stats import compare, ulp

    gen = torch.Generator().manual_seed(3)
    rows, heads, cols = 6, 2, 8
    ref = (torch.rand(rows, heads, cols, generator=gen, dtype=torch.float64) + 0.5).neg_()  # |ref| in [0.5, 1.5)
    bound = ref.abs() * 2.0**-7  # as the bf16 model's: about u·|ref|
    cancelled = (4, 1, 3)
    ref[cancelled], bound[cancelled] = 2.0**-6, 2.0**-4  # above the magnitude floor, below its own bound
    assert ref.abs()[cancelled] >= ULP_MAGNITUDE_FLOOR * ref.abs().max()
    steps = torch.randint(0, 3, ref.shape, generator=gen, dtype=torch.float64)
    got = ref + steps * ulp(ref, torch.bfloat16)  # whole bf16 ulps of the reference: the statistic is steps
    got[cancelled] = ref[cancelled] + 2.0**-5  # within its bound, 256 ulps of its reference
    stats = compare("out", got, ref, bound, torch.zeros(heads, rows, dtype=torch.float64),
                    torch.zeros(rows, heads, cols, dtype=torch.bool), torch.tensor([0, 2, rows]), torch.bfloat16)
    steps[cancelled] = 0
    assert stats.max_ulp == float(steps.max()) == 2.0
    assert sum(stats.ulp_histogram) == rows * heads * cols - 1
    assert stats.checks["bound"]  # the left-out element is within its bound, the others at most 2 ulps apart


def test_relative_l2_leaves_out_references_below_their_bound():
    """rel_l2 is the error's L2 norm over the reference's on the elements at or above their own error bound: the
    errors of elements that cancel to about zero (within a bound far above their value) do not move it, however
    large they are against their value, and a tensor with no element at its bound has rel_l2 0 (the
    logits_below_min family's gradients, where one correct kernel read 0.097 on one CPU and 4.6 on another)."""
    from verify.stats import compare

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rows, heads, cols = 9, 2, 16
    ref = (torch.rand(rows, heads, cols, generator=gen, dtype=torch.float64) + 0.5) * torch.sign(
        torch.randn(rows, heads, cols, generator=gen, dtype=torch.float64))
    bound = ref.abs() * 2.0**-7
    cancelled = torch.rand(rows, heads, cols, generator=gen) < 0.3
    ref = torch.where(cancelled, ref * 2.0**-12, ref)  # below the bound they keep
    noise = torch.rand(rows, heads, cols, generator=gen, dtype=torch.float64) * 2 - 1
    offsets = torch.tensor([0, 4, rows])
    no_logits = torch.zeros(heads, rows, dtype=torch.float64)
    no_exact = torch.zeros(rows, heads, cols, dtype=torch.bool)

    def rel_l2(got, bound):
        return compare("out", got, ref, bound, no_logits, no_exact, offsets, torch.bfloat16).rel_l2

    kept = ~cancelled
    for scale in (0.01, 0.9):  # the cancelled elements' errors at 1% and at 90% of their bound
        got = ref + noise * bound * torch.where(cancelled, scale, 0.5)
        expected = float(torch.linalg.vector_norm((got - ref)[kept]) / torch.linalg.vector_norm(ref[kept]))
        assert rel_l2(got, bound) == pytest.approx(expected, rel=1e-12)
    everything_below = ref.abs() * 4.0
    assert rel_l2(ref + noise * ref.abs(), everything_below) == 0.0
