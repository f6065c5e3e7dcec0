"""Kernel launches whose Triton host work is done before the launch itself.

A speculative problem's `confirm()` waits for the device: the comparison of the caller's offsets is queued
behind the previous call's kernels, so from the moment it returns the GPU is idle until the next launch
reaches it. A plain `kernel[grid](...)` spends part of that time in the Triton runtime (binding and
specialising some 30-40 arguments, building the cache key, looking the compiled kernel up). `prepare` does
all of that first, and what it returns does only the driver launch, the same call `JITFunction.run` ends
with, on the same compiled kernel and arguments. On the H200 machine (one forward through the op, timed on
the host, 2026-12-01 08:12 → 08:37 UTC) the host time after `confirm()` fell from 142-189 µs to 84-89 µs
(tlx gem and long, triton gem); the launch now starts 1 µs after `confirm()` returns, and the driver launch
itself takes 41-76 µs before the GPU starts.

TMA descriptors (the TLX kernels' `TensorDescriptor` arguments). fbtriton's launcher encodes each one
(`cuTensorMapEncodeTiled`, through its `make_tensordesc_arg`) at every launch, inside the call that `launch`
makes: 38 µs of the TLX forward's 104-113 µs launch on the H200 (2026-12-01), all of it after `confirm()`, while
the GPU waits. Where the launcher is fbtriton's (`CudaLauncher`, whose `launch` wraps the driver's launch in
that encoding), `prepare` encodes the descriptors itself, in the same function with the same metadata, and the
prepared launch calls the driver's launch with the encoded arguments; any other launcher encodes at the
launch, as before.

Repeated launches. The op launches the same kernels with the same arguments call after call (a training step's
tensors come back at the same addresses from the caching allocator), and the binding, the specialisation and the
descriptors' encoding cost ~0.1 ms of each tlx forward+backward. `prepare` keeps the last LAUNCH_CACHE_SIZE
prepared launches, keyed on the kernel, the grid, the stream and each argument's fingerprint (`_argument_key`:
what the launcher receives and what picks the specialisation), and a launch whose key it holds skips that work.
A prepared launch holds device addresses, not tensors, and one whose descriptors the launcher encodes itself
(so they stay objects holding their tensors) is not kept: the cache keeps no memory alive. On `nvidia-h200`
(a probe script not in the repository: 50 back-to-back forward+backward calls of the bench's broadcast row
through the op, tlx, 2026-12-03 14:31-14:33 UTC, two runs of two rounds each) the host time fell from 2.50-2.64
to 2.35-2.49 ms a call.

Deferred arguments. Making a TMA descriptor (Triton's `TensorDescriptor`, validated in Python) and fingerprinting
it field by field cost ~7 µs each on this repository's CI CPU, ~40 µs of the TLX short-query launch, which the GPU
waits for (the first launch of the tlx backward). A `Deferred` argument names the tensors and parameters a value is
made from; its fingerprint is theirs (address, dtype, shape, strides; ~1.5 µs), and it is made only where the
launch is not prepared already. On `nvidia-h200` (`AB_ROWS=broadcast:tlx bash scripts/gpu_session.sh
ab:scratch/base45`, four rounds in three device calls, 2026-12-04 about 19:46-19:52 UTC, with the forward's
descriptors deferred too, which they no longer are: `jfa.tlx.backend._descriptor` says why) the tlx broadcast
forward+backward through the op took 2.16 ms a call against 2.31 (the same kernels, dk and dv the same bits).

Triton versions without `triton.knobs` (where the launch hooks it must respect live; 3.6, fbtriton 3.7.4 and
3.9 have it and launch their JIT functions this way), kernels that are not plain JIT functions (the
interpreter's, an autotuner) and runs with launch hooks installed (a profiler that wants to see each launch)
launch the usual way, when the returned callable is called. A hook slot holds None or a `HookChain`, which
counts as installed only when it has calls: stock triton's chain (3.6, 3.9) has no `__bool__` and is true even
when empty (fbtriton's is false then).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
import triton
from triton.runtime.jit import JITFunction


@functools.cache
def _device_facts(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major * 10 + props.minor, props.multi_processor_count


def device_facts(device: torch.device) -> tuple[int, int]:
    """(compute capability as major·10 + minor, multiprocessor count) of a CUDA device, the launches' grid and
    kernel choice: asked of torch once per device, since its queries cost tens of microseconds of a launch's
    host time."""
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())


def _launch_hooks():
    """The runtime's launch hooks (enter, exit), or None where this Triton has no `knobs` to hold them."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return None
    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _installed(hook) -> bool:
    """Whether a launch hook slot calls anything: a hook chain by its calls (stock triton's is true even when
    empty), any other value unless None."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _current_stream():
    driver = triton.runtime.driver.active
    return driver.get_current_stream(driver.get_current_device())


def _driver_launch():
    """The driver's launch function that fbtriton's `CudaLauncher` wraps (its `utils.launch`), or None."""
    return getattr(getattr(triton.runtime.driver.active, "utils", None), "launch", None)


def _closure_values(fn) -> list:
    """The values a function's closure holds (none for other objects; empty cells left out)."""
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            values.append(cell.cell_contents)
    return values


