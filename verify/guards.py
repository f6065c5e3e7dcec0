"""Guard bytes around every buffer a call allocates, so that a kernel writing past either end of one is seen.

A store that runs past its buffer (a whole tile stored where fewer rows remain, an offset one row off) lands
in whatever memory follows: another tensor's block inside PyTorch's caching allocator, where
compute-sanitizer's memcheck cannot see it (it knows the allocator's segments, not the tensors carved out of
them), and where nothing else in the suite looks. Inside `GuardedAllocations`, every tensor the call creates
with a factory (torch.empty, zeros, full, ones and their `_like` / `new_` forms) on the checked device is a view
into a larger allocation with GUARD_BYTES of a random pattern on each side; `stray_writes()` then names each
buffer whose guards changed, where it was allocated and how many bytes past which end. The view has the
buffer's shape, strides, dtype and contents (a NaN fill from `nan_filled_allocations` included), and an address
of the same alignment (the guard is a multiple of the allocators' 512-byte rounding), so kernels take the same
paths. Buffers made before the call (a backend's caches) or by other ops (torch.cat, .contiguous()) are not
guarded; writes far past a guard are memcheck's part (run with the caching allocator off,
scripts/gpu_session.sh).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GUARD_BYTES = 4096

_aten = torch.ops.aten
FACTORIES = frozenset({
    _aten.empty, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided, _aten.empty_like,
    _aten.zeros, _aten.new_zeros, _aten.zeros_like, _aten.ones, _aten.new_ones, _aten.ones_like,
    _aten.full, _aten.new_full, _aten.full_like,
})

# Frames in torch and in this file are not an allocation's site: the first frame outside them is (the backend's line).
_NOT_SITES = (os.path.dirname(torch.__file__) + os.sep, __file__)


@dataclass
class Guarded:
    buffer: torch.Tensor | None  # uint8: front guard, the tensor's storage bytes, back guard (None once released)
    size: int  # the storage's bytes
    what: str  # the factory, shape and dtype, and the allocating line
    guards: torch.Tensor | None = None  # once released: the front and back guards' bytes as they were then

    def guard_bytes(self) -> torch.Tensor:
        """The front and back guards' bytes, now or (released) as they were then."""
        if self.buffer is None:
            return self.guards
        return torch.cat((self.buffer[:GUARD_BYTES], self.buffer[GUARD_BYTES + self.size:]))

    def release(self) -> None:
        """Keeps a copy of the guards and lets the buffer go. The copy is a device op on the current stream, after
        every kernel that ran on the buffer there and before the allocator hands its memory to a later one."""
        self.guards = self.guard_bytes()
        self.buffer = None

    def damage(self, pattern: torch.Tensor) -> list[str]:
        guards = self.guard_bytes()
        front = torch.nonzero(guards[:GUARD_BYTES] != pattern).flatten()
        back = torch.nonzero(guards[GUARD_BYTES:] != pattern).flatten()
        found = []
        if front.numel():
            found.append(f"written before its start ({front.numel()} of the {GUARD_BYTES} guard bytes before it "
                         f"changed, the nearest at byte -{GUARD_BYTES - int(front[-1])})")
        if back.numel():
            found.append(f"written past its end ({back.numel()} of the {GUARD_BYTES} guard bytes after it changed, "
                         f"the first at byte +{int(back[0])})")
        return [f"{self.what}: {'; '.join(found)}"] if found else []


class GuardedAllocations(TorchDispatchMode):
    """While active, factory-made tensors on `device` are guarded (the module's docstring). Higher-order
    operators (FlexAttention's) pass through unguarded: the mode sees their inputs, not their allocations."""

    supports_higher_order_operators = True

    def __init__(self, device: torch.device, seed: int = 0):
        super().__init__()
        self.device = torch.device(device)
        generator = torch.Generator().manual_seed(seed)
        self.pattern = torch.randint(0, 256, (GUARD_BYTES,), dtype=torch.uint8, generator=generator).to(self.device)
        self.guarded: list[Guarded] = []
        # A buffer no tensor but its own holds reads as this (no view of the call's left on it).
        self.unshared_count = _use_count(torch.empty(1, dtype=torch.uint8))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if (getattr(func, "overloadpacket", None) not in FACTORIES or not isinstance(result, torch.Tensor)
                or result.device != self.device or result.numel() == 0):
            return result
        return self._guard(result, func)

    def _guard(self, result: torch.Tensor, func) -> torch.Tensor:
        # Buffers the call has let go of are released first, so that the guarded call holds what it would hold
        # unguarded (offset_overflow's tlx backward frees an 8.8 GB fp32 dq before its next allocations).
        for entry in self.guarded:
            if entry.buffer is not None and _use_count(entry.buffer) == self.unshared_count:
                entry.release()
        size = result.untyped_storage().nbytes()
        buffer = torch.empty(2 * GUARD_BYTES + size, dtype=torch.uint8, device=self.device)
        buffer[:GUARD_BYTES] = self.pattern
        buffer[GUARD_BYTES + size:] = self.pattern
        buffer[GUARD_BYTES:GUARD_BYTES + size] = allocation_bytes(result)
        guarded = torch.empty(0, dtype=result.dtype, device=self.device).set_(
            buffer.untyped_storage(), GUARD_BYTES // result.element_size() + result.storage_offset(), result.size(),
            result.stride())
        what = f"{func.overloadpacket.__name__} {list(result.shape)} {str(result.dtype).removeprefix('torch.')}"
        self.guarded.append(Guarded(buffer, size, f"{what} at {_site()}"))
        return guarded

    def stray_writes(self) -> list[str]:
        """One line per guarded buffer written outside itself (after the device has finished the call)."""
        return [line for guarded in self.guarded for line in guarded.damage(self.pattern)]


def _use_count(t: torch.Tensor) -> int:
    """The use count of t's storage as this function reads it (the Python storage object it makes may or may not
    add one, by torch version: GuardedAllocations calibrates it on a tensor of its own)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def allocation_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind t as a uint8 view (rows past its end and fused neighbours included), as a
    kernel's pointer arithmetic reaches it."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_SITES):
        frame = frame.f_back
    if frame is None:
        return "an unknown line"
    return f"{_shown_path(frame.f_code.co_filename)}:{frame.f_lineno}"


def _shown_path(path: str) -> str:
    """Paths under the working directory relative to it (jfa/triton/backend.py), others as they are."""
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative
