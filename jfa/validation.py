"""Every rule of the op contract, checked on the host before anything is launched.

Errors name the argument and the rule. Nothing the caller passed is modified: the kernels get their own
int32 copies of the offsets.

The host needs the offsets' values (every rule about them, and the tile schedule), which costs one wait
for the device per call. Whatever the device then waits for is host work after that wait, so it is kept
small: both offsets are joined on the device in one new tensor, which travels to the host in one copy and
whose halves (int32) become the kernels' own offsets (no further uploads). Calls that repeat offsets already
validated (a training loop over batches of one length profile) skip even that: the joined tensor is compared
on the device with the last validated one of its size, and when they are equal (one boolean crosses to the
host) the earlier host copies, lengths and kernel offsets serve again. Only values that passed every rule
independent of the tensors' shapes are remembered; the rules that involve shapes (last offset = rows) are
checked on every call. The remembered arrays are shared by the Problems of such calls and never written.
With `speculative=True` (what `jfa.attention` asks for) such a call does not even wait for that boolean: it
gets a Problem built from the remembered values at once and `Problem.confirm()` reads the answer before the
first launch (see `validate`).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass, field

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


@dataclass
class _ValidOffsets:
    """Offsets values that passed the shape-independent rules: their device copy in the caller's dtype (for
    the comparison), the kernels' int32 copy, host int64 copies and lengths per part, and a token naming
    these values for the tile-schedule caches (never reused)."""

    compared: torch.Tensor
    kernel: list[torch.Tensor]
    host: list[np.ndarray]
    lens: list[np.ndarray]
    longest: list[int]
    token: int
    broadcast: dict = field(default_factory=dict)  # shared query rows -> (q_host, out_host, q_lens, q_dev, out_dev)


_TOKENS = itertools.count()
_VALID: OrderedDict = OrderedDict()  # (device, dtype, part sizes) -> the last _ValidOffsets of that size
_VALID_SIZE = 8


def _joined(offsets: list[torch.Tensor]) -> torch.Tensor:
    """The offsets joined on the device: a new tensor, or the caller's own one when there is one part."""
    return torch.cat([t.detach() for t in offsets]) if len(offsets) > 1 else offsets[0].detach()


def _kernel_offsets(joined: torch.Tensor, sizes: list[int], owned: bool) -> list[torch.Tensor]:
    """The kernels' int32 offsets: views of one new device tensor (the joined one when it is ours, else a
    copy; int64 is narrowed only after its values passed their rules, so a value beyond int32 fails its rule
    instead of wrapping into a valid one)."""
    if joined.dtype != torch.int32:
        joined = joined.to(torch.int32)
    elif not owned:
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
    _check_rows(name, host, rows, rows_name)
    return lens


def _check_rows(name: str, host: np.ndarray, rows: int, rows_name: str) -> None:
    """The rules of offsets that involve the tensors' shapes."""
    if host[-1] != rows:
        raise ValueError(f"{name}[-1] = {int(host[-1])} must equal the number of {rows_name} rows, {rows}")
    if rows >= 2**31:
        raise ValueError(f"{name}[-1] = {rows} does not fit the int32 offsets kernels use")


class _Confirmation:
    """Whether the caller's offsets still equal the validated values a speculative Problem was built from:
    a device comparison, on CUDA copied to pinned host memory behind an event, read once."""

    def __init__(self, joined: torch.Tensor, known: torch.Tensor):
        differs = torch.ne(joined, known).any()
        self._event = None
        if differs.is_cuda:
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(differs, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(differs.device))  # the offsets' GPU, not the current one
        else:
            self._flag = differs
        self._held: bool | None = None

    def held(self) -> bool:
        if self._held is None:
            if self._event is not None:
                self._event.synchronize()
            self._held = not bool(self._flag)
        return self._held


def _check_parts_rows(parts, hosts: list[np.ndarray]) -> None:
    """`_check_rows` for each part (name, tensor, rows, rows' name) against its host values."""
    for (name, _, rows, rows_name), host in zip(parts, hosts, strict=True):
        _check_rows(name, host, rows, rows_name)


def _rows_hold(parts, valid: _ValidOffsets) -> bool:
    try:
        _check_parts_rows(parts, valid.host)
    except ValueError:
        return False
    return True


