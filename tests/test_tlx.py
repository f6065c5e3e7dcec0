"""The TLX backend without a GPU: availability reasons, lazy import, host planning (routes, tile tables, TMA
descriptor layouts, the tiny-sequence sub-batch) and, where fbtriton is installed, the sm_90 compile check.

The kernel itself needs an sm_90 GPU: `python -m jfa.tlx.gpu_selftest` checks it there.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

_TRITON_WAS_IMPORTED = "triton" in sys.modules
if not _TRITON_WAS_IMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"  # as tests/test_triton_backend.py: the Triton sub-batch runs interpreted

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from jfa import tile_scheduler as ts  # noqa: E402
from tests.helpers import interpreter_unavailable, jagged_inputs, offsets, problem_of, rows_of  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK = 64  # the Triton backend's packed tile at D <= 128 on the GPU


def _fbtriton_present() -> bool:
    """Whether the importable triton is fbtriton (has TLX), found without importing triton."""
    spec = importlib.util.find_spec("triton")
    return spec is not None and any(os.path.exists(os.path.join(p, "language", "extra", "tlx", "__init__.py"))
                                    for p in spec.submodule_search_locations or [])


def _env_without_interpreter() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _problem(q_lens, kv_lens, hq=4, hkv=2, d=128, dv=None, **kwargs):
    q, k, v, q_off, kv_off, _ = jagged_inputs(q_lens, kv_lens, hq, hkv, d, dv or d,
                                              broadcast_q=kwargs.get("broadcast_q", False))
    return (q, k, v), problem_of(q, k, v, q_off, kv_off, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Import and availability


def test_import_is_lazy_and_registered():
    # fbtriton's own `import triton` loads tlx; what must stay lazy is the kernel module.
    code = ("import sys, jfa, jfa.tlx.backend as b; from jfa import backends; "
            "assert backends.get('tlx') is b.BACKEND; "
            "assert 'jfa.tlx.forward' not in sys.modules, 'kernel module imported eagerly'; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env_without_interpreter(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_unavailable_reasons(monkeypatch):
    from jfa.tlx import backend

    real = backend.tlx_missing()
    if not _fbtriton_present():
        assert real.startswith("fbtriton (Triton with TLX) is not installed")
        assert backend.BACKEND.unavailable(torch.device("cpu")) == real
    monkeypatch.setattr(backend, "tlx_missing", lambda: "fbtriton (Triton with TLX) is not installed: test")
    assert "not installed" in backend.BACKEND.unavailable(torch.device("cuda"))

    monkeypatch.setattr(backend, "tlx_missing", lambda: None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in backend.BACKEND.unavailable(torch.device("cpu"))
    for arch, reason in ((90, None), (80, "no TLX kernel for sm_80 yet"), (100, "no TLX kernel for sm_100 yet"),
                         (120, "no TLX kernel for sm_120 yet")):
        monkeypatch.setattr(backend, "device_facts", lambda device, a=arch: (a, 132))
        got = backend.BACKEND.unavailable(torch.device("cuda"))
        assert got == reason if reason is None else got.startswith(reason), (arch, got)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" in backend.BACKEND.unavailable(torch.device("cuda"))


@pytest.mark.parametrize("dims,kv_rows,broadcast_q,dkv,dq", [
    ((128, 128), 5, False, True, True), ((64, 64), 5, False, True, True), ((128, 128), 0, False, True, False),
    ((128, 128), 5, True, True, False), ((96, 96), 5, False, False, False), ((128, 64), 5, False, False, False),
    ((256, 256), 5, False, False, False)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_is_the_triton_backward_with_the_tlx_passes(monkeypatch, dims, kv_rows, broadcast_q, dkv, dq,
                                                             deterministic):
    """The tlx backward is the Triton backend's, given the TLX dK/dV pass exactly where the TLX kernels cover
    the head dims (D = Dv in CONFIGS) and the TLX dQ pass where, besides, there are key rows (a TMA descriptor
    needs one) and no broadcast_q; without deterministic, where the dK/dV pass runs with key rows, that pass
    adds dq itself (dq_in_dkv) and no dQ pass is given. The TLX short-query pass wherever the dK/dV pass runs
    with key rows, in both modes (it is deterministic)."""
    from types import SimpleNamespace

    from jfa.tlx import backend
    from jfa.triton import backend as triton_backend

    seen = []
    monkeypatch.setattr(triton_backend.BACKEND, "backward",
                        lambda *args, **kwargs: seen.append((args, kwargs)) or "grads")
    problem = SimpleNamespace(head_dim=dims[0], head_dim_v=dims[1], kv_rows=kv_rows, broadcast_q=broadcast_q,
                              deterministic=deterministic)
    args = ("dout", "q", "k", "v", "out", "lse", ("m", "l"), problem)
    assert backend.BACKEND.backward(*args) == "grads"
    short = backend._launch_short if dkv and kv_rows else None
    if dkv and kv_rows and not deterministic:
        assert seen == [(args, {"dkv_pass": backend._launch_dkv, "dq_in_dkv": True, "short_pass": short})]
    else:
        assert seen == [(args, {"dkv_pass": backend._launch_dkv if dkv else None,
                                "dq_pass": backend._launch_dq if dq else None, "short_pass": short})]


def test_short_query_table_blocks_are_the_tlx_short_pass_blocks():
    """The TLX short-query pass walks the Triton short-query table with that table's blocks (its tiles are
    sorted by, and its key ranges computed in, key blocks of that size) at every head dim the pass covers."""
    from jfa.tlx import backend
    from jfa.triton import backend as triton_backend

    for d in backend.CONFIGS:
        cfg = triton_backend.gpu_config(triton_backend.padded_dim(d)).short_bwd
        assert (cfg.block_m, cfg.block_n) == (backend.SHORT_BLOCK_M, backend.SHORT_BLOCK_N), d


@pytest.mark.parametrize("deterministic", [True, False])
def test_triton_backward_runs_a_given_short_pass_instead_of_its_kernel(small_blocks, monkeypatch, deterministic):
    """With `short_pass` the Triton backward leaves dq, dk and dv of the short-query sequences to it: called
    once with the host schedule, the forward's output (it computes its rows' D, as the Triton short-query
    kernel does) and the dq output (not partial without broadcast_q and dq_in_dkv). D of every row is computed
    by the D kernel once, only for the dq_in_dkv dK/dV pass that reads it."""
    from verify.runner import nan_filled_allocations

    triton_backend = small_blocks
    q_lens, kv_lens = [20, 30, 5, 150, 0], [100, 60, 200, 120, 40]
    (q, k, v), problem = _problem(q_lens, kv_lens, hq=2, hkv=2, d=16, deterministic=deterministic)
    out, lse, residuals = triton_backend.BACKEND.forward(q, k, v, problem)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    want = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem)
    sched = triton_backend.device_schedule(problem, triton_backend.SMALL_BLOCKS)
    short = np.unique(sched.host.short_bwd.entries[:, 0])
    assert short.tolist() == [0, 1, 2]
    q_rows = torch.from_numpy(rows_of(problem.q_offsets_host.numpy(), np.asarray(q_lens), short))
    kv_rows = torch.from_numpy(rows_of(problem.kv_offsets_host.numpy(), np.asarray(kv_lens), short))
    deltas = []
    real_delta = triton_backend._delta
    monkeypatch.setattr(triton_backend, "_delta", lambda *a: deltas.append(a) or real_delta(*a))
    calls = []

    def short_pass(q, k, v, out_given, dout, dq, dk, dv, row_max, row_sum, table, problem, partial):
        calls.append((table, torch.equal(out_given, out), partial, dq.dtype,
                      bool(dk[kv_rows].isnan().all() and dv[kv_rows].isnan().all())))
        dq[q_rows] = want[0][q_rows].to(dq.dtype)
        dk[kv_rows] = want[1][kv_rows]
        dv[kv_rows] = want[2][kv_rows]

    dkv_pass = None
    if not deterministic:  # the tlx backend's one-pass mode: the dK/dV pass adds dq (here the Triton one's)
        def dkv_pass(q, k, v, dout, dk, dv, row_max, row_sum, delta, table, problem, dq):
            torch.testing.assert_close(delta, (dout.float() * out.float()).sum(-1).T, rtol=1e-6, atol=1e-6)
            ordinary = torch.from_numpy(rows_of(problem.q_offsets_host.numpy(), np.asarray(q_lens), [3]))
            dk.copy_(torch.where(dk.isnan(), want[1], dk))
            dv.copy_(torch.where(dv.isnan(), want[2], dv))
            dq[ordinary] += want[0][ordinary].float()

    with nan_filled_allocations():
        got = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem, dkv_pass=dkv_pass,
                                              dq_in_dkv=not deterministic, short_pass=short_pass)
    assert len(calls) == 1 and len(deltas) == (0 if deterministic else 1)
    table, out_given, partial, dq_dtype, unwritten = calls[0]
    assert table is sched.host and out_given and unwritten
    assert partial == (not deterministic) and dq_dtype == (torch.float32 if partial else q.dtype)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_broadcast_dq_reduction_sums_the_partials_a_short_pass_lists(small_blocks):
    """A short pass that returns its partials' sources (the TLX pass's segments under broadcast_q): the
    reduction sums, per head, those sequences' fp32 rows in the listed order and no other (the rest stay
    NaN-filled here: reading one would show)."""
    from verify.runner import nan_filled_allocations

    triton_backend = small_blocks
    q_lens, kv_lens = [20] * 4, [100, 60, 200, 40]
    (q, k, v), problem = _problem(q_lens, kv_lens, hq=2, hkv=2, d=16, broadcast_q=True)
    out, lse, residuals = triton_backend.BACKEND.forward(q, k, v, problem)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out.dtype)
    want = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem)
    sched = triton_backend.device_schedule(problem, triton_backend.SMALL_BLOCKS).host
    assert np.unique(sched.short_bwd.entries[:, 0]).tolist() == [0, 1, 2, 3]
    quarter = want[0].float() / 4  # exact: the listed partials' sum is want's dq whatever their order
    # head 0 in sequences 3 and 1 (1 holding three quarters), head 1 in sequence 2 alone
    sources = torch.tensor([[3, 1], [2, -1]], dtype=torch.int32)

    def short_pass(q, k, v, out, dout, dq, dk, dv, row_max, row_sum, schedule, problem, partial):
        assert partial and dq.dtype == torch.float32
        dq[3 * 20:4 * 20, 0] = quarter[:, 0]
        dq[1 * 20:2 * 20, 0] = 3 * quarter[:, 0]
        dq[2 * 20:3 * 20, 1] = 4 * quarter[:, 1]
        dk.copy_(want[1])
        dv.copy_(want[2])
        return sources

    with nan_filled_allocations():
        got = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem, short_pass=short_pass)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_short_lists_deal_the_short_table_and_list_every_partial(broadcast_q):
    """The TLX short-query pass's lists (`short_lists`): the Triton short-query table's tiles dealt to the
    programs (segments per head with broadcast_q, `ts.program_lists`), the table and lists copied to the
    device once per schedule; with broadcast_q the reduction's sources are, per head, the segments' sequences
    and then every packed sequence (the Triton packed kernel writes each one's partial)."""
    from jfa.tlx import backend
    from jfa.triton import backend as triton_backend

    q_lens = [30] * 6 if broadcast_q else [100, 30, 128, 20, 64, 50]
    kv_lens = [700, 10, 300, 20, 32, 129]  # with broadcast_q, 1, 3 and 4 are packed (D 128: 32 rows and keys)
    (_, _, _), problem = _problem(q_lens, kv_lens, hq=2, hkv=2, broadcast_q=broadcast_q)
    schedule = triton_backend.device_schedule(problem, triton_backend.config_for(problem)).host
    packed = np.sort(schedule.packed_bwd.seqs[schedule.packed_bwd.seqs >= 0])
    tiles, rows, starts, sources = backend.short_lists(problem, schedule, 3, broadcast_q)
    lists = ts.program_lists(schedule.short_bwd, 3, broadcast_q)
    assert torch.equal(tiles.cpu(), torch.from_numpy(schedule.short_bwd.entries.ravel()))
    assert torch.equal(rows.cpu(), torch.from_numpy(lists.rows.ravel()))
    assert torch.equal(starts.cpu(), torch.from_numpy(lists.starts))
    if broadcast_q:
        assert packed.tolist() == [1, 3, 4]
        want = np.concatenate([lists.sources, np.broadcast_to(packed, (2, 3))], axis=1)
        assert torch.equal(sources.cpu(), torch.from_numpy(want.astype(np.int32)))
    else:
        assert sources is None
    assert backend.short_lists(problem, schedule, 3, broadcast_q)[1] is rows  # copied once


@pytest.fixture
def small_blocks():
    """The Triton backend under the interpreter with SMALL_BLOCKS (many block edges at these sizes)."""
    reason = interpreter_unavailable()
    if reason:
        pytest.skip(reason)
    from jfa.triton import backend as triton_backend

    triton_backend.set_config(triton_backend.SMALL_BLOCKS)
    yield triton_backend
    triton_backend.set_config(None)


# A batch with ordinary, kv-empty, q-empty and (at SMALL_BLOCKS) packed sequences, and GQA.
HOOK_Q_LENS, HOOK_KV_LENS = [150, 70, 0, 90, 20], [120, 80, 30, 0, 20]


def _hook_case(triton_backend):
    """(q, k, v, problem, out, lse, residuals, dout, want: the Triton backward's gradients, host schedule) of
    the hook tests' batch."""
    (q, k, v), problem = _problem(HOOK_Q_LENS, HOOK_KV_LENS, hq=4, hkv=2, d=16)
    out, lse, residuals = triton_backend.BACKEND.forward(q, k, v, problem)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    want = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem)
    host = triton_backend.device_schedule(problem, triton_backend.SMALL_BLOCKS).host
    return q, k, v, problem, out, lse, residuals, dout, want, host


