"""verify.guards: guarded buffers behave as the ones they replace, and a write past either end is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fixtures import case_from_id, make_inputs
from jfa.backends import attention_fn
from verify import guards as guards_module
from verify.guards import FACTORIES as GUARDED_FACTORIES
from verify.guards import GUARD_BYTES, GuardedAllocations, allocation_bytes
from verify.runner import nan_filled_allocations, run

CPU = torch.device("cpu")

FACTORIES = {
    "empty": lambda: torch.empty(5, 3, dtype=torch.bfloat16),
    "empty_strided": lambda: torch.empty_strided((4, 3), (1, 8), dtype=torch.float32),
    "zeros": lambda: torch.zeros(7, dtype=torch.int32),
    "ones": lambda: torch.ones(2, 3, dtype=torch.float16),
    "full": lambda: torch.full((3, 2), -float("inf")),
    "new_zeros": lambda: torch.arange(3.0).new_zeros(6, 1),
    "new_full": lambda: torch.arange(3).new_full((4,), 7),
    "new_empty": lambda: torch.arange(3.0).new_empty(9),
    "zeros_like": lambda: torch.zeros_like(torch.arange(10.0).view(2, 5).t()),
    "empty_like": lambda: torch.empty_like(torch.arange(4, dtype=torch.float64)),
    "empty int": lambda: torch.empty(3, 2, dtype=torch.int32),
    "empty bool": lambda: torch.empty(5, dtype=torch.bool),
    "new_empty_strided": lambda: torch.arange(3.0).new_empty_strided((3, 2), (1, 4)),
    "new_ones": lambda: torch.arange(3).new_ones(2, 2),
    "ones_like": lambda: torch.ones_like(torch.arange(6.0).view(3, 2).t()),
    "full_like": lambda: torch.full_like(torch.arange(6, dtype=torch.int16).view(2, 3)[:, ::2], -5),
    "empty_like int8": lambda: torch.empty_like(torch.arange(6, dtype=torch.int8).view(2, 3).t()),
}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("factory", FACTORIES, ids=str)
def test_a_guarded_buffer_is_the_buffer_it_replaces(factory):
    """Shape, strides, dtype and contents (NaN-filled where fresh memory is) as without the guards, at
    GUARD_BYTES into its allocation, whose 512-byte alignment it keeps; untouched, it reports nothing."""
    make = FACTORIES[factory]
    with nan_filled_allocations():
        plain = make()
        with GuardedAllocations(CPU) as guards:
            guarded = make()
    assert (guarded.shape, guarded.stride(), guarded.dtype) == (plain.shape, plain.stride(), plain.dtype)
    assert _same_bits(guarded, plain)
    (entry,) = guards.guarded
    assert guarded.data_ptr() - entry.buffer.data_ptr() == GUARD_BYTES
    assert guarded.data_ptr() % 512 == entry.buffer.data_ptr() % 512
    assert guards.stray_writes() == []


@pytest.mark.parametrize("side", ["before", "after"])
@pytest.mark.parametrize("distance", [1, 37, GUARD_BYTES])
def test_a_write_outside_a_buffer_is_named_with_its_site_and_distance(side, distance):
    """One changed byte `distance` bytes outside one of two buffers: that buffer alone is named, with the
    line that allocated it and the distance."""
    with GuardedAllocations(CPU, seed=distance) as guards:
        t = torch.zeros(3, 5, dtype=torch.float32)
        torch.empty(4, dtype=torch.int64)
    raw = allocation_bytes(t)
    start = t.storage_offset() * t.element_size()  # the view's first byte in the allocation
    byte = start - distance if side == "before" else start + t.numel() * t.element_size() + distance - 1
    raw[byte] = ~raw[byte]  # a changed byte whatever the pattern held
    (problem,) = guards.stray_writes()
    what, site = problem.split(": ", 1)[0].split(" at ")
    assert what == "zeros [3, 5] float32"
    path, line = site.split(":")
    assert Path(path).resolve() == Path(__file__).resolve()
    assert "t = torch.zeros(3, 5" in Path(path).read_text().splitlines()[int(line) - 1]
    sign, nearest = ("-", "nearest") if side == "before" else ("+", "first")
    offset = distance if side == "before" else distance - 1
    assert problem.endswith(f"1 of the {GUARD_BYTES} guard bytes {side} it changed, the {nearest} at byte "
                            f"{sign}{offset})")


def test_a_buffer_the_call_lets_go_is_released_and_its_stray_write_still_named():
    """A guarded buffer with no tensor of the call left on it is released at the next allocation (its memory
    freed, as without the guards: the invariants of a case of 2^31 elements would not fit one GPU otherwise),
    keeping its guards' bytes: a write past its end made before it was let go is still named. A buffer whose
    view is still alive is kept."""
    with GuardedAllocations(CPU, seed=3) as guards:
        freed = torch.zeros(6, dtype=torch.float32)
        raw = allocation_bytes(freed)
        raw[freed.storage_offset() * 4 + 6 * 4 + 5] ^= 1  # 6 bytes past its end
        storage = StorageWeakRef(raw.untyped_storage())
        del freed, raw
        kept = torch.ones(4, dtype=torch.int32)[1:]
        torch.empty(2)
        assert storage.expired()
    assert [entry.buffer is None for entry in guards.guarded] == [True, False, False]
    (problem,) = guards.stray_writes()
    assert problem.startswith("zeros [6] float32") and problem.endswith("the first at byte +5)")
    assert kept.tolist() == [1, 1, 1]


class _CpuAllocations(TorchDispatchMode):
    """Records the bytes of every CPU tensor a factory makes beneath the modes entered after it."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if getattr(func, "overloadpacket", None) in GUARDED_FACTORIES and result.device == CPU and result.numel():
            self.sizes.append(result.untyped_storage().nbytes())
        return result