def _valid_offsets(parts: list[tuple[str, torch.Tensor, int, str]],
                   speculative: bool) -> tuple[_ValidOffsets, _Confirmation | None]:
    """Every rule of the offsets (name, tensor, rows, rows' name) in `parts`, in order, and their values.

    Values equal to the last validated ones of their size are recognised on the device (one boolean
    crosses to the host) and only the shape rules are checked again; other values travel to the host in one
    copy, are checked and are remembered. `speculative`: when validated values of this size exist and the
    shape rules hold for them, they are returned at once with the pending comparison (on CUDA, no wait)."""
    tensors = [t for _, t, _, _ in parts]
    sizes = [t.numel() for t in tensors]
    joined = _joined(tensors)
    key = (joined.device, joined.dtype, tuple(sizes))
    known = _VALID.get(key)
    if known is not None:
        if speculative and _rows_hold(parts, known):
            _VALID.move_to_end(key)
            return known, _Confirmation(joined, known.compared)
        if torch.equal(joined, known.compared):
            _VALID.move_to_end(key)
            _check_parts_rows(parts, known.host)
            return known, None
    host = joined.cpu().numpy().astype(np.int64)
    hosts = np.split(host, np.cumsum(sizes)[:-1])
    lens = [_check_offsets_values(name, part, rows, rows_name)
            for (name, _, rows, rows_name), part in zip(parts, hosts, strict=True)]
    if len(sizes) > 1 and sizes[1] != sizes[0]:
        raise ValueError(f"q_offsets has {sizes[1] - 1} sequences but kv_offsets has {sizes[0] - 1}: B must match")
    owned = len(tensors) > 1
    valid = _ValidOffsets(compared=joined if owned else joined.clone(), kernel=_kernel_offsets(joined, sizes, owned),
                          host=hosts, lens=lens, longest=[int(part.max()) if part.size else 0 for part in lens],
                          token=next(_TOKENS))
    _VALID[key] = valid
    _VALID.move_to_end(key)
    while len(_VALID) > _VALID_SIZE:
        _VALID.popitem(last=False)
    return valid, None


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
    deterministic, speculative: bool = False,
) -> Problem:
    """Checks a call against the op contract and returns its `Problem`; raises TypeError/ValueError.

    speculative=True may return, without waiting for the device, a Problem built from validated offsets
    whose equality with the caller's is still being checked on the device: `Problem.confirm()` (before
    anything is launched on it) waits for that answer and raises `StaleOffsets` if they differ, and the
    call is then validated again with speculative=False."""
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
    parts = [("kv_offsets", kv_offsets, k.shape[0], "k and v")]
    if broadcast_q:
        if q_offsets is not None:
            raise ValueError("q_offsets must be None with broadcast_q=True: q is one shared query sequence")
    else:
        if q_offsets is None:
            raise ValueError("q_offsets is required unless broadcast_q=True")
        _check_offsets_tensor("q_offsets", q_offsets, q.device)
        parts.append(("q_offsets", q_offsets, q.shape[0], "q"))
    valid, confirmation = _valid_offsets(parts, speculative)
    try:
        kv_host, kv_lens = valid.host[0], valid.lens[0]
        batch = kv_host.size - 1
        if broadcast_q:
            q_host, out_host, q_lens, q_device, out_device = _broadcast_rows(valid, batch, q.shape[0], q.device)
            kv_device = valid.kernel[0]
        else:
            q_host, q_lens = valid.host[1], valid.lens[1]
            out_host = q_host
            kv_device, q_device = valid.kernel
            out_device = q_device
        if int(out_host[-1]) >= 2**31:
            raise ValueError(f"the output's {int(out_host[-1])} rows do not fit the int32 offsets kernels use")

        real_max_q = (q.shape[0] if batch else 0) if broadcast_q else valid.longest[1]
        real_max_kv = valid.longest[0]
        bound_q = _check_max_len("max_q_len", max_q_len, real_max_q)
        bound_kv = _check_max_len("max_kv_len", max_kv_len, real_max_kv)
    except ValueError:
        # A rule broken by speculative values: they may not be the caller's (then validate those instead).
        if confirmation is not None and not confirmation.held():
            return validate(q, k, v, q_offsets, kv_offsets, max_q_len=max_q_len, max_kv_len=max_kv_len,
                            sm_scale=sm_scale, window=window, causal=causal, broadcast_q=broadcast_q,
                            deterministic=deterministic)
        raise

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

    return Problem(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim_v,
        dtype=q.dtype, device=q.device, sm_scale=sm_scale, window=window, causal=causal,
        broadcast_q=broadcast_q, deterministic=deterministic,
        q_offsets=q_device, out_offsets=out_device, kv_offsets=kv_device,
        q_offsets_host=torch.from_numpy(q_host), out_offsets_host=torch.from_numpy(out_host),
        kv_offsets_host=torch.from_numpy(kv_host), q_lens=torch.from_numpy(q_lens),
        kv_lens=torch.from_numpy(kv_lens), max_q_len=bound_q, max_kv_len=bound_kv,
        q_rows=q.shape[0], out_rows=int(out_host[-1]), kv_rows=k.shape[0],
        lengths_key=(valid.token, q.shape[0] if broadcast_q else None),
        confirmation=confirmation,
    )


def _broadcast_rows(valid: _ValidOffsets, batch: int, shared_rows: int, device: torch.device) -> tuple:
    """With broadcast_q, the query side of the problem (the same for every call on these kv offsets and this
    shared query length): host q offsets (all 0), output offsets b·Lq, query lengths, and their kernel
    copies."""
    made = valid.broadcast.get(shared_rows)
    if made is None:
        if len(valid.broadcast) >= _VALID_SIZE:  # a bounded memory of shared lengths, like _VALID's
            valid.broadcast.clear()
        q_host = np.zeros(batch + 1, dtype=np.int64)
        out_host = np.arange(batch + 1, dtype=np.int64) * shared_rows
        q_lens = np.full(batch, shared_rows, dtype=np.int64)
        q_device = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        out_device = torch.arange(batch + 1, dtype=torch.int32, device=device) * shared_rows
        made = valid.broadcast[shared_rows] = (q_host, out_host, q_lens, q_device, out_device)
    return made