def test_triton_backward_runs_a_given_dkv_pass_instead_of_its_kernel(small_blocks):
    """With `dkv_pass` the Triton backward leaves dk and dv of the ordinary sequences to it: called once, after
    the dQ pass has stored D for their rows, with the dK/dV tile table; dq is the same as without it."""
    from verify.runner import nan_filled_allocations

    q, k, v, problem, out, lse, residuals, dout, want, host = _hook_case(small_blocks)
    table = host.dkv
    seqs = np.unique(table.entries[:, 0])
    key_rows = torch.from_numpy(rows_of(problem.kv_offsets_host.numpy(), np.asarray(HOOK_KV_LENS), seqs))
    calls = []

    def dkv_pass(*args):
        dk, dv = args[4], args[5]
        # Nothing wrote these sequences' dk and dv yet (fresh allocations are NaN-filled here).
        calls.append(args + (bool(dk[key_rows].isnan().all() and dv[key_rows].isnan().all()),))
        dk.fill_(7.0)
        dv.fill_(-7.0)

    with nan_filled_allocations():
        got = small_blocks.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem, dkv_pass=dkv_pass)
    assert len(calls) == 1 and calls[0][9] is table and calls[0][10] is problem and calls[0][11]
    delta = calls[0][8]
    rows = torch.from_numpy(rows_of(problem.out_offsets_host.numpy(), np.asarray(HOOK_Q_LENS), seqs))
    want_delta = (dout.float() * out.float()).sum(-1).T
    torch.testing.assert_close(delta[:, rows], want_delta[:, rows], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], want[0])
    assert (got[1] == 7).all() and (got[2] == -7).all()
    assert not (want[1] == 7).all()


