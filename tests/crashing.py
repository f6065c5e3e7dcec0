"""A backend that takes its process down on chosen cases: a segfault when q has SEGFAULT_ROWS rows, a
sticky device fault (as a CUDA illegal address raises) when it has FAULT_ROWS rows; the bf16 model
otherwise. The suite must fail exactly those cases, by id, and keep every other result."""

from __future__ import annotations

import ctypes

import jfa

SEGFAULT_ROWS = 7
FAULT_ROWS = 9


def attention(q, k, v, q_offsets, kv_offsets, **kwargs):
    if q.shape[0] == SEGFAULT_ROWS:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if q.shape[0] == FAULT_ROWS:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return jfa.attention(q, k, v, q_offsets, kv_offsets, backend="bf16-model", **kwargs)
