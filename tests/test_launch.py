"""jfa.launch: a prepared launch does the Triton runtime's work when it is made and only the driver launch when
it is called, with the compiled kernel and arguments `kernel[grid](...)` would have used; kernels it cannot
launch directly (interpreted ones, with launch hooks installed) launch the usual way, and only when called.
No GPU here: the compiled kernel is a stand-in that records its launches."""

from __future__ import annotations

import sys
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from jfa import launch


def _kernel_source(X, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = 7):
    pass


class _Compiled:
    """What `JITFunction.warmup` returns: `run` (the launcher), the function handle, packed metadata."""

    def __init__(self):
        self.launches = []
        self.function, self.packed_metadata = "function-handle", ("packed",)

    def run(self, *args):
        self.launches.append(args)


def _empty_chain(reversed_order=False):
    """The runtime's default hook slot: an empty `HookChain` (stock triton's is true even when empty)."""
    return triton.knobs.HookChain(reversed=reversed_order)


@pytest.fixture(params=["none", "empty-chain", "as-installed"])
def jit_kernel(monkeypatch, request):
    """A JIT kernel whose warmup returns a recording stand-in, with no launch hook set: the slots None, empty
    hook chains, or left as the installed Triton has them; and an empty launch cache of the test's own."""
    kernel = JITFunction(_kernel_source)
    compiled = _Compiled()
    warmups = []

    def warmup(*args, grid, **kwargs):
        warmups.append((args, grid, kwargs))
        return compiled

    monkeypatch.setattr(kernel, "warmup", warmup)
    monkeypatch.setattr(launch, "_current_stream", lambda: "stream-0")
    monkeypatch.setattr(launch, "_LAUNCHES", type(launch._LAUNCHES)())
    if request.param != "as-installed":
        empty = request.param == "empty-chain"
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", _empty_chain() if empty else None)
        monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", _empty_chain(True) if empty else None)
    return kernel, compiled, warmups


def test_prepared_launch_binds_first_and_launches_only_when_called(jit_kernel):
    kernel, compiled, warmups = jit_kernel
    ready = launch.prepare(kernel, (12,), "x-tensor", n=5, scale=0.5, BLOCK=64, num_warps=4)
    assert warmups == [(("x-tensor",), (12,), dict(n=5, scale=0.5, BLOCK=64, num_warps=4))]
    assert compiled.launches == []
    ready()
    # The launcher's arguments as JITFunction.run passes them: grid padded to 3-D, the stream current when it
    # was prepared, no launch metadata or hooks, then every parameter in signature order (defaults filled in,
    # options such as num_warps not among them).
    assert compiled.launches == [(12, 1, 1, "stream-0", "function-handle", ("packed",), None, None, None,
                                  "x-tensor", 5, 0.5, 64, 7)]


def test_launch_confirmed_launches_after_the_confirmation(jit_kernel):
    kernel, compiled, _ = jit_kernel
    events = []

    class Problem:
        def confirm(self):
            events.append(("confirm", len(compiled.launches)))

    launch.launch_confirmed(Problem(), kernel, (3, 2), X=1, n=2, scale=3.0, BLOCK=16, FLAG=1)
    assert events == [("confirm", 0)]
    assert compiled.launches == [(3, 2, 1, "stream-0", "function-handle", ("packed",), None, None, None,
                                  1, 2, 3.0, 16, 1)]


def test_stale_confirmation_launches_nothing(jit_kernel):
    kernel, compiled, _ = jit_kernel

    class Stale(Exception):
        pass

    class Problem:
        def confirm(self):
            raise Stale

    with pytest.raises(Stale):
        launch.launch_confirmed(Problem(), kernel, (1,), X=1, n=2, scale=3.0, BLOCK=16)
    assert compiled.launches == []