def test_triton_backward_runs_a_given_dq_pass_instead_of_its_kernel(small_blocks):
    """With `dq_pass` (and no broadcast_q) the Triton backward leaves dq and D of the ordinary sequences to it:
    called once with the dQ tile table and the dq output, before the dK/dV pass, which reads the D it stored."""

    q, k, v, problem, out, lse, residuals, dout, want, host = _hook_case(small_blocks)
    table = host.dq
    rows = torch.from_numpy(rows_of(problem.out_offsets_host.numpy(), np.asarray(HOOK_Q_LENS),
                                    np.unique(table.entries[:, 0])))
    calls = []

    def dq_pass(*args):
        calls.append(args)
        dq, delta = args[5], args[8]
        dq[rows] = 3.0
        delta[:, rows] = (dout.float() * out.float()).sum(-1).T[:, rows]

    got = small_blocks.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem, dq_pass=dq_pass)
    assert len(calls) == 1 and calls[0][9] is table and calls[0][10] is problem and calls[0][5] is got[0]
    other = torch.ones(got[0].shape[0], dtype=torch.bool)
    other[rows] = False
    assert (got[0][rows] == 3).all() and torch.equal(got[0][other], want[0][other])
    for g, w in zip(got[1:], want[1:], strict=True):  # dK/dV from the hook's D (torch's sum: a few ulps off)
        torch.testing.assert_close(g.float(), w.float(), rtol=2**-6, atol=2**-6)


