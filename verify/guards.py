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
paths. The guarded allocation is the factory's only one: the factory runs on the meta device for the result's
geometry, and the contents are made in the guarded buffer (a call guarding an 8.8 GB buffer holds 8.8 GB, not
17.6). Buffers made before the call (a backend's caches) or by other ops (torch.cat, .contiguous()) are not
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
        self.device = _indexed(torch.device(device))
        generator = torch.Generator().manual_seed(seed)
        self.pattern = torch.randint(0, 256, (GUARD_BYTES,), dtype=torch.uint8, generator=generator).to(self.device)
        self.guarded: list[Guarded] = []
        # A buffer no tensor but its own holds reads as this (no view of the call's left on it).
        self.unshared_count = _use_count(torch.empty(1, dtype=torch.uint8))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        # An out= form writes a tensor that exists already: nothing to guard.
        if packet not in FACTORIES or "out" in kwargs or _device_of(args, kwargs) != self.device:
            return func(*args, **kwargs)
        # The factory runs on the meta device for the result's geometry; its contents are then made in the guarded
        # buffer, so that the buffer is the only allocation (not a second one of the result's size to copy from).
        shape_of = func(*(_on_meta(a) for a in args), **_meta_kwargs(kwargs))
        if shape_of.numel() == 0:
            return func(*args, **kwargs)
        return self._guard(shape_of, func, _fill_value(packet, args))

    def _guard(self, shape_of: torch.Tensor, func, fill) -> torch.Tensor:
        # Buffers the call has let go of are released first, so that the guarded call holds what it would hold
        # unguarded (offset_overflow's tlx backward frees an 8.8 GB fp32 dq before its next allocations).
        for entry in self.guarded:
            if entry.buffer is not None and _use_count(entry.buffer) == self.unshared_count:
                entry.release()
        size = shape_of.untyped_storage().nbytes()
        buffer = torch.empty(2 * GUARD_BYTES + size, dtype=torch.uint8, device=self.device)
        buffer[:GUARD_BYTES] = self.pattern
        buffer[GUARD_BYTES + size:] = self.pattern
        guarded = torch.empty(0, dtype=shape_of.dtype, device=self.device).set_(
            buffer.untyped_storage(), GUARD_BYTES // shape_of.element_size() + shape_of.storage_offset(),
            shape_of.size(), shape_of.stride())
        if fill is _UNINITIALIZED:
            _fill_uninitialized(guarded)
        else:
            guarded.fill_(fill)
        what = f"{func.overloadpacket.__name__} {list(shape_of.shape)} {str(shape_of.dtype).removeprefix('torch.')}"
        self.guarded.append(Guarded(buffer, size, f"{what} at {_site()}"))
        return guarded

    def stray_writes(self) -> list[str]:
        """One line per guarded buffer written outside itself (after the device has finished the call)."""
        return [line for guarded in self.guarded for line in guarded.damage(self.pattern)]


_UNINITIALIZED = object()


def _device_of(args, kwargs) -> torch.device:
    """The device a factory call allocates on: its device argument, else its tensor's (the _like and new_ forms),
    with the index of the current device where the argument names none (device="cuda"), as the result has."""
    if kwargs.get("device") is not None:
        return _indexed(torch.device(kwargs["device"]))
    return args[0].device if args and isinstance(args[0], torch.Tensor) else _indexed(torch.get_default_device())


def _indexed(device: torch.device) -> torch.device:
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _on_meta(arg):
    """A tensor argument as a meta tensor of its shape and strides (what a _like factory's layout follows)."""
    if not isinstance(arg, torch.Tensor):
        return arg
    return torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype, device="meta")


def _meta_kwargs(kwargs: dict) -> dict:
    """A factory's keyword arguments for the meta device (which has no pinned memory)."""
    meta = {"device": "meta", "pin_memory": False}
    return {name: meta.get(name, value) for name, value in kwargs.items()}


def _fill_value(packet, args):
    """What a factory fills its result with, or _UNINITIALIZED for the empty forms."""
    if packet in (_aten.zeros, _aten.new_zeros, _aten.zeros_like):
        return 0
    if packet in (_aten.ones, _aten.new_ones, _aten.ones_like):
        return 1
    if packet in (_aten.full, _aten.full_like):
        return args[1]
    if packet is _aten.new_full:
        return args[2]
    return _UNINITIALIZED


def _fill_uninitialized(t: torch.Tensor) -> None:
    """What torch leaves in an empty tensor: with deterministic algorithms and fill_uninitialized_memory on
    (`nan_filled_allocations`), NaN for floating types and the largest value for the others, as torch's own
    fill_empty_deterministic_; otherwise nothing (whatever the memory held)."""
    if not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory):
        return
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    else:
        t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)


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
