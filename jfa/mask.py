"""The visibility rule of the op contract, written once.

`visible` is a Triton function, so kernels inline it; its plain-Python body (`visible.fn`) is what the
reference, the bf16 model and the tests call on torch tensors, so host and device cannot drift apart.
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


# The rule's plain-Python body, bound once: torch.compile inlines a plain function (the flex peer's mask_mod
# calls visible_torch inside a compiled graph) but cannot trace an attribute call on a triton.JITFunction.
_visible_python = visible.fn


def visible_torch(i, j, q_len, kv_len, window: int | None, causal: bool):
    """`visible` on torch tensors (or ints), with the contract's `window=None` meaning no window."""
    return _visible_python(i, j, q_len, kv_len, 0 if window is None else window, window is not None, causal)