def test_dq_in_dkv_without_ordinary_sequences_is_the_usual_backward(small_blocks, monkeypatch):
    """A batch of packed sequences only has no dK/dV tiles: `dq_in_dkv` then changes nothing (no D kernel,
    no fp32 dq to reduce: on the H200 that mode made the all-tiny row's backward 1.5x slower), and the
    gradients are the usual backward's bits."""
    from jfa.triton import backward as bwd_kernels

    triton_backend = small_blocks
    for name in ("_delta_kernel", "_dq_reduce_kernel"):
        monkeypatch.setattr(bwd_kernels, name, None)  # launching one fails
    (q, k, v), problem = _problem([3, 9, 1, 12], [5, 9, 2, 16], hq=4, hkv=2, d=16)
    assert triton_backend.device_schedule(problem, triton_backend.SMALL_BLOCKS).host.dkv.n_tiles == 0
    out, lse, residuals = triton_backend.BACKEND.forward(q, k, v, problem)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    want = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem)

    def no_pass(*args, **kwargs):
        raise AssertionError("no dK/dV pass runs without ordinary sequences")

    got = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem, dkv_pass=no_pass,
                                          dq_in_dkv=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_triton_backward_with_dq_in_dkv(small_blocks, broadcast_q):
    """With `dq_in_dkv` the Triton backward runs no dQ pass: it computes D of every row (`_delta_kernel`),
    hands the dK/dV pass a zeroed fp32 dq at the output rows (the packed sequences' rows already written
    there), and rounds what the pass adds (summed over the sequences in order for broadcast_q) into dq."""
    from verify.runner import nan_filled_allocations

    triton_backend = small_blocks
    q_lens = [20] * 4 if broadcast_q else [150, 70, 0, 90, 20]
    kv_lens = [120, 10, 0, 60] if broadcast_q else [120, 80, 30, 0, 20]
    (q, k, v), problem = _problem(q_lens, kv_lens, hq=4, hkv=2, d=16, broadcast_q=broadcast_q)
    out, lse, residuals = triton_backend.BACKEND.forward(q, k, v, problem)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    want = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem)
    sched = triton_backend.device_schedule(problem, triton_backend.SMALL_BLOCKS).host
    ordinary = np.unique(sched.dkv.entries[:, 0])
    packed = sched.packed_bwd.seqs[sched.packed_bwd.seqs >= 0]
    out_lens = np.asarray([q_lens[0]] * len(q_lens) if broadcast_q else q_lens)
    rows = torch.from_numpy(rows_of(problem.out_offsets_host.numpy(), out_lens, ordinary))
    packed_rows = torch.from_numpy(rows_of(problem.out_offsets_host.numpy(), out_lens, packed))
    seen = []

    def dkv_pass(q, k, v, dout, dk, dv, row_max, row_sum, delta, table, problem, dq):
        seen.append((table, delta.clone(), dq.clone()))
        dk.copy_(want[1])
        dv.copy_(want[2])
        dq[rows] += 0.25 * (rows.view(-1, 1, 1) % 7 + 1).float()  # what the pass adds, exact in fp32

    def dq_pass(*args):
        raise AssertionError("no dQ pass runs with dq_in_dkv")

    with nan_filled_allocations():  # so that a dq left unzeroed shows
        got = triton_backend.BACKEND.backward(dout, q, k, v, out, lse, residuals, problem, dkv_pass=dkv_pass,
                                              dq_pass=dq_pass, dq_in_dkv=True)
    assert len(seen) == 1 and seen[0][0] is sched.dkv and ordinary.size and packed.size
    table, delta, partial = seen[0]
    torch.testing.assert_close(delta, (dout.float() * out.float()).sum(-1).T, rtol=1e-6, atol=1e-6)
    assert (partial[rows] == 0).all() and (partial[packed_rows] != 0).any()
    partial[rows] += 0.25 * (rows.view(-1, 1, 1) % 7 + 1).float()
    parts = partial.view(len(q_lens), q_lens[0], *partial.shape[1:]) if broadcast_q else partial[None]
    expected = torch.zeros_like(parts[0])
    for part in parts:  # in sequence order, as _dq_reduce_kernel adds
        expected += part
    assert torch.equal(got[0], expected.to(got[0].dtype))
    if not broadcast_q:  # the packed rows, rounded once from fp32, are the ordinary backward's bits
        assert torch.equal(got[0][packed_rows], want[0][packed_rows])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_key_table_covers_the_ordinary_sequences_in_128_key_tiles():
    """The TLX dK/dV tiles: every 128-key block of each sequence of the Triton dK/dV table (and no other),
    times the key/value heads; cached per length profile."""
    from jfa.tlx import backend

    q_lens, kv_lens = [150, 70, 0, 90, 20], [300, 80, 30, 0, 20]
    _, problem = _problem(q_lens, kv_lens, hq=4, hkv=2, d=128)
    triton_table = ts.key_tiles(q_lens, kv_lens, np.array([0, 1, 2]), 64, 32, None, False, 2, 2)
    table, on_device = backend.key_table(problem, triton_table, None)
    want = {(s, n) for s in (0, 1, 2) for n in range(0, kv_lens[s], backend.BWD_BLOCK_N)}
    assert {tuple(e) for e in table.entries.tolist()} == want and len(table.entries) == len(want)
    assert table.heads == 2 and on_device == {}
    assert backend.key_table(problem, triton_table, None)[0] is table
    # The same lengths at another head dim, whose Triton backward packs other sequences: a table of its own.
    _, problem_64 = _problem(q_lens, kv_lens, hq=4, hkv=2, d=64)
    fewer = ts.key_tiles(q_lens, kv_lens, np.array([0, 1]), 64, 32, None, False, 2, 2)
    table_64, _ = backend.key_table(problem_64, fewer, None)
    assert {int(s) for s in table_64.entries[:, 0]} == {0, 1}


