"""Running one implementation of the op contract on one case, forward and (optionally) backward."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch


class BackendCrash(RuntimeError):
    """The backend left the device in an unusable state (e.g. a CUDA illegal address). `record` is the result
    record of the test it crashed (`verify.checks.check_case`'s), for the caller to keep."""

    def __init__(self, record: dict):
        super().__init__(record["message"])
        self.record = record


_DEVICE_FAULTS = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
                  "CUDA driver error", "misaligned address")


def is_device_fault(error: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(error, accelerator_error) or any(text in str(error) for text in _DEVICE_FAULTS)


@dataclass
class Outputs:
    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in vars(self).items() if t is not None}


def _use_deterministic_algorithms(mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms, which also sets Inductor's flag and so imports Inductor and Dynamo
    (2.6 s in each suite worker's first invariants test on the H200 machine) where nothing compiles with
    Inductor: its flag is set when Inductor is loaded (FlexAttention's process), else only torch's switch."""
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


@contextlib.contextmanager
def nan_filled_allocations():
    """Every torch.empty inside is filled with NaN, so an element a kernel never writes shows up."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    _use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        _use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def run(fn, q, k, v, q_offsets, kv_offsets, dout, kwargs: dict, *, backward: bool,
        deterministic: bool = False) -> Outputs:
    """Calls `fn` (jfa.attention's signature) and, with `backward`, autograd for dq, dk, dv.

    The caller's tensors are used as they are (views, strides and NaN tails included); gradients are taken
    with respect to detached views of them, so nothing the caller holds is modified.
    """
    return run_backwards(fn, q, k, v, q_offsets, kv_offsets, dout, kwargs, backwards=int(backward),
                         deterministic=deterministic)[0]


def run_backwards(fn, q, k, v, q_offsets, kv_offsets, dout, kwargs: dict, *, backwards: int,
                  deterministic: bool = False) -> list[Outputs]:
    """`run` with `backwards` autograd calls over the one forward's graph, kept for each next one
    (retain_graph), as a step with two losses or a benchmark of the backward alone makes them: one Outputs per
    backward, each with the forward's out and lse (one Outputs without gradients for 0)."""
    leaves = [x.detach().requires_grad_(backwards > 0) for x in (q, k, v)]
    with torch.set_grad_enabled(backwards > 0):
        out, lse = fn(*leaves, q_offsets, kv_offsets, **kwargs, return_lse=True, deterministic=deterministic)
        grads = [torch.autograd.grad(out, leaves, dout, allow_unused=True, retain_graph=i + 1 < backwards)
                 for i in range(backwards)] or [(None, None, None)]
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    return [Outputs(out.detach(), lse.detach(), *g) for g in grads]