@functools.cache
def _parameter_count(fn) -> int:
    """How many parameters `fn` takes, read once per function (inspect's signature costs ~50 µs a launch)."""
    return len(inspect.signature(fn).parameters)


def _is_descriptor(value) -> bool:
    """Whether a launch argument is a TMA descriptor (Triton's `TensorDescriptor`, told by its class name: stock
    triton's and fbtriton's are different classes)."""
    return type(value).__name__ == "TensorDescriptor"


def encoded_descriptors(run, metadata, values: list):
    """(launcher, values) with `values`' TensorDescriptor arguments encoded now: a copy of the launcher `run`
    that calls the driver's launch directly, and the arguments as fbtriton's wrapper would pass it (each
    descriptor replaced by its encoding, shape and strides, `make_tensordesc_arg`). None where the kernel has no
    descriptors or `run` is not a launcher this can drive: a `launch` attribute wrapping the driver's launch,
    and a `make_tensordesc_arg(arg, metadata, _)` in the launcher's module."""
    descriptor_meta = getattr(metadata, "tensordesc_meta", None)
    encode = getattr(sys.modules.get(type(run).__module__), "make_tensordesc_arg", None)
    if not descriptor_meta or encode is None or _parameter_count(encode) != 3:
        return None
    driver_launch = _driver_launch()
    if driver_launch is None or not any(value is driver_launch
                                        for value in _closure_values(getattr(run, "launch", None))):
        return None
    flat, meta = [], iter(descriptor_meta)
    for value in values:
        if _is_descriptor(value):
            flat.extend(encode(value, next(meta), None))
        else:
            flat.append(value)
    direct = copy.copy(run)
    direct.launch = driver_launch
    return direct, flat


# Prepared launches by what they encode (`_launch_key`): a call whose arguments fingerprint the same as an earlier
# one's skips the binding, the specialisation, the cache lookup and the descriptors' encoding; the most recent
# LAUNCH_CACHE_SIZE are kept.
_LAUNCHES: OrderedDict = OrderedDict()
_LAUNCHES_LOCK = threading.Lock()  # the op may be called from several threads; an OrderedDict's moves are not atomic
LAUNCH_CACHE_SIZE = 64


_SCALAR_TYPES = frozenset({int, bool, str, type(None)})


class Deferred:
    """A launch argument made from tensors only where the launch is not prepared already: `make(*tensors,
    *params)`, which must depend on nothing but the tensors' addresses, dtypes, shapes and strides and on the
    params (a TMA descriptor of a tensor read in place). Those are its fingerprint, so a launch whose arguments
    come back the same skips making it (a descriptor's construction and its fingerprint field by field cost the
    TLX short-query launch ~40 µs of this repository's CI CPU)."""

    __slots__ = ("make", "tensors", "params")

    def __init__(self, make: Callable, tensors: tuple, params: tuple = ()):
        self.make, self.tensors, self.params = make, tensors, params

    def key(self) -> tuple:
        return (Deferred, self.make, tuple([(x.data_ptr(), x.dtype, x.shape, x.stride()) for x in self.tensors]),
                self.params)

    def value(self):
        return self.make(*self.tensors, *self.params)


def _made(args):
    """`args` (a list, or a dict of keyword arguments) with each Deferred argument made."""
    if isinstance(args, dict):
        return {name: value.value() if type(value) is Deferred else value for name, value in args.items()}
    return [value.value() if type(value) is Deferred else value for value in args]


@functools.cache
def _field_names(kind: type) -> tuple[str, ...] | None:
    """The field names of a dataclass type (a TensorDescriptor), None for any other type: read once per type, as
    `dataclasses.fields` for every descriptor of every launch made most of the tlx short-query launch's key (140 µs
    of it on the CI machine's CPU, 35 µs without)."""
    if dataclasses.is_dataclass(kind):
        return tuple(field.name for field in dataclasses.fields(kind))
    return None


