"""Block ranges (jfa.block_info) against brute force over the visibility rule (jfa.mask).

The numpy twins are checked here exhaustively on small sizes; tests/test_triton_backend.py checks that the
@triton.jit versions return the same numbers as the twins (under the interpreter).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from jfa.block_info import kv_block_range_np, q_block_range_np
from jfa.mask import visible_torch


def visible_matrix(q_len: int, kv_len: int, window, causal) -> np.ndarray:
    i = torch.arange(q_len).view(-1, 1)
    j = torch.arange(kv_len).view(1, -1)
    return visible_torch(i, j, q_len, kv_len, window, causal).expand(q_len, kv_len).numpy()


def _blocks_with(cols: np.ndarray, block: int) -> set[int]:
    return {int(c) // block * block for c in cols}


def check_kv_ranges(q_len, kv_len, window, causal, block_m, block_n):
    vis = visible_matrix(q_len, kv_len, window, causal)
    m0 = np.arange(0, q_len, block_m)
    m1 = np.minimum(m0 + block_m, q_len)
    lo, full_lo, full_hi, hi = kv_block_range_np(m0, m1, q_len, kv_len, window, block_n, causal)
    for b in range(m0.size):
        rows = vis[m0[b]:m1[b]]
        cols = np.flatnonzero(rows.any(0))
        ctx = (q_len, kv_len, window, causal, block_m, block_n, int(m0[b]))
        assert lo[b] % block_n == 0 and hi[b] % block_n == 0, ctx
        assert lo[b] <= full_lo[b] <= full_hi[b] <= hi[b], ctx
        if cols.size == 0:
            assert lo[b] == hi[b], ctx
            continue
        # Every visible key is inside [lo, hi) and the first and last blocks hold one (tight).
        assert lo[b] <= cols.min() and cols.max() < hi[b], ctx
        assert {int(lo[b]), int(hi[b]) - block_n} <= _blocks_with(cols, block_n), ctx
        # The unmasked blocks are exactly the blocks every row sees entirely.
        fully = {n for n in range(0, kv_len, block_n) if n + block_n <= kv_len and rows[:, n:n + block_n].all()}
        assert fully == set(range(int(full_lo[b]), int(full_hi[b]), block_n)), ctx


def check_q_ranges(q_len, kv_len, window, causal, block_m, block_n):
    vis = visible_matrix(q_len, kv_len, window, causal)
    n0 = np.arange(0, kv_len, block_n)
    n1 = np.minimum(n0 + block_n, kv_len)
    lo, full_lo, full_hi, hi = q_block_range_np(n0, n1, q_len, kv_len, window, block_m, causal)
    for b in range(n0.size):
        cols = vis[:, n0[b]:n1[b]]
        rows = np.flatnonzero(cols.any(1))
        ctx = (q_len, kv_len, window, causal, block_m, block_n, int(n0[b]))
        assert lo[b] % block_m == 0 and hi[b] % block_m == 0, ctx
        assert lo[b] <= full_lo[b] <= full_hi[b] <= hi[b], ctx
        if rows.size == 0:
            assert lo[b] == hi[b], ctx
            continue
        assert lo[b] <= rows.min() and rows.max() < hi[b], ctx
        assert {int(lo[b]), int(hi[b]) - block_m} <= _blocks_with(rows, block_m), ctx
        fully = {m for m in range(0, q_len, block_m) if m + block_m <= q_len and cols[m:m + block_m].all()}
        assert fully == set(range(int(full_lo[b]), int(full_hi[b]), block_m)), ctx


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 0, 1, 3, 6])
def test_exhaustive_small(window, causal):
    for q_len, kv_len in itertools.product(range(0, 14), range(0, 14)):
        for block_m, block_n in ((1, 1), (2, 4), (4, 2), (4, 4), (8, 4)):
            check_kv_ranges(q_len, kv_len, window, causal, block_m, block_n)
            check_q_ranges(q_len, kv_len, window, causal, block_m, block_n)


def test_random_larger():
    rng = np.random.default_rng(0)
    for _ in range(150):
        q_len, kv_len = (int(x) for x in rng.integers(0, 300, 2))
        window = None if rng.random() < 0.4 else int(rng.integers(0, 80))
        causal = bool(rng.random() < 0.5)
        block_m, block_n = (int(2 ** rng.integers(3, 8)) for _ in range(2))
        check_kv_ranges(q_len, kv_len, window, causal, block_m, block_n)
        check_q_ranges(q_len, kv_len, window, causal, block_m, block_n)


def test_vectorised_and_scalar_agree():
    """The twins accept scalars and arrays alike (the scheduler calls them on arrays of every block)."""
    one = kv_block_range_np(40, 64, 100, 90, 7, 16, True)
    many = kv_block_range_np(np.array([0, 40]), np.array([24, 64]), 100, 90, 7, 16, True)
    assert [int(x) for x in one] == [int(x[1]) for x in many]