# ---------------------------------------------------------------------------------------------------------
# Routing and tile tables


@pytest.mark.parametrize("q_lens,kv_lens,dims,kwargs,path", [
    ([300, 20], [300, 20], (128, 128), {}, "tlx"),
    ([300, 20], [300, 20], (64, 64), dict(causal=True, window=5), "tlx"),
    ([300, 20], [300, 20], (80, 80), {}, "triton"),
    ([300, 20], [300, 20], (96, 96), {}, "triton"),
    ([300, 20], [300, 20], (256, 256), {}, "triton"),
    ([300, 20], [300, 20], (128, 64), {}, "triton"),
    ([30, 20, 64], [64, 1, 9], (128, 128), {}, "triton"),  # all tiny
    ([300, 200], [0, 0], (128, 128), {}, "fill"),  # no key rows at all
    ([0, 0], [30, 300], (128, 128), {}, "none"),
    ([], [], (128, 128), {}, "none"),
    ([0, 100, 0], [500, 0, 70], (128, 128), {}, "tlx"),
])
def test_route(q_lens, kv_lens, dims, kwargs, path):
    from jfa.tlx.backend import route

    _, problem = _problem(q_lens, kv_lens, d=dims[0], dv=dims[1], **kwargs)
    got, reason = route(problem, PACK)
    assert got == path, reason
    assert reason


def test_route_broadcast_q():
    from jfa.tlx.backend import route

    assert route(_problem([100] * 3, [0, 50, 700], broadcast_q=True)[1], PACK)[0] == "tlx"
    assert route(_problem([40] * 3, [0, 50, 64], broadcast_q=True)[1], PACK)[0] == "triton"


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 40), (True, 100)])
def test_plan_covers_every_row_once(causal, window):
    """TLX tiles (block_m rows × every query head) plus the tiny sub-batch cover each output row exactly
    once; tiles are the scheduler's query tiles of the non-tiny sequences, sorted by work."""
    from jfa.tlx.backend import CONFIGS, host_plan

    rng = np.random.default_rng(3)
    q_lens = [0, 1, 64, 65, 128, 129, 700, 3, 0, 4096] + [int(x) for x in rng.integers(0, 300, 30)]
    kv_lens = [5, 0, 64, 70, 100, 129, 0, 70, 0, 4000] + [int(x) for x in rng.integers(0, 300, 30)]
    _, problem = _problem(q_lens, kv_lens, causal=causal, window=window)
    plan = host_plan(problem, PACK)
    assert plan.path == "tlx"
    main, tiny = ts.split_packable(q_lens, kv_lens, PACK)
    np.testing.assert_array_equal(plan.tiny, tiny)
    cfg = CONFIGS[128]
    want = ts.query_tiles(q_lens, kv_lens, main, cfg.block_m, cfg.block_n, window, causal, problem.q_heads)
    np.testing.assert_array_equal(plan.tiles.entries, want.entries)
    assert plan.tiles.heads == problem.q_heads and (np.diff(plan.tiles.work) <= 0).all()

    covered = np.zeros((problem.q_heads, problem.out_rows), dtype=np.int64)
    out_off = problem.out_offsets_host.numpy()
    assert (plan.tiles.run_rows[:, 3] > 1).any(), "the 4096-row sequence's blocks are dealt head-major"
    for t in range(plan.tiles.n_tiles):
        seq, m0, head = plan.tiles.tile(t, runs=True)  # as the TLX kernels decode it
        rows = out_off[seq] + np.arange(m0, min(m0 + cfg.block_m, q_lens[seq]))
        covered[head, rows] += 1
    covered[:, rows_of(out_off, np.asarray(q_lens), tiny)] += 1
    assert (covered == 1).all()
    assert host_plan(problem, PACK) is plan  # cached per length profile


