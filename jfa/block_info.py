"""Block ranges: which key blocks a query block visits, and which query blocks see a key block.

All indices are local to one sequence (query row i in [0, q_len), key j in [0, kv_len)); visibility is
`jfa.mask.visible`. A range is returned as four block starts, multiples of the block size:

    lo <= full_lo <= full_hi <= hi

Blocks starting in [lo, full_lo) and [full_hi, hi) are partly visible and need the mask; blocks in
[full_lo, full_hi) are visible to every (valid row, valid key) pair of the tile and run unmasked; no block
outside [lo, hi) holds a visible pair. An empty range has lo == hi. `hi` may pass the sequence's end (the
last block is partial; its rows or keys past the end are masked by the loads).

What "valid" means differs by direction, and the unit test (tests/test_block_info.py) checks both against
brute force over `visible`:
- `kv_block_range` (forward, dQ): for query rows [m0, m1) with m1 <= q_len, a full key block has all its
  keys < kv_len and visible to every row in [m0, m1). Rows of the tile at or past q_len are never stored.
- `q_block_range` (dK/dV): for keys [n0, n1) with n1 <= kv_len, a full query block has all its rows < q_len
  and every row sees every key in [n0, n1). Keys of the tile at or past kv_len are never stored.

Each function exists twice: a @triton.jit version kernels inline, and a numpy twin (vectorised over arrays
of blocks) the host tile scheduler uses to count work. Both only divide non-negative integers, so C-style
truncating division (Triton) and floor division (numpy) agree.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl


@triton.jit
def _aligned_range(first, end, full_first, full_end, empty, BLOCK: tl.constexpr):
    """Block starts for the element range [first, end) with fully-covered part [full_first, full_end)."""
    first = tl.maximum(first, 0)
    lo = (first // BLOCK) * BLOCK
    span = tl.maximum(end - lo, 0)
    hi = lo + ((span + BLOCK - 1) // BLOCK) * BLOCK
    full_lo = lo + ((tl.maximum(full_first - lo, 0) + BLOCK - 1) // BLOCK) * BLOCK
    full_hi = lo + (tl.maximum(full_end - lo, 0) // BLOCK) * BLOCK
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    empty = empty | (end <= first)
    hi = tl.where(empty, lo, hi)
    full_lo = tl.where(empty, lo, full_lo)
    full_hi = tl.where(empty, lo, full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def kv_block_range(m0, m1, q_len, kv_len, window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   CAUSAL: tl.constexpr):
    """Key blocks (size BLOCK_N) that query rows [m0, m1) visit: (lo, full_lo, full_hi, hi).

    Row i sees keys [L(i), U(i)] with L(i) = max(0, i - window) and U(i) = min(kv_len - 1, i + window,
    i + kv_len - q_len); both grow with i, so the rows that see anything form an interval [i0, i1] and
    the keys seen by some row are [L(i0), U(i1)]; the keys every row sees are [L(m1 - 1), U(m0)].
    """
    i0 = m0
    i1 = m1 - 1
    empty = kv_len <= 0
    first = m0 * 0
    end = kv_len
    full_first = m0 * 0
    full_end = kv_len
    if CAUSAL:
        i0 = tl.maximum(i0, q_len - kv_len)
    if HAS_WINDOW:
        i1 = tl.minimum(i1, kv_len - 1 + window)
        if CAUSAL:
            empty = empty | (window < q_len - kv_len)  # L(i) > U(i) on every row
        first = tl.maximum(first, i0 - window)
        end = tl.minimum(end, i1 + window + 1)
        full_first = tl.maximum(full_first, m1 - 1 - window)
        full_end = tl.minimum(full_end, m0 + window + 1)
    if CAUSAL:
        end = tl.minimum(end, i1 + kv_len - q_len + 1)
        full_end = tl.minimum(full_end, m0 + kv_len - q_len + 1)
    return _aligned_range(first, end, full_first, full_end, empty | (i1 < i0), BLOCK_N)


@triton.jit
def q_block_range(n0, n1, q_len, kv_len, window, BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """Query blocks (size BLOCK_M) that see keys [n0, n1): (lo, full_lo, full_hi, hi).

    Key j is seen by rows [max(0, j - window, j + q_len - kv_len), min(q_len - 1, j + window)]; the keys
    seen by anyone form an interval [j0, j1] and the rows seeing some key are [R(j0), S(j1)].
    """
    j0 = n0
    j1 = n1 - 1
    empty = q_len <= 0
    first = n0 * 0
    end = q_len
    full_first = n0 * 0
    full_end = q_len
    if HAS_WINDOW:
        j1 = tl.minimum(j1, q_len - 1 + window)
        if CAUSAL:
            empty = empty | (window < q_len - kv_len)
        first = tl.maximum(first, j0 - window)
        end = tl.minimum(end, j1 + window + 1)
        full_first = tl.maximum(full_first, n1 - 1 - window)
        full_end = tl.minimum(full_end, n0 + window + 1)
    if CAUSAL:
        first = tl.maximum(first, j0 + q_len - kv_len)
        full_first = tl.maximum(full_first, n1 - 1 + q_len - kv_len)
    return _aligned_range(first, end, full_first, full_end, empty | (j1 < j0), BLOCK_M)


# How a loop over a range of blocks applies the visibility rule (the kernels' MASK arguments): never (the
# middle, [full_lo, full_hi)), always (an edge), or to the blocks outside [full_lo, full_hi) of the whole
# range [lo, hi) in one loop (MASK_EDGES: loads always masked, the rule behind a branch per block). Causal
# and window tiles take the one loop: their several diagonal or window blocks would otherwise start a second
# software pipeline per tile, which costs more than the per-block branch (H200, 2026-11-30, triton 3.6,
# kernel time against three segments, bitwise the same results: GEM-like causal forward 0.92x, dQ 0.95x,
# dK/dV 0.84x; window 256: 0.81x, 0.81x, 0.87x; long causal (8 x 4096): forward 1.01x, dQ 1.00x, dK/dV
# 1.07x). Without causal or window only a sequence's last partial block is masked, and three segments (the
# first empty) are faster: one loop there took 1.01-1.08x in the forward (GEM-like, long, skew) and up to
# 1.18x in dK/dV; two segments (the empty first one dropped, otherwise the same TTGIR under triton 3.6) took
# 1.09-1.13x in the forward and 1.13-1.20x in dQ, for reasons not found. The three segments compile to the
# TTGIR of the kernels before MASK existed.
MASK_NEVER = tl.constexpr(0)
MASK_ALWAYS = tl.constexpr(1)
MASK_EDGES = tl.constexpr(2)


@triton.jit
def over_blocks(blocks: tl.constexpr, carry, args, lo, full_lo, full_hi, hi, ONE_LOOP: tl.constexpr):
    """The blocks [lo, hi) of a range through `blocks(*carry, start, end, full_lo, full_hi, *args, MASK)`, which
    returns the new carry (a tuple of accumulators): one loop masked at both edges when ONE_LOOP (causal and
    window tiles), else three segments, masked, unmasked and masked (see MASK_EDGES above)."""
    if ONE_LOOP:
        carry = blocks(*carry, lo, hi, full_lo, full_hi, *args, MASK_EDGES)
    else:
        carry = blocks(*carry, lo, full_lo, full_lo, full_hi, *args, MASK_ALWAYS)
        carry = blocks(*carry, full_lo, full_hi, full_lo, full_hi, *args, MASK_NEVER)
        carry = blocks(*carry, full_hi, hi, full_lo, full_hi, *args, MASK_ALWAYS)
    return carry


@triton.jit
def block_masked(start, full_lo, full_hi, MASK: tl.constexpr):
    """Whether the block at `start` applies the rule under MASK: a constexpr for MASK_NEVER and MASK_ALWAYS
    (no branch is compiled), a runtime scalar for MASK_EDGES."""
    if MASK == MASK_EDGES:  # noqa: SIM108 - a constexpr branch, kept as statements for the Triton frontend
        masked = (start < full_lo) | (start >= full_hi)
    else:
        masked = MASK == MASK_ALWAYS
    return masked


# ---------------------------------------------------------------------------------------------------------
# numpy twins (host): the same arithmetic on int64 arrays; `window=None` means no window.


def _aligned_range_np(first, end, full_first, full_end, empty, block: int):
    first = np.maximum(first, 0)
    lo = (first // block) * block
    span = np.maximum(end - lo, 0)
    hi = lo + ((span + block - 1) // block) * block
    full_lo = lo + ((np.maximum(full_first - lo, 0) + block - 1) // block) * block
    full_hi = lo + (np.maximum(full_end - lo, 0) // block) * block
    full_lo = np.minimum(full_lo, hi)
    full_hi = np.minimum(np.maximum(full_hi, full_lo), hi)
    empty = empty | (end <= first)
    hi = np.where(empty, lo, hi)
    full_lo = np.where(empty, lo, full_lo)
    full_hi = np.where(empty, lo, full_hi)
    return lo, full_lo, full_hi, hi


def _as_arrays(*values):
    arrays = np.broadcast_arrays(*(np.asarray(v, dtype=np.int64) for v in values))
    return [np.array(a, dtype=np.int64) for a in arrays]


def kv_block_range_np(m0, m1, q_len, kv_len, window: int | None, block_n: int, causal: bool):
    """Host twin of `kv_block_range`, vectorised: arrays (lo, full_lo, full_hi, hi)."""
    m0, m1, q_len, kv_len = _as_arrays(m0, m1, q_len, kv_len)
    i0, i1 = m0.copy(), m1 - 1
    empty = kv_len <= 0
    first, end = np.zeros_like(m0), kv_len.copy()
    full_first, full_end = np.zeros_like(m0), kv_len.copy()
    if causal:
        i0 = np.maximum(i0, q_len - kv_len)
    if window is not None:
        i1 = np.minimum(i1, kv_len - 1 + window)
        if causal:
            empty = empty | (window < q_len - kv_len)
        first = np.maximum(first, i0 - window)
        end = np.minimum(end, i1 + window + 1)
        full_first = np.maximum(full_first, m1 - 1 - window)
        full_end = np.minimum(full_end, m0 + window + 1)
    if causal:
        end = np.minimum(end, i1 + kv_len - q_len + 1)
        full_end = np.minimum(full_end, m0 + kv_len - q_len + 1)
    return _aligned_range_np(first, end, full_first, full_end, empty | (i1 < i0), block_n)


def q_block_range_np(n0, n1, q_len, kv_len, window: int | None, block_m: int, causal: bool):
    """Host twin of `q_block_range`, vectorised: arrays (lo, full_lo, full_hi, hi)."""
    n0, n1, q_len, kv_len = _as_arrays(n0, n1, q_len, kv_len)
    j0, j1 = n0.copy(), n1 - 1
    empty = q_len <= 0
    first, end = np.zeros_like(n0), q_len.copy()
    full_first, full_end = np.zeros_like(n0), q_len.copy()
    if window is not None:
        j1 = np.minimum(j1, q_len - 1 + window)
        if causal:
            empty = empty | (window < q_len - kv_len)
        first = np.maximum(first, j0 - window)
        end = np.minimum(end, j1 + window + 1)
        full_first = np.maximum(full_first, n1 - 1 - window)
        full_end = np.minimum(full_end, n0 + window + 1)
    if causal:
        first = np.maximum(first, j0 + q_len - kv_len)
        full_first = np.maximum(full_first, n1 - 1 + q_len - kv_len)
    return _aligned_range_np(first, end, full_first, full_end, empty | (j1 < j0), block_m)
