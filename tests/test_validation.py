"""Every rule of the op contract raises a TypeError/ValueError naming the argument and the rule, before
anything is launched; nothing the caller passed is modified."""

from __future__ import annotations

import math

import pytest
import torch

import jfa
from tests.helpers import jagged_inputs, offsets


class Recorder:
    """A backend that records whether it was ever launched."""

    name = "recorder"
    description = "records launches"

    def __init__(self):
        self.launched = 0

    def unavailable(self, device):
        return None

    def __call__(self, q, k, v, problem):
        self.launched += 1
        return q.new_zeros(problem.out_rows, problem.q_heads, problem.head_dim_v), q.new_zeros(
            problem.q_heads, problem.out_rows, dtype=torch.float32)


@pytest.fixture(autouse=True)
def fresh_offsets_cache(monkeypatch):
    """Each test starts without remembered offsets: `jfa.validation` keeps the last validated offsets of each
    size for the whole process, so a test that asserts which values a call first saw would otherwise depend on
    the tests that ran before it in the same worker (under xdist, on how the tests were distributed)."""
    from collections import OrderedDict

    from jfa import validation

    monkeypatch.setattr(validation, "_VALID", OrderedDict())


@pytest.fixture
def recorder():
    backend = Recorder()
    jfa.register_backend("recorder", backend)
    return backend


def base():
    q, k, v, q_off, kv_off, _ = jagged_inputs([3, 0, 2], [4, 2, 0], 4, 2, 16, 16)
    return dict(q=q, k=k, v=v, q_offsets=q_off, kv_offsets=kv_off)


def with_changes(**changes):
    args = base()
    args.update(changes)
    return args


BAD = [
    # (description, changes, error type, words the message must contain)
    ("decreasing offsets", dict(q_offsets=torch.tensor([0, 3, 2, 5], dtype=torch.int32)), ValueError,
     ["q_offsets", "non-decreasing"]),
    # int64 values beyond int32 that would wrap to valid ones ([0, 3, 3, 5]) if narrowed before the checks
    ("int64 offsets beyond int32", dict(q_offsets=torch.tensor([0, 3 + 2**32, 3, 5], dtype=torch.int64)),
     ValueError, ["q_offsets", "non-decreasing"]),
    ("first offset not 0", dict(kv_offsets=torch.tensor([1, 4, 6, 6], dtype=torch.int32)), ValueError,
     ["kv_offsets[0]", "0"]),
    ("last offset not rows", dict(q_offsets=torch.tensor([0, 3, 3, 4], dtype=torch.int32)), ValueError,
     ["q_offsets[-1]", "rows"]),
    ("B mismatch", dict(q_offsets=offsets([3, 2])), ValueError, ["B must match"]),
    ("float offsets", dict(q_offsets=offsets([3, 0, 2]).float()), TypeError, ["q_offsets", "int32 or int64"]),
    ("2-D offsets", dict(kv_offsets=offsets([4, 2, 0]).view(1, -1)), ValueError, ["kv_offsets", "1-D"]),
    ("heads not divisible", dict(k=torch.zeros(6, 3, 16, dtype=torch.bfloat16),
                                 v=torch.zeros(6, 3, 16, dtype=torch.bfloat16)), ValueError, ["multiple"]),
    ("float32 inputs", dict(q=torch.zeros(5, 4, 16)), TypeError, ["q.dtype", "bfloat16 or torch.float16"]),
    ("dtype mismatch", dict(k=torch.zeros(6, 2, 16, dtype=torch.float16)), TypeError, ["k.dtype", "q.dtype"]),
    ("head dim mismatch", dict(k=torch.zeros(6, 2, 24, dtype=torch.bfloat16)), ValueError, ["head dim"]),
    ("unsupported head dim", dict(q=torch.zeros(5, 4, 264, dtype=torch.bfloat16),
                                  k=torch.zeros(6, 2, 264, dtype=torch.bfloat16)), ValueError, ["264", "256"]),
    ("head dim not a multiple of 8", dict(v=torch.zeros(6, 2, 12, dtype=torch.bfloat16)), ValueError, ["12", "8"]),
    ("v rows differ", dict(v=torch.zeros(7, 2, 16, dtype=torch.bfloat16)), ValueError, ["v's rows"]),
    ("q not 3-D", dict(q=torch.zeros(5, 64, dtype=torch.bfloat16)), ValueError, ["q", "3 dimensions"]),
    ("q not a tensor", dict(q=[[1.0]]), TypeError, ["q", "torch.Tensor"]),
    ("missing q_offsets", dict(q_offsets=None), ValueError, ["q_offsets", "required"]),
]


