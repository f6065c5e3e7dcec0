"""The visibility rule of the op contract, written once.

`visible` is a Triton function, so kernels inline it; its plain-Python body (`visible.fn`) is what the
reference, the bf16 model and the tests call on torch tensors, so host and device cannot drift apart.
`visible_keys` states the same rule as one interval of keys per query, for kernels that compare a whole tile
of keys with each row (tests/test_triton_backend.py::test_packed_visible_is_the_rule_per_slot holds the two to
each other).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def visible(i, j, q_len, kv_len, window, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """Whether key j of a sequence is visible to its query i (local indices).

    j < kv_len; |i - j| <= window when a window is set; j <= i + kv_len - q_len when causal (bottom-right
    alignment, as FlashAttention >= 2.1: with q_len > kv_len the first q_len - kv_len rows see nothing).
    Rows i >= q_len are not masked here: callers never store them.
    """
    ok = j < kv_len
    if HAS_WINDOW:
        ok = ok & (i - j <= window) & (j - i <= window)
    if CAUSAL:
        ok = ok & (j <= i + kv_len - q_len)
    return ok


@triton.jit
def visible_keys(i, q_len, kv_len, window, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """`visible` as an interval: key j >= 0 is visible to query i iff lo <= j < hi (lo may be negative; hi <= lo
    when no key is). A (query, key) pair then costs two comparisons where `visible` makes up to five."""
    lo = i * 0
    hi = kv_len + lo
    if HAS_WINDOW:
        lo = i - window
        hi = tl.minimum(hi, i + window + 1)
    if CAUSAL:
        hi = tl.minimum(hi, i + kv_len - q_len + 1)
    return lo, hi


# The rule's plain-Python body, bound once: torch.compile inlines a plain function (the flex peer's mask_mod
# calls visible_torch inside a compiled graph) but cannot trace an attribute call on a triton.JITFunction.
_visible_python = visible.fn


def visible_torch(i, j, q_len, kv_len, window: int | None, causal: bool):
    """`visible` on torch tensors (or ints), with the contract's `window=None` meaning no window."""
    return _visible_python(i, j, q_len, kv_len, 0 if window is None else window, window is not None, causal)
