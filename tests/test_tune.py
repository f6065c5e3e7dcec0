"""jfa.triton.tune: the candidate grid, profiler-event matching, the ranking, the warm-up's partition and its
crash bookkeeping (the GPU half runs on the GPU machine only)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from jfa import bench
from jfa import tile_scheduler as ts
from jfa.triton import backward, forward, tune
from jfa.triton.backend import gpu_config


@pytest.mark.parametrize("block_d", [64, 128, 256])
@pytest.mark.parametrize("role", tune.ROLES)
def test_candidates_start_with_the_shipped_config_and_stay_in_bounds(role, block_d):
    if getattr(gpu_config(block_d), role) is None:
        with pytest.raises(ValueError, match=f"no {role} config ships"):
            tune.candidates(role, block_d)
        return
    cands = tune.candidates(role, block_d)
    assert cands[0] == getattr(gpu_config(block_d), role)
    assert 8 <= len(cands) <= (64 if role.startswith("packed") else 16)
    assert len({tune.runs_as(c) for c in cands}) == len(cands)  # no two launch alike
    largest = 128 if block_d <= 128 else 64  # blocks halved at head dim 256
    for c in cands:
        for block in (c.block_m, c.block_n):
            assert tune.MIN_BLOCK <= block <= largest and block & (block - 1) == 0, (role, block_d, c)
        assert c.num_warps in (4, 8)
        if c.max_registers is None:
            assert c.resident in ((1, 2, 4) if role.startswith("packed") else (1, 2)), c
        else:  # a register cap only where it lets more 4-warp packed programs share an SM's 65,536 registers
            assert role.startswith("packed") and c.num_warps == 4 and c.block_m <= 64 and c.stages[0] <= 2, c
            threads = 32 * c.num_warps
            assert c.resident * threads * c.max_registers <= 65536 < (c.resident + 1) * threads * c.max_registers
        # several programs per SM only where several fit: 4 warps on <= 64 rows, or an 8-warp packed tile
        assert c.resident == 1 or (c.block_m <= 64 and (c.num_warps == 4 or role.startswith("packed"))), c
        if role.startswith("packed"):
            assert c.block_m == c.block_n and c.block_m % ts.PACK_ALIGN == 0 and c.block_m >= 2 * ts.PACK_ALIGN, c
    assert all(len(c.stages) == 1 for c in cands[1:])  # what is timed is what would ship


def test_the_grid_shrinks_with_the_head_dim():
    for role in tune.ROLES:
        if getattr(gpu_config(256), role) is None:
            continue
        tiles = {bd: max(c.block_m * c.block_n for c in tune.candidates(role, bd)[1:]) for bd in (128, 256)}
        assert tiles[256] < tiles[128], role


def test_kernel_names_are_the_kernels():
    for name in tune.JFA_KERNELS:
        if name in tune.TLX_KERNELS:  # modules that import only under fbtriton: their source defines them
            tlx_sources = [Path(forward.__file__).parents[1] / "tlx" / f for f in ("forward.py", "backward.py")]
            assert any(f"def {name}(" in path.read_text() for path in tlx_sources), name
        else:
            assert hasattr(forward, name) or hasattr(backward, name), name
    assert set(tune.KERNELS) == set(tune.ROLES) == set(tune.ROLE_KERNELS) == set(tune.ROLE_ROWS)
    assert all(tune.KERNELS[role] == tune.ROLE_KERNELS[role][0] for role in tune.ROLES)


@pytest.mark.parametrize(("event", "kernel"), [
    ("_fwd_kernel", "_fwd_kernel"),
    ("_fwd_kernel_0d1d2d3de4de5c", "_fwd_kernel"),  # older Tritons append the signature
    ("_fwd_packed_kernel", "_fwd_packed_kernel"),
    ("_dq_kernel", "_dq_kernel"),
    ("_dkv_kernel", "_dkv_kernel"),
    ("_bwd_packed_kernel", "_bwd_packed_kernel"),
    ("_bwd_short_kernel", "_bwd_short_kernel"),
    ("_dq_reduce_kernel", "_dq_reduce_kernel"),
    ("_delta_kernel", "_delta_kernel"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>(int, ...)", None),
    ("Memset (Device)", None),
    ("my_fwd_kernel", None),
    ("_fwd_kernelx", None),
])
def test_kernel_of_matches_profiler_names(event, kernel):
    assert tune.kernel_of(event) == kernel


def test_kernel_ms_sums_device_events_per_kernel_and_role_ms_picks_the_roles():
    def device(name, us):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, device_time_total=us)

    events = [
        device("_fwd_packed_kernel", 300.0), device("_fwd_packed_kernel", 500.0),
        device("_fwd_kernel_0d1d", 1000.0),
        SimpleNamespace(name="_fwd_kernel", device_type=DeviceType.CUDA, cuda_time_total=1000.0),  # torch < 2.4
        device("Memset (Device)", 200.0),
        SimpleNamespace(name="_fwd_kernel", device_type=DeviceType.CPU, device_time_total=9999.0),  # host side
    ]
    ms = tune.kernel_ms(events, iters=2)
    assert ms == pytest.approx({"_fwd_packed_kernel": 0.4, "_fwd_kernel": 1.0, "all": 1.5})
    assert tune.role_ms("fwd", ms) == pytest.approx(1.0)
    assert tune.role_ms("packed_fwd", ms) == pytest.approx(1.4)  # the packed block moves work to _fwd_kernel
    assert tune.role_ms("dq", ms) is None  # no dq kernel ran: "-"
    assert tune.role_ms("packed_bwd", {"_dq_kernel": 1.0}) is None


def _records(role, table):
    """{candidate index: {row: ms | None | "error"}} -> sweep records."""
    out = []
    for index, cells in table.items():
        for row, ms in cells.items():
            record = dict(role=role, index=index, row=row, candidate=f"c{index}")
            if ms == "error":
                record.update(ms=0.1, error="computes something else")  # a time, but never ranked
            else:
                record["ms"] = ms
            out.append(record)
    return out


def test_summarize_ranks_by_total_over_the_shipped_rows():
    records = _records("fwd", {
        0: {"gem": 2.0, "long": 3.0, "tiny": None},  # shipped; launches nothing on tiny
        1: {"gem": 1.5, "long": 3.2, "tiny": 0.1},  # total 4.7: the fastest (tiny does not count)
        2: {"gem": 1.0, "long": "error"},  # a time on long, but failed there: not ranked
        3: {"gem": 1.0},  # no record on long (the sweep stopped): not ranked
        4: {"gem": 1.0, "long": None},  # its kernel did not run on long: not ranked
    })
    records += _records("dq", {0: {"gem": 1.0}, 1: {"gem": 1.0}, 2: {"gem": 1.1}})  # a tie goes to shipped
    records += _records("dkv", {0: {"gem": None}, 1: {"gem": 1.0}})  # shipped ran nothing: no summary
    summary = {s["role"]: s for s in tune.summarize(records, tune.ROLES)}
    assert set(summary) == {"fwd", "dq"}
    fwd = summary["fwd"]
    assert fwd["rows"] == ["gem", "long"]
    assert (fwd["shipped"], fwd["best"]) == ("c0", "c1")
    assert (fwd["shipped_ms"], fwd["best_ms"], fwd["ratio"]) == pytest.approx((5.0, 4.7, 0.94))
    assert summary["dq"]["best"] == "c0"


def test_role_table_marks_the_fastest_and_explains_errors():
    records = _records("packed_fwd", {0: {"skew": 2.0, "tiny": 1.0}, 1: {"skew": 1.0, "tiny": "error"},
                                      2: {"skew": None, "tiny": 0.5}})
    lines = tune.role_table("packed_fwd", records)
    shipped, first, second = lines[2:5]
    assert shipped.split() == ["c0", "2.000", "1.00", "1.000", "1.00"]
    assert first.split() == ["c1", "1.000", "0.50*", "error"]
    assert second.split() == ["c2", "-", "0.500", "0.50*"]
    assert lines[5] == "  c1 on tiny: computes something else"


def test_the_warm_up_share_covers_every_run_once():
    tasks = tune.warm_tasks(bench.ROWS, tune.ROLES, 128)
    assert len(set(tasks)) == len(tasks)
    assert {(row, role) for row, role, _ in tasks} == {(row, role) for role in tune.ROLES
                                                        for row in tune.ROLE_ROWS[role]}
    for jobs in (1, 3, 8, 200):
        shares = [tune.share(tasks, i, jobs) for i in range(jobs)]
        assert sorted(t for s in shares for t in s) == sorted(tasks)
        owners = {}
        for i, mine in enumerate(shares):
            for _, role, index in mine:
                assert owners.setdefault((role, index), i) == i  # a candidate compiles in one process
        if jobs <= len(owners):
            assert all(shares)


def test_worker_outcome_names_what_broke_a_worker():
    a, b, c, d = ("gem", "fwd", 0), ("gem", "fwd", 1), ("long", "dq", 2), ("tiny", "packed_bwd", 3)
    lines = [json.dumps({"start": a}), json.dumps({"done": a, "error": None, "fatal": False}),
             "a stray line from a library\n",
             json.dumps({"start": b}), json.dumps({"done": b, "error": "OutOfResources: x", "fatal": False}),
             json.dumps({"start": c})]
    crashed, raised = tune.worker_outcome(lines, -11)
    assert raised == 1 and set(crashed) == {c} and "-11" in crashed[c]
    lines = [json.dumps({"start": d}), json.dumps({"done": d, "error": "illegal address", "fatal": True})]
    crashed, raised = tune.worker_outcome(lines, 3)
    assert raised == 1 and "illegal address" in crashed[d]


def test_row_inputs_match_the_rows_lengths():
    (q, k, v, q_off, kv_off, dout), kwargs, pairs = bench.row_inputs("broadcast", torch.bfloat16, 8, 0, "cpu")
    q_lens, kv_lens, heads, _ = bench.lengths("broadcast", 0)
    assert q_off is None and kwargs["broadcast_q"] and not kwargs["causal"] and kwargs["window"] is None
    assert q.shape == (128, heads, 8) and dout.shape == (128 * kv_lens.size, heads, 8)
    assert k.shape == v.shape == (int(kv_lens.sum()), heads, 8) and k.dtype == torch.bfloat16
    assert kv_off[-1] == kv_lens.sum() and torch.equal(kv_off.diff(), torch.as_tensor(kv_lens, dtype=torch.int32))
    assert kwargs["max_kv_len"] == kv_lens.max() and pairs == int((q_lens * kv_lens).sum()) * heads


@pytest.mark.parametrize("extra", [[], ["--warm", "0/2"]])
def test_main_without_cuda_exits_2_with_a_message(monkeypatch, capsys, extra):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--rows", "tiny", *extra]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_compile_only_reports_ptxas_usage_of_each_candidate_and_failures():
    """`--compile-only` compiles every candidate at each num_stages for sm_90 without a GPU and prints ptxas's
    registers, spills and shared memory and the SASS size (the head loop inside the kernel); a candidate that
    does not compile is reported and fails the run."""
    import os
    import subprocess
    import sys

    code = """
import sys
from jfa.triton import tune
from jfa.triton.backend import KernelConfig
good, bad = KernelConfig(32, 32, 4, (2, 1)), KernelConfig(24, 24, 4, (1,))
tune.candidates = lambda role, block_d: [good, bad]
sys.exit(tune.main(["--compile-only", "--roles", "packed_fwd", "--head-dim", "16"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiling needs the real backend
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert [line.split("  ")[0] for line in lines] == ["packed_fwd 32x32 w4 s2 r1", "packed_fwd 32x32 w4 s1 r1",
                                                       "packed_fwd 24x24 w4 s1 r1"], lines
    for line in lines[:2]:
        fields = line.split()
        regs, spill, smem, sass, loop = (int(fields[fields.index(name) + 1])
                                         for name in ("regs", "spill", "smem", "sass", "loop"))
        assert 0 < regs <= 255 and spill >= 0 and smem > 0 and 0 < loop < sass, line
    assert "FAIL" in lines[2], lines[2]
