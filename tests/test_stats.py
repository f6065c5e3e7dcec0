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
