"""The backend registry: a name maps to an implementation of the op contract.

Two kinds of implementation exist. A `KernelBackend` (jfa's own kernels and the bf16 model) supplies a
forward and a backward over a validated `Problem`; the op wraps them in one autograd function. An
`OpBackend` (the peers) is already a differentiable implementation of the whole contract. Built-ins are
named here by import path and imported on first use, so `import jfa` stays cheap and a backend whose
toolchain is missing (fbtriton, a CUDA build of torch) costs nothing until asked for.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Protocol

import torch

from jfa.problem import Problem


class Backend(Protocol):
    """Optionally `speculative = True`: the backend accepts a Problem whose offsets are still being compared
    on the device (`jfa.validation.validate(speculative=True)`) and calls `problem.confirm()` before its first
    launch that reads them; other backends get confirmed problems."""

    name: str
    description: str

    def unavailable(self, device: torch.device) -> str | None:
        """None when the backend runs on `device`, else the reason it cannot."""


class KernelBackend(Backend, Protocol):
    def forward(self, q, k, v, problem: Problem) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Returns out, lse [Hq, out_rows] float32 and residuals (tensors the backward needs)."""

    def backward(self, dout, q, k, v, out, lse, residuals: tuple, problem: Problem):
        """Returns dq, dk, dv."""


class OpBackend(Backend, Protocol):
    def __call__(self, q, k, v, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns out and lse, differentiable with respect to q, k, v through torch.autograd."""


_BUILTIN = {
    "tlx": "jfa.tlx.backend:BACKEND",
    "triton": "jfa.triton.backend:BACKEND",
    "bf16-model": "reference.bf16_model:BACKEND",
    "torch-varlen": "jfa.peers:TORCH_VARLEN",
    "flex": "jfa.peers:FLEX",
}
_loaded: dict[str, Backend] = {}


def register(name: str, backend: Backend) -> None:
    """Adds (or replaces) a backend under `name`."""
    _loaded[name] = backend


def names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_loaded))


def get(name: str) -> Backend:
    if name in _loaded:
        return _loaded[name]
    if name not in _BUILTIN:
        raise ValueError(f"backend must be 'auto' or one of {names()}, got {name!r}")
    module, attr = _BUILTIN[name].split(":")
    _loaded[name] = getattr(importlib.import_module(module), attr)
    return _loaded[name]


def resolve(name: str, device: torch.device) -> Backend:
    """The backend that runs a call: 'auto' picks the fastest available; an unavailable one raises."""
    if name == "auto":
        for candidate in auto_order(device):
            backend = get(candidate)
            if backend.unavailable(device) is None:
                return backend
        raise RuntimeError(f"no backend is available on {device}")
    backend = get(name)
    reason = backend.unavailable(device)
    if reason is not None:
        raise RuntimeError(f"backend {name!r} is unavailable on {device}: {reason}")
    return backend


def auto_order(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["tlx", "triton", "bf16-model"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ["triton", "bf16-model"]
    return ["bf16-model"]


def attention_fn(spec: str) -> tuple[Callable, Callable[[torch.device], str | None]]:
    """A callable with jfa.attention's signature for `spec`, and its availability check.

    `spec` is a registered name or `package.module:function`, any callable with the op contract: this is
    how the verify suite treats kernels that live outside this repository exactly like registered ones.
    """
    if ":" in spec:
        module, attr = spec.split(":", 1)
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as error:
            reason = f"cannot import {spec}: {error}"
            return (lambda *args, **kwargs: None), (lambda device: reason)
        return fn, getattr(fn, "unavailable", lambda device: None)

    import jfa

    backend = get(spec)

    def call(*args, **kwargs):
        return jfa.attention(*args, backend=spec, **kwargs)

    return call, backend.unavailable