class _Spy:
    """A kernel that is not a plain JITFunction (an interpreted one, an autotuner): launched by indexing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_other_kernels_launch_the_usual_way_when_called():
    spy = _Spy()
    ready = launch.prepare(spy, (4,), 1, BLOCK=2)
    assert spy.launches == []
    ready()
    assert spy.launches == [((4,), (1,), {"BLOCK": 2})]


@pytest.mark.parametrize("installed", ["function", "chain"])
def test_launch_hooks_keep_the_usual_launch(jit_kernel, monkeypatch, installed):
    """A profiler's launch hook must see the launch: with one installed (a function in the slot, or a call in
    the runtime's hook chain) the kernel launches through `kernel[grid]`, which calls it, and no prepared launch
    runs."""
    kernel, compiled, warmups = jit_kernel
    indexed = []
    def hook(metadata):
        pass

    if installed == "chain":
        chain = _empty_chain()
        chain.add(hook)
        hook = chain
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    monkeypatch.setattr(JITFunction, "__getitem__", lambda self, grid: lambda *a, **k: indexed.append(grid))
    ready = launch.prepare(kernel, (8,), X=1, n=2, scale=3.0, BLOCK=16)
    assert warmups == [] and indexed == []
    ready()
    assert indexed == [(8,)] and compiled.launches == []


def test_no_compiled_kernel_keeps_the_usual_launch(jit_kernel, monkeypatch):
    """warmup returns None when a jit_cache_hook takes the compilation over: the kernel then launches through
    `kernel[grid]`, when called."""
    kernel, compiled, _ = jit_kernel
    indexed = []
    monkeypatch.setattr(kernel, "warmup", lambda *args, grid, **kwargs: None)
    monkeypatch.setattr(JITFunction, "__getitem__", lambda self, grid: lambda *a, **k: indexed.append((grid, k)))
    ready = launch.prepare(kernel, (2,), X=1, n=2, scale=3.0, BLOCK=16)
    assert indexed == []
    ready()
    assert indexed == [((2,), dict(X=1, n=2, scale=3.0, BLOCK=16))] and compiled.launches == []


class TensorDescriptor:
    """Stand-in for triton.tools.tensor_descriptor.TensorDescriptor (recognised by its class name)."""

    def __init__(self, name):
        self.name, self.shape, self.strides = name, [64, 128], [128, 1]


def _launcher_module(monkeypatch, encodings):
    """A stand-in of fbtriton's nvidia driver module: its `make_tensordesc_arg` records each encoding, its
    `CudaLauncher` calls `self.launch` with the arguments as one tuple, as fbtriton's does."""
    module = types.ModuleType("fake_nvidia_driver")

    def make_tensordesc_arg(arg, metadata, _):
        encodings.append((arg.name, metadata))
        return [f"map:{arg.name}", *arg.shape, *arg.strides]

    class CudaLauncher:
        def __init__(self, launch):
            self.launch = launch

        def __call__(self, x, y, z, stream, function, metadata, launch_metadata, enter, exit_, *args):
            self.launch(x, y, z, stream, function, metadata, args)

    CudaLauncher.__module__ = module.__name__
    module.make_tensordesc_arg, module.CudaLauncher = make_tensordesc_arg, CudaLauncher
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


@pytest.mark.parametrize("wraps_the_driver", [True, False])
def test_descriptors_are_encoded_when_prepared(jit_kernel, monkeypatch, wraps_the_driver):
    """fbtriton's launcher encodes TMA descriptors inside the launch; a prepared launch of a launcher that wraps
    the driver's launch encodes them when prepared (before `confirm()`) and hands the driver the encoded
    arguments at the launch. Any other launcher keeps its own launch, which encodes then."""
    kernel, compiled, _ = jit_kernel
    encodings, driver_calls, wrapper_calls = [], [], []

    def driver_launch(*args):
        driver_calls.append(args)

    def foreign(*args):  # a launch function the launcher might wrap instead
        pass

    wrapped = driver_launch if wraps_the_driver else foreign

    def wrapper(*args):  # fbtriton's wrap_handle_tensordesc: a closure over the driver's launch
        wrapper_calls.append(args)
        return wrapped

    module = _launcher_module(monkeypatch, encodings)
    monkeypatch.setattr(launch, "_driver_launch", lambda: driver_launch)
    compiled.run = module.CudaLauncher(wrapper)
    compiled.metadata = type("Metadata", (), {"tensordesc_meta": [{"swizzle": 1}, {"swizzle": 2}]})()
    ready = launch.prepare(kernel, (5,), TensorDescriptor("q"), n=TensorDescriptor("k"), scale=0.5, BLOCK=64)
    assert encodings == ([("q", {"swizzle": 1}), ("k", {"swizzle": 2})] if wraps_the_driver else [])
    ready()
    if wraps_the_driver:
        assert wrapper_calls == [] and len(driver_calls) == 1
        assert driver_calls[0][-1] == ("map:q", 64, 128, 128, 1, "map:k", 64, 128, 128, 1, 0.5, 64, 7)
        assert compiled.run.launch is wrapper  # the launcher itself is left as it was
    else:
        assert driver_calls == [] and len(wrapper_calls) == 1
        assert [type(a).__name__ for a in wrapper_calls[0][-1][:2]] == ["TensorDescriptor", "TensorDescriptor"]
    # Only encoded descriptors are cached: unencoded ones would keep their tensors alive in the cache.
    assert len(launch._LAUNCHES) == (1 if wraps_the_driver else 0)


