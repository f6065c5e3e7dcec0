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
import functools
import inspect
import sys
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
        if type(value).__name__ == "TensorDescriptor":
            flat.extend(encode(value, next(meta), None))
        else:
            flat.append(value)
    direct = copy.copy(run)
    direct.launch = driver_launch
    return direct, flat


def prepare(kernel, grid: tuple[int, ...], *args, **kwargs) -> Callable[[], None]:
    """A callable that launches `kernel[grid](*args, **kwargs)` on the stream current now, with the runtime's
    binding, specialisation and cache lookup (and a first call's compilation) done here, ahead of it."""
    def usual() -> None:
        kernel[grid](*args, **kwargs)

    hooks = _launch_hooks()
    if not isinstance(kernel, JITFunction) or hooks is None or any(map(_installed, hooks)):
        return usual
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    if compiled is None:  # a jit_cache_hook took the compilation over: let the runtime launch as it would
        return usual
    if hasattr(compiled, "result"):  # an asynchronous compilation's future
        compiled = compiled.result()
    parameters = kernel.signature.parameters
    values = [*args, *(kwargs[name] if name in kwargs else parameters[name].default
                       for name in kernel.arg_names[len(args):])]
    x, y, z = (*grid, 1, 1)[:3]
    stream = _current_stream()
    run = compiled.run  # loads the module on a first launch
    function, metadata = compiled.function, compiled.packed_metadata
    encoded = encoded_descriptors(run, getattr(compiled, "metadata", None), values)
    if encoded is not None:
        run, values = encoded

    def launch() -> None:
        run(x, y, z, stream, function, metadata, None, None, None, *values)

    return launch


def launch_confirmed(problem, kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` once `problem` (a `jfa.problem.Problem`) is confirmed, its host work done
    before the confirmation waits."""
    launch = prepare(kernel, grid, *args, **kwargs)
    problem.confirm()
    launch()