def _empty_inputs(case):
    """q, k, v of a case's shapes (never read: only the host plan is built from them) and its offsets."""
    q = torch.empty(case.q_tokens, case.q_heads, case.head_dim, dtype=torch.bfloat16)
    k = torch.empty(case.kv_tokens, case.kv_heads, case.head_dim, dtype=torch.bfloat16)
    v = torch.empty(case.kv_tokens, case.kv_heads, case.head_dim_v, dtype=torch.bfloat16)
    return q, k, v, None if case.broadcast_q else offsets(case.q_lens), offsets(case.kv_lens)


def test_premerge_profile_has_idle_halves_in_every_tlx_tile_kernel():
    """The TLX forward and dQ pass skip the work of a consumer whose 64 query rows all lie past the sequence
    (`_pass_tile`); the dK/dV pass computes a consumer's 64 keys past the sequence fully masked (where stray reads
    and 0·NaN would show; skipping them was measured slower, docs/performance-log.md). The GPU gate verifies those
    branches only if its profile has such tiles: count them over the premerge profile's cases on the TLX path, per
    mask kind."""
    from fixtures.families import case_from_id
    from fixtures.profiles import profile_case_ids
    from jfa.tlx.backend import host_plan, key_table, pack_block_for, query_table, tlx_dkv, tlx_dq
    from jfa.triton.backend import config_for, device_schedule, effective_window

    half = 64
    idle = {(kernel, kind): 0 for kernel in ("forward", "dq", "dkv") for kind in ("none", "causal", "window")}
    for case_id in profile_case_ids("premerge"):
        case = case_from_id(case_id)
        if case.head_dim != case.head_dim_v or not case.kv_tokens:
            continue
        problem = problem_of(*_empty_inputs(case), causal=case.causal, window=case.window,
                             broadcast_q=case.broadcast_q)
        plan = host_plan(problem, pack_block_for(problem))
        if not tlx_dkv(problem) or plan.path != "tlx":
            continue
        kind = "window" if case.window is not None else "causal" if case.causal else "none"
        q_lens, kv_lens = np.asarray(case.q_lens), np.asarray(case.kv_lens)
        window = None if problem.window is None else effective_window(problem)
        host = device_schedule(problem, config_for(problem)).host
        tables = [("forward", plan.tiles.entries, q_lens), ("dkv", key_table(problem, host.dkv, window)[0].entries,
                                                                   kv_lens)]
        if tlx_dq(problem):
            tables.append(("dq", query_table(problem, host.dq, window)[0].entries, q_lens))
        for kernel, entries, lens in tables:
            if len(entries):
                idle[kernel, kind] += bool((entries[:, 1] + half >= lens[entries[:, 0]]).any())
    assert min(idle.values()) >= 2, idle