def test_a_repeated_launch_skips_the_runtime(jit_kernel):
    """Arguments that fingerprint the same as an earlier launch's take its binding and encoding: one warmup for
    two launches of the same arguments, each launched with them; a tensor reaches the launcher as its address."""
    import torch

    kernel, compiled, warmups = jit_kernel
    x = torch.arange(4.0)
    for _ in range(2):
        launch.prepare(kernel, (3,), x, n=5, scale=0.5, BLOCK=64)()
    assert len(warmups) == 1
    assert compiled.launches == 2 * [(3, 1, 1, "stream-0", "function-handle", ("packed",), None, None, None,
                                      x.data_ptr(), 5, 0.5, 64, 7)]


@pytest.mark.parametrize("first,second", [
    (dict(n=5), dict(n=6)), (dict(scale=0.0), dict(scale=-0.0)), (dict(n=1), dict(n=True)),
    (dict(BLOCK=64), dict(BLOCK=32)), (dict(num_warps=4), dict(num_warps=8))])
def test_any_other_argument_is_a_new_launch(jit_kernel, first, second):
    """A scalar of another value, sign (-0.0 == 0.0 in Python) or type (True == 1), another constexpr or option:
    the runtime binds the second launch again, and each launches with its own arguments."""
    kernel, compiled, warmups = jit_kernel
    base = dict(X=1, n=5, scale=0.5, BLOCK=64)
    for change in (first, second):
        launch.prepare(kernel, (2,), **{**base, **change})()
    assert len(warmups) == 2
    assert [warmup[2] for warmup in warmups] == [{**base, **first}, {**base, **second}]


def test_a_tensor_at_another_address_is_a_new_launch(jit_kernel):
    import torch

    kernel, compiled, warmups = jit_kernel
    a, b = torch.zeros(4), torch.zeros(4)
    for x in (a, b, a):
        launch.prepare(kernel, (1,), x, n=2, scale=1.0, BLOCK=16)()
    assert len(warmups) == 2
    assert [args[9] for args in compiled.launches] == [a.data_ptr(), b.data_ptr(), a.data_ptr()]