@pytest.mark.parametrize("factory", ["empty", "zeros", "full", "new_full", "zeros_like"])
def test_a_guarded_buffer_is_the_only_allocation_of_its_factory_call(factory):
    """The guarded buffer is allocated instead of the factory's own result, not beside it: a call guarding a
    tensor of N bytes holds N + 2·GUARD_BYTES, not 2N (the invariants of the 2^31-element cases run near a
    GPU's memory)."""
    make, guards = FACTORIES[factory], GuardedAllocations(CPU)
    with _CpuAllocations() as allocations, guards:
        made = make()
    (entry,) = guards.guarded
    assert allocations.sizes == [entry.size + 2 * GUARD_BYTES]
    assert entry.size == made.untyped_storage().nbytes() - 2 * GUARD_BYTES > 0


def test_a_factory_writing_an_existing_tensor_is_left_alone():
    """The out= forms write the tensor they are given, which the call did not allocate: it is filled in place and
    returned, unguarded."""
    given = torch.full((3,), 5.0)
    with GuardedAllocations(CPU) as guards:
        returned = torch.zeros(3, out=given)
    assert returned is given and given.tolist() == [0.0, 0.0, 0.0] and guards.guarded == []


def test_a_factory_naming_its_device_without_an_index_is_on_the_current_one(monkeypatch):
    """device="cuda" allocates on the current CUDA device, whose index the result carries: the guards compare
    that, so such a call on the checked device is guarded (CUDA's current device faked: none on this machine)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert guards_module._device_of(([4],), {"device": torch.device("cuda")}) == torch.device("cuda", 1)
    assert guards_module._device_of(([4],), {"device": "cuda:0"}) == torch.device("cuda", 0)
    assert guards_module._device_of((torch.ones(2), [4]), {}) == CPU


DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.sampled_from(DTYPES), st.integers(-GUARD_BYTES - 16, 300 * 8 + GUARD_BYTES + 16),
       st.integers(0, 2**31 - 1))
def test_a_byte_changed_anywhere_is_reported_exactly_when_it_lies_outside_the_buffer(numel, dtype, offset, seed):
    """A byte changed at `offset` from the buffer's first byte: reported, at that distance, when it falls in a
    guard; nothing when it falls inside the buffer (or past the guards, which no check claims)."""
    with GuardedAllocations(CPU, seed=seed) as guards:
        t = torch.zeros(numel, dtype=dtype)
    size = numel * t.element_size()
    byte = t.storage_offset() * t.element_size() + offset
    raw = allocation_bytes(t)
    if 0 <= byte < raw.numel():
        raw[byte] = ~raw[byte]
    problems = guards.stray_writes()
    if -GUARD_BYTES <= offset < 0:
        assert len(problems) == 1 and problems[0].endswith(f"the nearest at byte -{-offset})")
    elif size <= offset < size + GUARD_BYTES:
        assert len(problems) == 1 and problems[0].endswith(f"the first at byte +{offset - size})")
    else:
        assert problems == []


@triton.jit
def _store_block(out, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    value = tl.full([BLOCK], 1.5, tl.float32)
    if MASKED:
        tl.store(out + offs, value, mask=offs < n)
    else:
        tl.store(out + offs, value)


@pytest.mark.parametrize("masked", [True, False])
def test_a_triton_kernel_storing_a_whole_block_past_its_buffer_is_caught(masked):
    """The interpreter runs a kernel on the allocation behind its arguments, as the GPU does: a block stored
    without its mask past a 13-element buffer lands in the guard."""
    n, block = 13, 16
    with GuardedAllocations(CPU, seed=n) as guards:
        out = torch.empty(n, dtype=torch.float32)
        _store_block[(1,)](out, n, BLOCK=block, MASKED=masked)
    assert torch.equal(out, torch.full((n,), 1.5))
    problems = guards.stray_writes()
    if masked:
        assert problems == []
    else:
        (problem,) = problems
        assert "written past its end" in problem and "the first at byte +0)" in problem
        assert f"of the {GUARD_BYTES} guard bytes after it changed" in problem


@pytest.mark.parametrize("case_id", ["uniform:1", "gqa:0", "broadcast_q:0"])
def test_every_tensor_the_op_returns_is_guarded_backward_included(case_id):
    """The Triton backend's out and lse (forward) and dq, dk, dv (backward, through autograd) are guarded
    buffers of the call, and a correct kernel leaves every guard intact."""
    inputs = make_inputs(case_from_id(case_id))
    fn, _ = attention_fn("triton")
    with GuardedAllocations(CPU, seed=1) as guards:
        outputs = run(fn, inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, inputs.dout,
                      inputs.kwargs, backward=True)
    allocations = {entry.buffer.data_ptr() for entry in guards.guarded if entry.buffer is not None}
    unguarded = [name for name, t in outputs.named().items() if t.untyped_storage().data_ptr() not in allocations]
    assert unguarded == []
    assert guards.stray_writes() == []