@pytest.mark.parametrize("changes,error,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_before_launch(recorder, changes, error, words):
    args = with_changes(**changes)
    snapshot = {name: x.clone() for name, x in args.items() if isinstance(x, torch.Tensor)}
    with pytest.raises(error) as raised:
        jfa.attention(**args, backend="recorder")
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
    assert recorder.launched == 0
    for name, x in snapshot.items():
        assert torch.equal(args[name], x), f"{name} was modified"


KEYWORD_BAD = [
    ("max_q_len too small", dict(max_q_len=2), ValueError, ["max_q_len", "longest"]),
    ("max_kv_len too small", dict(max_kv_len=3), ValueError, ["max_kv_len", "longest"]),
    ("negative window", dict(window=-1), ValueError, ["window", ">= 0"]),
    ("float window", dict(window=2.0), TypeError, ["window"]),
    ("infinite scale", dict(sm_scale=math.inf), ValueError, ["sm_scale", "finite"]),
    ("nan scale", dict(sm_scale=math.nan), ValueError, ["sm_scale", "finite"]),
    ("non-bool causal", dict(causal=1), TypeError, ["causal", "bool"]),
    ("unknown backend", dict(backend="nope"), ValueError, ["backend", "nope"]),
    ("q_offsets with broadcast_q", dict(broadcast_q=True), ValueError, ["q_offsets", "broadcast_q"]),
]


@pytest.mark.parametrize("kwargs,error,words", [b[1:] for b in KEYWORD_BAD], ids=[b[0] for b in KEYWORD_BAD])
def test_bad_keyword_raises_before_launch(recorder, kwargs, error, words):
    kwargs.setdefault("backend", "recorder")
    with pytest.raises(error) as raised:
        jfa.attention(**base(), **kwargs)
    for word in words:
        assert word in str(raised.value)
    assert recorder.launched == 0


def test_device_mismatch_is_named():
    args = base()
    args["kv_offsets"] = args["kv_offsets"].to("meta")
    with pytest.raises(ValueError, match="kv_offsets is on meta"):
        jfa.attention(**args, backend="bf16-model")


def test_int64_offsets_are_converted_not_modified(recorder):
    args = base()
    args["q_offsets"] = args["q_offsets"].long()
    before = args["q_offsets"].clone()
    jfa.attention(**args, backend="recorder")
    assert recorder.launched == 1 and args["q_offsets"].dtype == torch.int64
    assert torch.equal(args["q_offsets"], before)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernel_offsets_are_int32_copies(dtype):
    """The kernels' offsets equal the caller's, as new contiguous int32 tensors: writing the caller's
    afterwards (a reused buffer) changes nothing the backward would read; out rows follow q's."""
    from jfa.validation import validate

    args = base()
    q_off = torch.zeros(8, dtype=dtype)[::2]  # a strided view: the kernels index offsets + b
    q_off.copy_(args["q_offsets"])
    kv_off = args["kv_offsets"].to(dtype)
    problem = validate(args["q"], args["k"], args["v"], q_off, kv_off, max_q_len=None, max_kv_len=None,
                       sm_scale=None, window=None, causal=False, broadcast_q=False, deterministic=False)
    for given, made in ((q_off, problem.q_offsets), (q_off, problem.out_offsets), (kv_off, problem.kv_offsets)):
        assert made.dtype == torch.int32 and made.is_contiguous() and torch.equal(made.long(), given.long())
    assert torch.equal(problem.q_offsets_host, q_off.long()) and torch.equal(problem.kv_offsets_host, kv_off.long())
    q_off.zero_()
    kv_off.zero_()
    assert problem.q_offsets.tolist() == [0, 3, 3, 5] and problem.kv_offsets.tolist() == [0, 4, 6, 6]


def test_broadcast_offsets_are_made_for_the_kernels():
    from jfa.validation import validate

    q = torch.randn(5, 2, 16).bfloat16()
    k = torch.randn(7, 1, 16).bfloat16()
    problem = validate(q, k, k, None, offsets([3, 0, 4]), max_q_len=None, max_kv_len=None, sm_scale=None,
                       window=None, causal=False, broadcast_q=True, deterministic=False)
    assert problem.q_offsets.tolist() == [0, 0, 0, 0]  # every sequence reads the one shared q
    assert problem.out_offsets.tolist() == [0, 5, 10, 15] == problem.out_offsets_host.tolist()
    assert problem.q_offsets.dtype == problem.out_offsets.dtype == torch.int32
    kv_off = offsets([3, 0, 4])
    problem = validate(q, k, k, None, kv_off, max_q_len=None, max_kv_len=None, sm_scale=None,
                       window=None, causal=False, broadcast_q=True, deterministic=False)
    kv_off.zero_()  # the kernels' kv offsets are a copy, not the caller's tensor
    assert problem.kv_offsets.tolist() == [0, 3, 3, 7]


def _problem(args, **kwargs):
    from jfa.validation import validate

    options = dict(max_q_len=None, max_kv_len=None, sm_scale=None, window=None, causal=False, broadcast_q=False,
                   deterministic=False)
    options.update(kwargs)
    return validate(args["q"], args["k"], args["v"], args["q_offsets"], args["kv_offsets"], **options)


def test_repeated_offsets_are_recognised_by_value():
    """Offsets equal to validated ones (another tensor, same values) reuse their host work and name the same
    lengths; the same tensor written in place with other values is validated again and named anew."""
    args = base()
    first = _problem(args)
    again = _problem(dict(args, q_offsets=args["q_offsets"].clone(), kv_offsets=args["kv_offsets"].clone()))
    assert again.lengths_key == first.lengths_key
    assert again.q_lens.tolist() == [3, 0, 2] and again.kv_lens.tolist() == [4, 2, 0]
    args["q_offsets"].copy_(offsets([1, 2, 2]))  # in place: no new tensor, same size, other values
    moved = _problem(args)
    assert moved.lengths_key != first.lengths_key
    assert moved.q_lens.tolist() == [1, 2, 2] and moved.q_offsets.tolist() == [0, 1, 3, 5]


def test_repeated_offsets_are_checked_against_each_calls_shapes():
    """The rules that involve the tensors' shapes apply on every call, also to offsets validated before;
    same-size offsets that break a value rule are never taken for validated ones."""
    args = base()
    _problem(args)
    with pytest.raises(ValueError, match=r"q_offsets\[-1\] = 5 must equal the number of q rows, 6"):
        _problem(dict(args, q=torch.zeros(6, 4, 16, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="q_offsets must be non-decreasing"):
        _problem(dict(args, q_offsets=torch.tensor([0, 3, 2, 5], dtype=torch.int32)))
    with pytest.raises(ValueError, match="max_q_len = 2 is smaller than the longest sequence, 3"):
        _problem(args, max_q_len=2)


def test_broadcast_rows_follow_the_shared_query_length():
    """With broadcast_q the output rows follow q's length on every call, also on kv offsets seen before."""
    k = torch.randn(7, 1, 16).bfloat16()
    kv_off = offsets([3, 0, 4])
    problems = [_problem(dict(q=torch.randn(rows, 2, 16).bfloat16(), k=k, v=k, q_offsets=None, kv_offsets=kv_off),
                         broadcast_q=True) for rows in (5, 2, 5)]
    assert [p.out_offsets.tolist() for p in problems] == [[0, 5, 10, 15], [0, 2, 4, 6], [0, 5, 10, 15]]
    assert [p.q_lens.tolist() for p in problems] == [[5, 5, 5], [2, 2, 2], [5, 5, 5]]
    assert problems[0].lengths_key == problems[2].lengths_key != problems[1].lengths_key


class SpeculativeRecorder(Recorder):
    """A backend that takes speculative problems: it records the lengths it was given before and after
    confirming, as a kernel backend's host work and launch would see them."""

    speculative = True

    def __init__(self):
        super().__init__()
        self.attempts = []

    def __call__(self, q, k, v, problem):
        self.attempts.append(problem.q_lens.tolist())
        problem.confirm()
        return super().__call__(q, k, v, problem)


def test_speculative_problem_on_changed_offsets_is_never_launched_on():
    """Offsets written in place between two calls (same size, new values): the second call's speculative
    problem holds the earlier values until confirmed, confirming raises StaleOffsets, and the call is run
    again on the caller's values; on unchanged offsets the speculation holds."""
    from jfa.problem import StaleOffsets

    backend = SpeculativeRecorder()
    jfa.register_backend("speculative-recorder", backend)
    args = base()
    jfa.attention(**args, backend="speculative-recorder")
    jfa.attention(**args, backend="speculative-recorder")
    args["q_offsets"].copy_(offsets([1, 2, 2]))
    stale = _problem(args, speculative=True)
    assert stale.q_lens.tolist() == [3, 0, 2]
    with pytest.raises(StaleOffsets):
        stale.confirm()
    jfa.attention(**args, backend="speculative-recorder")
    assert backend.attempts == [[3, 0, 2]] * 3 + [[1, 2, 2]]  # the third call's first attempt stopped
    assert backend.launched == 3


def test_speculative_rule_failure_is_checked_on_the_callers_values():
    """A rule that only the remembered values break (max_q_len below their longest sequence, not below the
    caller's) raises nothing; one the caller's values break raises as always."""
    args = base()
    _problem(args)
    args["q_offsets"].copy_(offsets([1, 2, 2]))
    problem = _problem(args, max_q_len=2, speculative=True)
    problem.confirm()
    assert problem.max_q_len == 2 and problem.q_lens.tolist() == [1, 2, 2]
    with pytest.raises(ValueError, match="max_q_len = 1 is smaller than the longest sequence, 2"):
        _problem(args, max_q_len=1, speculative=True)


def test_valid_edge_cases_are_accepted(recorder):
    """B = 0, all-empty batches and broadcast_q with q_offsets None are valid."""
    empty = torch.zeros(0, 2, 16, dtype=torch.bfloat16)
    zero = torch.zeros(1, dtype=torch.int32)
    jfa.attention(empty, empty, empty, zero, zero, backend="recorder")
    none = offsets([0, 0, 0])
    jfa.attention(empty, empty, empty, none, none, causal=True, window=0, backend="recorder")
    q = torch.randn(5, 2, 16).bfloat16()
    k = torch.randn(7, 1, 16).bfloat16()
    jfa.attention(q, k, k, None, offsets([3, 4]), broadcast_q=True, backend="recorder")
    assert recorder.launched == 3


def test_unavailable_backend_is_a_clear_error():
    reason = jfa.backends.get("torch-varlen").unavailable(torch.device("cpu"))
    assert reason and "CUDA" in reason
    with pytest.raises(RuntimeError, match="torch-varlen.*unavailable"):
        jfa.attention(**base(), backend="torch-varlen")