def test_a_descriptor_is_fingerprinted_by_its_fields():
    """Triton's TensorDescriptor (a dataclass) fingerprints by its fields: the same tensor, shape, strides, box and
    padding give the same launch key; another of any of them, or another tensor address, another key; the key
    holds the address, not the tensor."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor as Descriptor

    a, b = torch.zeros(64, 128), torch.zeros(64, 128)

    def key(base=a, shape=(64, 128), strides=(128, 1), block=(32, 128), padding="zero"):
        descriptor = Descriptor(base, shape=list(shape), strides=list(strides), block_shape=list(block),
                                padding=padding)
        return launch._launch_key("kernel", (1,), "stream-0", (descriptor, 2), {"BLOCK": 16})

    changes = [dict(block=(16, 128)), dict(shape=(32, 128)), dict(strides=(256, 1)), dict(padding="nan"),
               dict(base=b)]
    keys = [key(), key(), *(key(**change) for change in changes)]
    assert keys[0] == keys[1]
    assert len(set(keys)) == 1 + len(changes)

    def held(value):
        return [x for item in value for x in held(item)] if isinstance(value, tuple) else [value]

    assert a.data_ptr() in held(keys[0]) and not any(isinstance(x, torch.Tensor) for x in held(keys[0]))


def _made_from(made):
    """A `Deferred` maker that records what it is made from and gives a value the launcher can take."""
    def make(x, box):
        made.append((x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, box))
        return x.data_ptr() + box

    return make


def test_a_deferred_argument_is_made_only_for_a_launch_not_prepared_before(jit_kernel):
    """A Deferred argument (a TMA descriptor made from a tensor) is made where the launch is new, and the launcher
    gets what it makes; the same tensor again takes the prepared launch without making it."""
    import torch

    kernel, compiled, warmups = jit_kernel
    made = []
    make = _made_from(made)
    x = torch.zeros(8, 4)
    for _ in range(2):
        launch.prepare(kernel, (1,), launch.Deferred(make, (x,), (16,)), n=2, scale=1.0, BLOCK=16)()
    assert made == [(x.data_ptr(), (8, 4), (4, 1), torch.float32, 16)] and len(warmups) == 1
    assert [args[9] for args in compiled.launches] == 2 * [x.data_ptr() + 16]


@pytest.mark.parametrize("change", ["address", "shape", "strides", "dtype", "params"])
def test_a_deferred_argument_is_fingerprinted_by_what_it_is_made_from(jit_kernel, change):
    """What a Deferred argument is made of changing (another tensor address, shape, strides or dtype, or
    another parameter) is a new launch, made again; the key holds addresses, not tensors."""
    import torch

    kernel, compiled, warmups = jit_kernel
    made = []
    make = _made_from(made)
    storage = torch.zeros(64)
    x = storage[:32].view(8, 4)
    other = {"address": (storage[32:].view(8, 4), 16), "shape": (storage[:32].view(4, 8), 16),
             "strides": (storage[:32].view(4, 8).t(), 16), "dtype": (storage[:32].view(torch.int32).view(8, 4), 16),
             "params": (x, 32)}[change]
    for tensor, box in ((x, 16), other):
        launch.prepare(kernel, (1,), launch.Deferred(make, (tensor,), (box,)), n=2, scale=1.0, BLOCK=16)()
    assert len(made) == 2 and made[0] != made[1] and len(warmups) == 2
    assert [args[9] for args in compiled.launches] == [ptr + box for ptr, _, _, _, box in made]
    for key in launch._LAUNCHES:
        assert not any(isinstance(x, torch.Tensor) for x in _flattened(key))


def _flattened(value):
    return [x for item in value for x in _flattened(item)] if isinstance(value, tuple) else [value]


def test_a_deferred_argument_is_made_for_the_usual_launch(jit_kernel, monkeypatch):
    """With a launch hook installed the kernel launches through `kernel[grid]`, which gets the made argument."""
    import torch

    kernel, compiled, _ = jit_kernel
    indexed, made = [], []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    monkeypatch.setattr(JITFunction, "__getitem__", lambda self, grid: lambda *a, **k: indexed.append((a, k)))
    x = torch.zeros(8, 4)
    ready = launch.prepare(kernel, (1,), X=launch.Deferred(_made_from(made), (x,), (16,)), n=2, scale=1.0,
                           BLOCK=16)
    assert made == []
    ready()
    assert indexed == [((), dict(X=x.data_ptr() + 16, n=2, scale=1.0, BLOCK=16))] and compiled.launches == []


def test_a_cached_launch_holds_no_tensor(jit_kernel):
    """The cache outlives the op's tensors: what it keeps of a launch must not keep their memory allocated."""
    import torch

    kernel, _, _ = jit_kernel
    x = torch.arange(4.0)
    launch.prepare(kernel, (1,), x, n=2, scale=1.0, BLOCK=16)
    (key, prepared), = launch._LAUNCHES.items()
    held = [*prepared[3], *key[3]]
    assert x.data_ptr() in prepared[3]
    assert not any(isinstance(value, torch.Tensor) for value in held)


def test_the_cache_keeps_the_most_recent_launches(jit_kernel, monkeypatch):
    kernel, compiled, warmups = jit_kernel
    monkeypatch.setattr(launch, "LAUNCH_CACHE_SIZE", 2)
    for n in (1, 2, 1, 3, 2):  # 1 is used again before 3 comes in, so 2 is the one dropped
        launch.prepare(kernel, (1,), X=0, n=n, scale=1.0, BLOCK=16)()
    assert [warmup[2]["n"] for warmup in warmups] == [1, 2, 3, 2]
    assert [args[10] for args in compiled.launches] == [1, 2, 1, 3, 2]


def test_the_cache_under_threads_launches_what_each_asked(jit_kernel, monkeypatch):
    """Threads preparing launches at once, the cache smaller than their keys so that lookups, insertions and
    evictions interleave: no error, and every launch gets its own arguments."""
    import threading

    kernel, compiled, _ = jit_kernel
    monkeypatch.setattr(launch, "LAUNCH_CACHE_SIZE", 3)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    errors = []

    def work(first):
        try:
            for i in range(400):
                n = (first + i) % 7
                launch.prepare(kernel, (1,), X=0, n=n, scale=1.0, BLOCK=16)()
        except Exception as error:  # noqa: BLE001 - the test reports what any thread raised
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert sorted(args[10] for args in compiled.launches) == sorted((t + i) % 7 for t in range(6) for i in range(400))


def test_unhashable_arguments_are_prepared_every_time(jit_kernel):
    kernel, compiled, warmups = jit_kernel
    for _ in range(2):
        launch.prepare(kernel, (1,), X={"not": "hashable"}, n=1, scale=1.0, BLOCK=16)()
    assert len(warmups) == 2 and len(compiled.launches) == 2
