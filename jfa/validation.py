"""Every rule of the op contract, checked on the host before anything is launched.

Errors name the argument and the rule. Nothing the caller passed is modified: the kernels get their own
int32 copies of the offsets.

The host needs the offsets' values (every rule about them, and the tile schedule), which costs one
device-to-host copy and a wait for the device per call. Whatever the device then waits for is host work
after that wait, so it is kept small: both offsets are joined on the device in one new tensor, which travels
to the host in one copy and whose halves (int32) become the kernels' own offsets (no further uploads).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from jfa.problem import Problem

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # 16-byte rows in bf16/fp16: what vectorised and TMA loads need


def _check_tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_head_dim(name: str, size: int) -> None:
    if not (HEAD_DIM_MULTIPLE <= size <= MAX_HEAD_DIM and size % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(
            f"{name} = {size} is unsupported: head dims must be multiples of {HEAD_DIM_MULTIPLE} "
            f"from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}"
        )


def _check_offsets_tensor(name: str, offsets, device: torch.device) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be 1-D with B+1 >= 1 entries, got shape {tuple(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but q is on {device}: all inputs must share a device")


def _to_host(*offsets: torch.Tensor) -> tuple[torch.Tensor, list[np.ndarray]]:
    """Checked offsets tensors joined on the device (one tensor, the caller's ones untouched), and their int64
    host copies, from one device-to-host copy."""
    joined = torch.cat([t.detach() for t in offsets]) if len(offsets) > 1 else offsets[0].detach()
    host = joined.cpu().numpy().astype(np.int64)
    first = offsets[0].numel()
    return joined, [host[:first], host[first:]] if len(offsets) > 1 else [host]


def _kernel_offsets(joined: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The kernels' int32 offsets, once every rule holds: views of one new device tensor (the joined one, or
    a copy when it is the caller's own tensor; int64 is narrowed only now, so that a value beyond int32 failed
    its rule instead of wrapping into a valid one)."""
    if joined.dtype != torch.int32:
        joined = joined.to(torch.int32)
    elif len(sizes) == 1:
        joined = joined.clone()
    return list(torch.split(joined, sizes))


def _check_offsets_values(name: str, host: np.ndarray, rows: int, rows_name: str) -> np.ndarray:
    """Checks offsets' host values and returns the sequence lengths."""
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(host[0])}")
    lens = np.diff(host)
    if lens.size and lens.min() < 0:
        b = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{b + 1}] = {int(host[b + 1])} < "
            f"{name}[{b}] = {int(host[b])}"
        )
    if host[-1] != rows:
        raise ValueError(f"{name}[-1] = {int(host[-1])} must equal the number of {rows_name} rows, {rows}")
    if rows >= 2**31:
        raise ValueError(f"{name}[-1] = {rows} does not fit the int32 offsets kernels use")
    return lens


def _check_max_len(name: str, value, real: int) -> int:
    if value is None:
        return real
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < real:
        raise ValueError(f"{name} = {value} is smaller than the longest sequence, {real}")
    return int(value)


def validate(
    q, k, v, q_offsets, kv_offsets, *, max_q_len, max_kv_len, sm_scale, window, causal, broadcast_q,
    deterministic,
) -> Problem:
    """Checks a call against the op contract and returns its `Problem`; raises TypeError/ValueError."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 3)
    for name, flag in (("causal", causal), ("broadcast_q", broadcast_q), ("deterministic", deterministic)):
        _check_flag(name, flag)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q.dtype must be torch.bfloat16 or torch.float16, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype ({x.dtype}) must equal q.dtype ({q.dtype})")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}: all inputs must share a device")

    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    head_dim_v = v.shape[2]
    if k.shape[2] != head_dim:
        raise ValueError(f"k's head dim ({k.shape[2]}) must equal q's ({head_dim})")
    if v.shape[0] != k.shape[0] or v.shape[1] != kv_heads:
        raise ValueError(f"v's rows and heads {tuple(v.shape[:2])} must equal k's {tuple(k.shape[:2])}")
    if kv_heads == 0 or q_heads == 0 or q_heads % kv_heads:
        raise ValueError(
            f"query heads ({q_heads}) must be a positive multiple of key/value heads ({kv_heads})"
        )
    _check_head_dim("head dim of q and k", head_dim)
    _check_head_dim("head dim of v", head_dim_v)

    _check_offsets_tensor("kv_offsets", kv_offsets, q.device)
    if broadcast_q:
        if q_offsets is not None:
            raise ValueError("q_offsets must be None with broadcast_q=True: q is one shared query sequence")
        joined, (kv_host,) = _to_host(kv_offsets)
    else:
        if q_offsets is None:
            raise ValueError("q_offsets is required unless broadcast_q=True")
        _check_offsets_tensor("q_offsets", q_offsets, q.device)
        joined, (kv_host, q_host) = _to_host(kv_offsets, q_offsets)
    kv_lens = _check_offsets_values("kv_offsets", kv_host, k.shape[0], "k and v")
    batch = kv_host.size - 1
    if broadcast_q:
        q_lens = np.full(batch, q.shape[0], dtype=np.int64)
        q_host = np.zeros(batch + 1, dtype=np.int64)
        out_host = np.arange(batch + 1, dtype=np.int64) * q.shape[0]
    else:
        q_lens = _check_offsets_values("q_offsets", q_host, q.shape[0], "q")
        if q_host.size != batch + 1:
            raise ValueError(
                f"q_offsets has {q_host.size - 1} sequences but kv_offsets has {batch}: B must match"
            )
        out_host = q_host
    if int(out_host[-1]) >= 2**31:
        raise ValueError(f"the output's {int(out_host[-1])} rows do not fit the int32 offsets kernels use")

    real_max_q = int(q_lens.max()) if batch else 0
    real_max_kv = int(kv_lens.max()) if batch else 0
    max_q_len = _check_max_len("max_q_len", max_q_len, real_max_q)
    max_kv_len = _check_max_len("max_kv_len", max_kv_len, real_max_kv)

    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be an int or None, got {type(window).__name__}")
        if window < 0:
            raise ValueError(f"window must be >= 0 (|i - j| <= window), got {window}")
        window = int(window)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
            raise TypeError(f"sm_scale must be a real number or None, got {type(sm_scale).__name__}")
        if not math.isfinite(sm_scale):
            raise ValueError(f"sm_scale must be finite, got {sm_scale}")
        sm_scale = float(sm_scale)

    # Every rule holds: the kernels' offsets, made on the device.
    if broadcast_q:
        (kv_device,) = _kernel_offsets(joined, [batch + 1])
        q_device = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
        out_device = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * q.shape[0]
    else:
        kv_device, q_device = _kernel_offsets(joined, [batch + 1, q_host.size])
        out_device = q_device
    return Problem(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim_v,
        dtype=q.dtype, device=q.device, sm_scale=sm_scale, window=window, causal=causal,
        broadcast_q=broadcast_q, deterministic=deterministic,
        q_offsets=q_device, out_offsets=out_device, kv_offsets=kv_device,
        q_offsets_host=torch.from_numpy(q_host), out_offsets_host=torch.from_numpy(out_host),
        kv_offsets_host=torch.from_numpy(kv_host), q_lens=torch.from_numpy(q_lens),
        kv_lens=torch.from_numpy(kv_lens), max_q_len=max_q_len, max_kv_len=max_kv_len,
        q_rows=q.shape[0], out_rows=int(out_host[-1]), kv_rows=k.shape[0],
    )
