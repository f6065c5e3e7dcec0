"""The op's autograd function: what a kernel backend's backward receives."""

from __future__ import annotations

import torch

import jfa
from jfa.interface import _KernelAttention
from tests.helpers import jagged_inputs


class GradRecorder:
    """A kernel backend (CPU) whose forward is out = 0, lse = 0 and whose backward records its dout and returns
    gradients of 1 (q), 2 (k) and 3 (v)."""

    name = "grad-recorder"
    description = "records the backward's dout"

    def __init__(self):
        self.douts = []

    def unavailable(self, device):
        return None

    def forward(self, q, k, v, problem):
        out = q.new_zeros(problem.out_rows, problem.q_heads, problem.head_dim_v)
        lse = q.new_zeros(problem.q_heads, problem.out_rows, dtype=torch.float32)
        return out, lse, ()

    def backward(self, dout, q, k, v, out, lse, residuals, problem):
        self.douts.append(dout)
        return torch.ones_like(q), torch.full_like(k, 2), torch.full_like(v, 3)


def test_backward_gets_the_gradient_of_out_with_lse_returned():
    backend = GradRecorder()
    jfa.register_backend("grad-recorder", backend)
    q, k, v, q_off, kv_off, dout = jagged_inputs([3, 0, 5], [4, 2, 6])
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = jfa.attention(*leaves, q_off, kv_off, return_lse=True, backend="grad-recorder")
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    assert len(backend.douts) == 1 and torch.equal(backend.douts[0], dout)
    assert torch.equal(dq, torch.ones_like(q)) and torch.equal(dk, torch.full_like(k, 2))
    assert torch.equal(dv, torch.full_like(v, 3))


def test_backward_without_a_gradient_of_out_computes_nothing():
    class NoSavedTensors:
        @property
        def saved_tensors(self):
            raise AssertionError("the backward read its saved tensors without a gradient of out")

    assert _KernelAttention.backward(NoSavedTensors(), None, None) == (None,) * 5