def test_rows_of():

    off = np.array([0, 3, 3, 10, 12])
    lens = np.diff(off)
    np.testing.assert_array_equal(rows_of(off, lens, np.array([0, 2])), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(rows_of(off, lens, np.array([3, 1, 0])), [10, 11, 0, 1, 2])
    assert rows_of(off, lens, np.array([], dtype=np.int64)).size == 0


def test_config_reports_the_path():
    from jfa.tlx.backend import BACKEND

    _, problem = _problem([300, 20, 0], [250, 20, 3], causal=True, deterministic=True)
    info = BACKEND.config(problem)
    assert info["path"] == "tlx" and info["backward"] == "TLX dQ and dK/dV passes, Triton for the rest"
    reduce = BACKEND.config(_problem([300, 20, 0], [250, 20, 3], causal=True)[1])
    assert reduce["backward"] == ("TLX dK/dV pass adding dq by TMA reduce (deterministic=False), Triton for "
                                  "the rest")
    assert info["schedule"] == "static zigzag"
    assert info["block_m"] == 128 and info["tiles"] == 3 * 4 and info["triton_sequences"] == 2
    other = BACKEND.config(_problem([30], [30], d=80)[1])
    assert other["path"] == "triton" and other["backward"] == "triton"
    broadcast = BACKEND.config(_problem([300, 300], [250, 20], broadcast_q=True, deterministic=True)[1])
    assert broadcast["backward"] == "TLX dK/dV pass, Triton dQ, Triton for the rest"
    # Short queries (at most 128 rows, no GQA) take the TLX short-query pass in both modes; a batch of
    # them has no dK/dV tiles.
    for deterministic in (True, False):
        short = BACKEND.config(_problem([128] * 3, [700, 90, 0], hkv=4, broadcast_q=True,
                                        deterministic=deterministic)[1])
        assert short["backward"] == "TLX short-query pass, Triton for the rest"
    mixed = BACKEND.config(_problem([100, 300], [500, 400], hkv=4)[1])
    assert mixed["backward"] == ("TLX short-query pass, TLX dK/dV pass adding dq by TMA reduce "
                                 "(deterministic=False), Triton for the rest")
    # With GQA no sequence takes a short-query tile (each key's dk sums over the group's heads).
    assert BACKEND.config(_problem([100, 300], [500, 400], hkv=2)[1])["backward"] == (
        "TLX dK/dV pass adding dq by TMA reduce (deterministic=False), Triton for the rest")
    # Without ordinary sequences (no keys; only tiny ones) no TLX pass has a tile to run.
    no_keys = BACKEND.config(_problem([300, 20], [0, 0])[1])
    assert no_keys["path"] == "fill" and no_keys["backward"] == "triton"
    tiny = BACKEND.config(_problem([20] * 6, [17] * 6)[1])
    assert tiny["path"] == "triton" and tiny["backward"] == "triton"


# ---------------------------------------------------------------------------------------------------------
# TMA descriptor layouts


def _check_2d_view(x):
    """The descriptor's 2-D view of x (same storage) holds x[:, h, :] at columns [h·s_h, h·s_h + D)."""
    from jfa.tlx.backend import descriptor_layout

    shape, strides = descriptor_layout(x)
    flat = torch.as_strided(x, shape, strides)
    for h in range(x.shape[1]):
        col = h * x.stride(1)
        assert torch.equal(flat[:, col:col + x.shape[2]], x[:, h, :])


def test_descriptor_layouts_read_in_place_or_copy():
    from jfa.tlx.backend import descriptor_layout

    x = torch.randn(37, 4, 128).to(torch.bfloat16)
    assert descriptor_layout(x) == ([37, 512], [512, 1])
    _check_2d_view(x)
    fused = torch.randn(37, 3, 2, 64).to(torch.bfloat16)  # fused QKV: k = fused[:, 1]
    assert descriptor_layout(fused[:, 1]) == ([37, 128], [384, 1])
    _check_2d_view(fused[:, 1])
    padded = torch.randn(37, 4, 168).to(torch.bfloat16)[:, :, 8:136]  # 16-byte offset, head stride 168
    assert descriptor_layout(padded) == ([37, 3 * 168 + 128], [672, 1])
    _check_2d_view(padded)
    shared_heads = torch.randn(37, 1, 64).to(torch.bfloat16).expand(37, 8, 64)  # stride 0 over heads
    assert descriptor_layout(shared_heads) == ([37, 64], [64, 1])
    _check_2d_view(shared_heads)
    assert descriptor_layout(torch.randn(37, 4, 256).to(torch.bfloat16)[:, :, ::2]) is None  # head dim strided
    assert descriptor_layout(torch.randn(37, 4, 136).to(torch.bfloat16)[:, :, 4:132]) is None  # base misaligned
    assert descriptor_layout(torch.randn(37, 1, 12).to(torch.bfloat16)[:, :, :8]) is None  # row stride 24 bytes
    assert descriptor_layout(torch.randn(1, 4, 64).to(torch.bfloat16).expand(37, 4, 64)) is None  # rows aliased


def test_descriptors_are_made_at_the_launch_where_tma_reads_in_place():
    """A tensor TMA reads in place gets its descriptor at the launch (`jfa.launch.Deferred`, fingerprinted by the
    tensor's address, dtype, shape and strides), made with `descriptor_layout`'s view of it, or at once when not
    deferred (the forward's); a tensor it cannot read gets one of a contiguous copy at once, unless the kernel
    stores into it (`written`), which raises: the copy would lose the stores. The statistics likewise: deferred
    when contiguous and at least a box long, else a copy padded with zeros to a box."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from jfa.launch import Deferred
    from jfa.tlx.backend import _descriptor, _statistics_descriptor, descriptor_layout

    padded = torch.randn(37, 4, 168).to(torch.bfloat16)[:, :, 8:136]
    deferred, head_stride = _descriptor(padded, 64)
    assert isinstance(deferred, Deferred) and head_stride == 168
    made = deferred.value()
    assert isinstance(made, TensorDescriptor) and made.base is padded
    assert (list(made.shape), list(made.strides)) == tuple(descriptor_layout(padded))
    assert list(made.block_shape) == [64, 128]
    eager, head_stride = _descriptor(padded, 64, defer=False)  # the forward's: made now, the same descriptor
    assert isinstance(eager, TensorDescriptor) and eager.base is padded and head_stride == 168
    assert (eager.shape, eager.strides, eager.block_shape) == (made.shape, made.strides, made.block_shape)

    strided = torch.randn(37, 4, 256).to(torch.bfloat16)[:, :, ::2]
    eager, head_stride = _descriptor(strided, 64)
    assert isinstance(eager, TensorDescriptor) and head_stride == 128
    assert eager.base.is_contiguous() and torch.equal(eager.base, strided)
    with pytest.raises(RuntimeError, match="a copy would lose the stores"):  # a store target is never copied
        _descriptor(strided, 64, written=True)
    target = torch.empty(37, 4, 128, dtype=torch.bfloat16)  # as the op allocates dk and dv: in place
    stored, _ = _descriptor(target, 64, written=True)
    assert isinstance(stored, Deferred) and stored.value().base is target

    stats = torch.randn(4, 300)
    made = _statistics_descriptor(stats, 64)
    assert isinstance(made, Deferred)
    made = made.value()
    assert list(made.shape) == [1200] and list(made.block_shape) == [128]
    assert made.base.data_ptr() == stats.data_ptr() and torch.equal(made.base, stats.view(-1))
    short = torch.randn(1, 100)
    eager = _statistics_descriptor(short, 64)
    assert isinstance(eager, TensorDescriptor) and list(eager.shape) == [128]
    assert torch.equal(eager.base[:100], short[0]) and not eager.base[100:].any()


# ---------------------------------------------------------------------------------------------------------
# Paths that run without the kernel


def test_fill_and_none_paths_launch_nothing():
    from jfa.tlx.backend import BACKEND

    (q, k, v), problem = _problem([300, 5], [0, 0])
    out, lse, (row_max, row_sum) = BACKEND.forward(q, k, v, problem)
    assert out.shape == (305, 4, 128) and (out == 0).all()
    assert torch.isneginf(lse).all() and torch.isneginf(row_max).all() and (row_sum == 0).all()
    (q, k, v), problem = _problem([0, 0], [7, 300])
    out, lse, (row_max, row_sum) = BACKEND.forward(q, k, v, problem)
    assert out.shape == (0, 4, 128) and lse.shape == row_max.shape == row_sum.shape == (4, 0)


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_forward_is_the_triton_forward_with_the_tlx_kernel(monkeypatch, broadcast_q):
    """The tlx forward of a mixed batch is the Triton forward with the TLX kernel as its `fwd_pass`: the
    kernel is launched once with the plan whose tiles cover the ordinary sequences (those of the Triton
    forward's own tile table), the tiny sequences get exactly the Triton forward's bits from its packed kernel
    in place, and nothing else writes the ordinary sequences' rows."""
    reason = interpreter_unavailable()
    if reason:
        pytest.skip(reason)
    from jfa.tlx import backend
    from jfa.triton import backend as triton_backend

    q_lens = [20] * 5 if broadcast_q else [0, 20, 70, 3, 33, 0, 40, 130]
    kv_lens = [0, 50, 70, 3, 30] if broadcast_q else [5, 20, 65, 0, 33, 2, 90, 129]
    # D 64: a head dim the TLX kernel takes (the call routes to it), whose packed tile is 64 rows.
    (q, k, v), problem = _problem(q_lens, kv_lens, hq=4, hkv=2, d=64, causal=True, broadcast_q=broadcast_q)
    want_out, want_lse, (want_max, want_sum) = triton_backend.BACKEND.forward(q, k, v, problem)
    launches = []

    def launch_tlx(q, k, v, out, lse, row_max, row_sum, plan, problem):
        launches.append(plan)
        for x in (out, lse, row_max, row_sum):
            x.fill_(7.0)

    monkeypatch.setattr(backend, "_launch_tlx", launch_tlx)
    out, lse, (row_max, row_sum) = backend.BACKEND.forward(q, k, v, problem)
    plan = backend.host_plan(problem, backend.pack_block_for(problem))
    table = triton_backend.device_schedule(problem, triton_backend.config_for(problem)).host.fwd
    assert plan.path == "tlx" and plan.tiny.size and launches == [plan]
    assert set(np.unique(plan.tiles.entries[:, 0])) == set(np.unique(table.entries[:, 0]))
    tiny = torch.from_numpy(rows_of(problem.out_offsets_host.numpy(), np.asarray(q_lens), plan.tiny))
    ordinary = torch.ones(problem.out_rows, dtype=torch.bool)
    ordinary[tiny] = False
    assert torch.equal(out[tiny], want_out[tiny]) and (out[ordinary] == 7).all()
    for got, want in ((lse, want_lse), (row_max, want_max), (row_sum, want_sum)):
        assert torch.equal(got[:, tiny], want[:, tiny]) and (got[:, ordinary] == 7).all()


# ---------------------------------------------------------------------------------------------------------
# Compile-only check (fbtriton, no GPU)


@pytest.mark.skipif(not _fbtriton_present(), reason="fbtriton (Triton with TLX) is not installed")
def test_compile_check_sm90():
    proc = subprocess.run([sys.executable, "-m", "jfa.tlx.compile_check", "--quick"], cwd=ROOT,
                          env=_env_without_interpreter(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "COMPILE PASS" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-3000:]