def _argument_key(value):
    """What a launch argument contributes to the launch: a tensor its device address and dtype (the kernel gets
    the address; its alignment and the dtype pick the specialisation), a `Deferred` what it is made from, a
    dataclass (a TensorDescriptor) its fields, a list or tuple its items, any other value its type and value (a
    float's sign too, since -0.0 == 0.0). The commonest types are tested first: a launch fingerprints some 40
    arguments each call."""
    kind = type(value)
    if kind in _SCALAR_TYPES:
        return kind, value
    if isinstance(value, torch.Tensor):
        return torch.Tensor, value.data_ptr(), value.dtype
    if kind is Deferred:
        return value.key()
    names = _field_names(kind)
    if names is not None:
        return kind, tuple(_argument_key(getattr(value, name)) for name in names)
    if isinstance(value, (list, tuple)):
        return kind, tuple(map(_argument_key, value))
    if isinstance(value, float):
        return float, value, math.copysign(1.0, value)
    return kind, value


def _launch_key(kernel, grid, stream, args, kwargs):
    """The key of a prepared launch in `_LAUNCHES`, or None when an argument cannot be hashed."""
    key = (kernel, tuple(grid), stream, tuple(map(_argument_key, args)),
           tuple((name, _argument_key(value)) for name, value in kwargs.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _encode(kernel, grid, stream, args, kwargs):
    """(launcher, function, packed metadata, arguments) of `kernel[grid](*args, **kwargs)`: the runtime's binding,
    specialisation and cache lookup (a first call's compilation), descriptors encoded where the launcher allows,
    tensors as their device addresses (the launcher reads a tensor's `data_ptr()` or takes the integer). None when
    a jit_cache_hook took the compilation over."""
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    if compiled is None:
        return None
    if hasattr(compiled, "result"):  # an asynchronous compilation's future
        compiled = compiled.result()
    parameters = kernel.signature.parameters
    values = [*args, *(kwargs[name] if name in kwargs else parameters[name].default
                       for name in kernel.arg_names[len(args):])]
    run = compiled.run  # loads the module on a first launch
    encoded = encoded_descriptors(run, getattr(compiled, "metadata", None), values)
    if encoded is not None:
        run, values = encoded
    values = [value.data_ptr() if isinstance(value, torch.Tensor) else value for value in values]
    return run, compiled.function, compiled.packed_metadata, values


def prepare(kernel, grid: tuple[int, ...], *args, **kwargs) -> Callable[[], None]:
    """A callable that launches `kernel[grid](*args, **kwargs)` on the stream current now, with the runtime's
    binding, specialisation and cache lookup (and a first call's compilation) done here, ahead of it, or taken
    from an earlier launch whose arguments fingerprint the same (`_launch_key`). A `Deferred` argument is made
    only where the launch is not taken from an earlier one."""
    def usual() -> None:
        kernel[grid](*_made(args), **_made(kwargs))

    hooks = _launch_hooks()
    if not isinstance(kernel, JITFunction) or hooks is None or any(map(_installed, hooks)):
        return usual
    stream = _current_stream()
    key = _launch_key(kernel, grid, stream, args, kwargs)
    prepared = _cached_launch(key)
    if prepared is None:
        prepared = _encode(kernel, grid, stream, _made(args), _made(kwargs))
        if prepared is None:  # a jit_cache_hook took the compilation over: let the runtime launch as it would
            return usual
        # A descriptor the launcher encodes itself stays an object holding its tensor: such a launch is not
        # kept, so that the cache holds no memory.
        if key is not None and not any(map(_is_descriptor, prepared[3])):
            with _LAUNCHES_LOCK:
                _LAUNCHES[key] = prepared
                while len(_LAUNCHES) > LAUNCH_CACHE_SIZE:
                    _LAUNCHES.popitem(last=False)
    run, function, metadata, values = prepared
    x, y, z = (*grid, 1, 1)[:3]

    def launch() -> None:
        run(x, y, z, stream, function, metadata, None, None, None, *values)

    return launch


def _cached_launch(key):
    if key is None:
        return None
    with _LAUNCHES_LOCK:
        prepared = _LAUNCHES.get(key)
        if prepared is not None:
            _LAUNCHES.move_to_end(key)
    return prepared


def launch_confirmed(problem, kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` once `problem` (a `jfa.problem.Problem`) is confirmed, its host work done
    before the confirmation waits."""
    launch = prepare(kernel, grid, *args, **kwargs)
    problem.confirm()
    launch()
