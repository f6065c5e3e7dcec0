"""Offline config sweep of the Triton backend's kernels on a CUDA GPU: `python -m jfa.triton.tune`.

Why offline. A kernel's block shapes set the order of every floating-point reduction, so they are fixed per
padded head-dim class (`gpu_config` in jfa/triton/backend.py), never chosen per call: a choice that followed
the batch would give a sequence other bits alone than inside a batch (batch invariance). They are chosen
once, by timing candidates on the GPU they ship for, on jfa.bench's rows; this is that sweep.

What it does. Each role's config (fwd, dq, dkv: ordinary tiles; short_bwd: the one-pass backward of short
query sequences; packed_fwd, packed_bwd: packed tiny sequences) is replaced, that role alone (`set_config`),
by each of a curated list of candidates (`candidates`, the shipped config first), and the op runs on the rows
its kernel works on (ordinary roles: gem, long, skew, broadcast; short_bwd: skew, broadcast; packed roles:
skew, tiny) with jfa.bench's inputs: the forward alone for the forward kernels, forward and backward
otherwise. After two untimed calls (compilation, tile schedule), --iters calls run under torch.profiler and
the device time of the role's kernels is summed: ms per call. A packed or short-query role counts the ordinary
kernels of its pass too (`ROLE_KERNELS`): its block decides which sequences it takes (packed: longer side <=
block; short: q_len <= block) and which go to ordinary tiles, so its kernel alone would favour taking fewer.
Each candidate's outputs are compared with the shipped config's (another reduction order moves a few ulps, a
wrong tile O(1)); a candidate that fails to compile, to launch (out of shared memory or registers) or to agree
is reported with the reason and never ranked. Compilation comes first, in --jobs processes that each run their
share of the candidates once (filling Triton's on-disk cache); then everything is timed in this process, alone
on the GPU. Once per row the shipped op is timed as jfa.bench times it (do_bench of the forward and of
forward+backward) beside its kernels' device time: the rest is host work and launch gaps (the tiny row is
suspected to be host-bound).

Reading the output. Per role a table: one line per candidate, "BMxBN wW sS rR" (query x key block, warps,
num_stages, programs per SM in the persistent grid), and per row the ms per call and the ratio to the
shipped config (the first line, 1.00; below 1 is faster); * marks the fastest of a row, "-" a row that
launched no kernel of the role, "error" is explained under the table. Then the op against its kernels, and
a summary: per role, the candidate with the lowest total over the role's rows against the shipped one.
A winner is a proposal: a new config moves the kernel's bits, so it ships after the verify suite's
premerge profile passes with it on the GPU.

Without a GPU. `--compile-only` compiles every candidate of the roles (each num_stages; no mask) for sm_90
with the installed triton and prints ptxas's registers, spill-store bytes and shared memory per candidate:
which ones a compiler spills on, before any is timed (fbtriton, for one, spills on every packed-forward
candidate at head dim 128 where stock triton spills on none but the 128-row ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from jfa import tile_scheduler as ts
from jfa.bench import ROWS, environment, row_inputs
from jfa.triton.backend import KernelConfig, gpu_config, interpreting, padded_dim, set_config
from jfa.validation import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM

ROLES = ("fwd", "dq", "dkv", "short_bwd", "packed_fwd", "packed_bwd")
# The kernel each role's config drives (jfa/triton/forward.py, backward.py); broadcast-Q adds the reduction.
KERNELS = {"fwd": "_fwd_kernel", "dq": "_dq_kernel", "dkv": "_dkv_kernel", "short_bwd": "_bwd_short_kernel",
           "packed_fwd": "_fwd_packed_kernel", "packed_bwd": "_bwd_packed_kernel"}
# The TLX kernels (jfa.tlx.forward, jfa.tlx.backward; their modules import only under fbtriton), which
# scripts/ab_probe.py's `tlx` rows time.
TLX_KERNELS = ("fwd_ws_kernel", "dq_ws_kernel", "dkv_ws_kernel", "short_ws_kernel")
# _delta_kernel: D of every row, ahead of the tlx backward's one pass (`dq_in_dkv`).
JFA_KERNELS = (*KERNELS.values(), "_delta_kernel", "_dq_reduce_kernel", *TLX_KERNELS)
# What a role's time sums: its kernel and, for a packed or short-query role, the ordinary kernels of its pass,
# which take the sequences its block leaves out.
ROLE_KERNELS = {"fwd": ("_fwd_kernel",), "dq": ("_dq_kernel",), "dkv": ("_dkv_kernel",),
                "short_bwd": ("_bwd_short_kernel", "_dq_kernel", "_dkv_kernel"),
                "packed_fwd": ("_fwd_packed_kernel", "_fwd_kernel"),
                "packed_bwd": ("_bwd_packed_kernel", "_dq_kernel", "_dkv_kernel")}
FORWARD_ROLES = ("fwd", "packed_fwd")
ORDINARY_ROWS = ("gem", "long", "skew", "broadcast")  # rows with sequences longer than any packed block
PACKED_ROWS = ("skew", "tiny")  # rows with sequences of 1-64 rows
SHORT_ROWS = ("skew", "broadcast")  # rows with query sequences of 128 rows or fewer beside more keys
ROLE_ROWS = {"fwd": ORDINARY_ROWS, "dq": ORDINARY_ROWS, "dkv": ORDINARY_ROWS, "short_bwd": SHORT_ROWS,
             "packed_fwd": PACKED_ROWS, "packed_bwd": PACKED_ROWS}
# A candidate whose max |out - shipped out| exceeds this fraction of max |shipped out| (any output tensor)
# computes something else: reduction orders differ by ulps (2^-8 of an element in bf16), bugs by O(1).
MISMATCH = 2**-5

# Candidates at padded head dims <= 128 as (block_m, block_n, num_warps, num_stages options); at 256 the
# blocks are halved (tiles and accumulators grow with the head dim). Packed tiles are square.
GRID = {
    "fwd": ((128, 64, 8, (2, 3)), (128, 128, 8, (2,)), (64, 64, 4, (2, 3, 4)), (128, 64, 4, (2, 3)),
            (128, 32, 4, (3,)), (64, 128, 4, (2,))),
    "dq": ((128, 64, 8, (2, 3)), (128, 32, 8, (2, 3)), (64, 64, 4, (2, 3)), (128, 128, 8, (2,)),
           (64, 32, 4, (2, 3))),
    "dkv": ((32, 128, 8, (2, 3)), (64, 128, 8, (2, 3)), (32, 64, 4, (2, 3)), (64, 64, 4, (2, 3)),
            (16, 128, 8, (2,)), (32, 128, 4, (2,)), (64, 64, 8, (2,))),
    "short_bwd": ((128, 64, 8, (2, 3)), (128, 32, 8, (2, 3)), (128, 64, 4, (2,)), (128, 32, 4, (2,)),
                  (128, 128, 8, (2,)), (64, 64, 4, (2,)), (64, 32, 4, (2,))),
}
# Packed tiles are memory-bound: deeper head-loop pipelines (3, 4 stages) hold more bytes in flight where the
# shared memory allows (a 128-row stage is 96 KiB at head dim 128, so 128 stays at 1 and 2).
PACKED_GRID = tuple((b, b, warps, (1, 2, 3, 4) if b <= 64 else (1, 2)) for b in (32, 64, 128) for warps in (4, 8))
# Packed tiles at 4 warps and <= 64 rows, 1 or 2 stages, also with ptxas's registers capped (max_registers,
# resident): a packed program waits on its loads most of the time, so more programs per SM may win despite
# spills; 65,536 registers hold 3 programs of 128 threads at 168 registers, 4 at 128.
PACKED_CAPS = ((168, 3), (128, 4))
MIN_BLOCK = 16  # tl.dot's smallest tile
MIN_PACKED_BLOCK = 2 * ts.PACK_ALIGN  # a packed tile of one slot packs nothing


def runs_as(cfg: KernelConfig) -> tuple:
    """What a config launches with autotuning off (the first num_stages only): configs equal here are one."""
    return cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages[0], cfg.resident, cfg.max_registers


def label(cfg: KernelConfig) -> str:
    cap = "" if cfg.max_registers is None else f" m{cfg.max_registers}"
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.stages[0]} r{cfg.resident}{cap}"


def candidates(role: str, block_d: int) -> list[KernelConfig]:
    """The shipped config of `role` at padded head dim `block_d`, then the grid's alternatives, each with one
    num_stages and resident 1, or also 2 for 4 warps on blocks of <= 64 rows (two such programs may fit an SM;
    more than fit only queue, which the dynamic tile counter makes harmless), and 4 for such packed tiles
    (memory-bound: bytes in flight need programs in flight), 2 for 8-warp packed tiles of <= 64 rows, and packed
    4-warp tiles at 1 or 2 stages also with their registers capped (`PACKED_CAPS`). No two run alike."""
    shipped = getattr(gpu_config(block_d), role)
    if shipped is None:
        raise ValueError(f"no {role} config ships for padded head dim {block_d}: nothing to compare against")
    grid, low = (PACKED_GRID, MIN_PACKED_BLOCK) if role.startswith("packed") else (GRID[role], MIN_BLOCK)
    shrink = 2 if block_d > 128 else 1
    out, seen = [shipped], {runs_as(shipped)}
    for block_m, block_n, warps, stages in grid:
        # Decided on the grid's blocks: half the rows at twice the head dim hold about as many registers.
        residents = (1,)
        if warps == 4 and block_m <= 64:
            residents = (1, 2, 4) if role.startswith("packed") else (1, 2)
        elif role.startswith("packed") and block_m <= 64:
            residents = (1, 2)
        for stage in stages:
            capped = role.startswith("packed") and warps == 4 and block_m <= 64 and stage <= 2
            for max_registers, resident in [(None, r) for r in residents] + list(PACKED_CAPS if capped else ()):
                cfg = KernelConfig(max(low, block_m // shrink), max(low, block_n // shrink), warps, (stage,), resident,
                                   max_registers)
                if runs_as(cfg) not in seen:
                    seen.add(runs_as(cfg))
                    out.append(cfg)
    return out


def warm_tasks(rows, roles, block_d: int) -> list[tuple[str, str, int]]:
    """Every (row, role, candidate index) the sweep runs."""
    return [(row, role, i) for role in roles for i in range(len(candidates(role, block_d)))
            for row in rows if row in ROLE_ROWS[role]]


def share(tasks, index: int, jobs: int) -> list:
    """Warm-up worker `index` of `jobs`'s tasks: whole candidates (all their rows), dealt round-robin, so that
    each kernel variant compiles in one process."""
    keys = list(dict.fromkeys((role, i) for _, role, i in tasks))
    mine = set(keys[index::jobs])
    return [task for task in tasks if task[1:] in mine]


# ---------------------------------------------------------------------------------------------------------
# Profiler events


def kernel_of(event_name: str) -> str | None:
    """The jfa kernel a profiler event is: its function name, to which older Tritons append a signature
    (`_fwd_kernel_0d1d2d...`)."""
    for name in JFA_KERNELS:
        if re.fullmatch(rf"{re.escape(name)}(_\w+)?", event_name):
            return name
    return None


def kernel_ms(events, iters: int) -> dict[str, float]:
    """Device ms per call of each jfa kernel, and of all device work ("all": kernels, copies, fills), from the
    torch.profiler events of `iters` calls."""
    from torch.autograd import DeviceType

    total = {"all": 0.0}
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue  # host-side runtime calls
        us = getattr(event, "device_time_total", None)
        us = event.cuda_time_total if us is None else us  # torch < 2.4
        total["all"] += us
        name = kernel_of(event.name)
        if name:
            total[name] = total.get(name, 0.0) + us
    return {name: us / 1e3 / iters for name, us in total.items()}


def role_ms(role: str, kernels: dict[str, float]) -> float | None:
    """A role's ms per call (ROLE_KERNELS), or None when its own kernel did not run."""
    if KERNELS[role] not in kernels:
        return None
    return sum(kernels.get(name, 0.0) for name in ROLE_KERNELS[role])


# ---------------------------------------------------------------------------------------------------------
# Reports


def _ranked(record) -> bool:
    return record is not None and record.get("ms") is not None and not record.get("error")


def summarize(records, roles) -> list[dict]:
    """Per role: the shipped config's total ms over the rows it has a time on, and the candidate with the
    lowest total over the same rows (one without a time on any of them is not ranked; a tie goes to the
    earlier candidate, so the shipped one wins it)."""
    out = []
    for role in roles:
        mine = {(r["index"], r["row"]): r for r in records if r["role"] == role}
        rows = [row for index, row in mine if index == 0 and _ranked(mine[index, row])]
        if not rows:
            continue
        labels = {index: r["candidate"] for (index, _), r in mine.items()}
        totals = {index: sum(mine[index, row]["ms"] for row in rows) for index in labels
                  if all(_ranked(mine.get((index, row))) for row in rows)}
        best = min(totals, key=lambda index: (totals[index], index))
        out.append(dict(role=role, rows=rows, shipped=labels[0], shipped_ms=totals[0], best=labels[best],
                        best_ms=totals[best], ratio=totals[best] / totals[0]))
    return out


def role_table(role: str, records) -> list[str]:
    """The lines of a role's table (the module docstring says how to read it)."""
    mine = {(r["index"], r["row"]): r for r in records if r["role"] == role}
    rows = list(dict.fromkeys(row for _, row in mine))
    labels = dict(sorted({(index, r["candidate"]) for (index, _), r in mine.items()}))
    fastest: dict[str, float] = {}
    for (_, row), r in mine.items():
        if _ranked(r):
            fastest[row] = min(r["ms"], fastest.get(row, r["ms"]))
    lines = [f"{role}: ms per call of {' + '.join(ROLE_KERNELS[role])}, ratio to shipped; * fastest of the row",
             f"{'candidate':18s}" + "".join(f"{row:>15s}" for row in rows)]
    errors: dict[tuple, list] = {}
    for index, name in labels.items():
        cells = []
        for row in rows:
            record, shipped = mine.get((index, row)), mine.get((0, row))
            if record is None:
                cell = ""  # the sweep stopped before it
            elif record.get("error"):
                cell = "error"
                errors.setdefault((name, record["error"]), []).append(row)
            elif record.get("ms") is None:
                cell = "-"
            else:
                ratio = f"{record['ms'] / shipped['ms']:4.2f}" if _ranked(shipped) else "   -"
                cell = f"{record['ms']:8.3f} {ratio}{'*' if record['ms'] == fastest[row] else ' '}"
            cells.append(f"{cell:>15s}")
        lines.append(f"{name:18s}" + "".join(cells))
    lines += [f"  {name} on {', '.join(where)}: {error}" for (name, error), where in errors.items()]
    return lines


def op_table(ops) -> list[str]:
    head = (f"{'row':10s} {'pass':8s} {'op ms':>9s} {'jfa kernels':>12s} {'other device':>13s} "
            f"{'host, gaps':>11s} {'kernels/op':>11s}")
    lines = ["the shipped op (do_bench) against its kernels' device time (profiler), ms per call", head,
             "-" * len(head)]
    for op in ops:
        lines.append(f"{op['row']:10s} {op['op']:8s} {op['op_ms']:9.3f} {op['kernels_ms']:12.3f} "
                     f"{max(0.0, op['device_ms'] - op['kernels_ms']):13.3f} {op['op_ms'] - op['device_ms']:11.3f} "
                     f"{op['kernels_ms'] / op['op_ms']:10.0%}")
    return lines


def summary_lines(summary) -> list[str]:
    lines = ["summary: total ms over each role's rows, shipped -> fastest (ratio below 1 is faster)"]
    for s in summary:
        verdict = "the shipped config is fastest" if s["best"] == s["shipped"] else (
            f"fastest {s['best']:16s} {s['best_ms']:9.3f}  ({s['ratio']:.2f}x)")
        lines.append(f"  {s['role']:10s} ({' '.join(s['rows'])}) shipped {s['shipped']:16s} "
                     f"{s['shipped_ms']:9.3f}  {verdict}")
    return lines


# ---------------------------------------------------------------------------------------------------------
# Running on the GPU


def _calls(inputs, kwargs, backend: str = "triton") -> dict:
    """Per role, the op (of `backend`; scripts/ab_probe.py also times `tlx`) as its kernel runs in it, returning
    the output tensors: the forward alone for the forward kernels, forward and backward (torch.autograd.grad,
    as jfa.bench) otherwise."""
    import torch

    import jfa

    q, k, v, q_off, kv_off, dout = inputs
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def forward():
        with torch.no_grad():
            return (jfa.attention(q, k, v, q_off, kv_off, backend=backend, **kwargs),)

    def forward_backward():
        out = jfa.attention(*leaves, q_off, kv_off, backend=backend, **kwargs)
        return torch.autograd.grad(out, leaves, dout)

    return {role: forward if role in FORWARD_ROLES else forward_backward for role in ROLES}


def _profile(call, iters: int) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    return kernel_ms(prof.events(), iters)


def _mismatch(result, reference) -> float:
    """max |result - reference| / max |reference|, the worst over the output tensors (NaN stays NaN)."""
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
               for a, b in zip(result, reference, strict=True))


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]


def _cuda_alive() -> bool:
    """Whether CUDA still works after an error (an illegal address is sticky: nothing runs after it)."""
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


def _time_op(row: str, name: str, call, iters: int) -> dict:
    """The shipped op's ms per call (do_bench, as jfa.bench) beside its kernels' device time."""
    import triton.testing

    call()
    call()
    op_ms = triton.testing.do_bench(call, warmup=25, rep=100)
    kernels = _profile(call, iters)
    return dict(row=row, op=name, op_ms=op_ms, kernels_ms=sum(kernels.get(k, 0.0) for k in JFA_KERNELS),
                device_ms=kernels["all"], by_kernel=kernels)


def sweep(args, block_d: int, dtype, skip: dict) -> tuple[list, list, bool]:
    """Times every candidate on every row of its role (tasks in `skip` are reported with its reason, not run)
    and the shipped op on every row; returns (records, ops, whether it ran to the end)."""
    import torch

    device = torch.device("cuda")
    shipped = gpu_config(block_d)
    cands = {role: candidates(role, block_d) for role in args.roles}
    records, ops = [], []
    for row in args.rows:
        inputs, kwargs, _ = row_inputs(row, dtype, args.head_dim, args.seed, device)
        calls = _calls(inputs, kwargs)
        set_config(None)
        ops += [_time_op(row, name, calls[role], args.iters) for name, role in (("fwd", "fwd"), ("fwd+bwd", "dq"))]
        if not ops[-1]["device_ms"]:
            print("WARNING: the profiler saw no device work (CUPTI tracing unavailable?): kernel times are missing")
        for role in (r for r in args.roles if row in ROLE_ROWS[r]):
            start, reference = time.perf_counter(), None
            for i, cand in enumerate(cands[role]):
                record = dict(row=row, role=role, index=i, candidate=label(cand), config=dataclasses.asdict(cand))
                records.append(record)
                if (row, role, i) in skip:
                    record["error"] = skip[row, role, i]
                    continue
                try:
                    set_config(dataclasses.replace(shipped, **{role: cand}))
                    result = calls[role]()  # compiles (a cache hit after the warm-up) and builds the schedule
                    calls[role]()
                    record["kernels_ms"] = _profile(calls[role], args.iters)
                    record["ms"] = role_ms(role, record["kernels_ms"])
                    if i == 0:
                        reference = result
                    elif reference is not None:
                        record["mismatch"] = _mismatch(result, reference)
                        if not record["mismatch"] <= MISMATCH:
                            record["error"] = (f"computes something else: max |diff| / max |shipped| = "
                                               f"{record['mismatch']:.3g}")
                    del result
                except Exception as error:  # noqa: BLE001 - reported in the table, not fatal
                    record["error"] = _describe(error)
                    if not _cuda_alive():
                        print(f"CUDA is unusable after {row} {role} {record['candidate']} ({record['error']}): "
                              "stopping; the tables hold what ran", flush=True)
                        set_config(None)
                        return records, ops, False
            done = [r for r in records if r["row"] == row and r["role"] == role]
            best = min((r for r in done if _ranked(r)), key=lambda r: r["ms"], default=None)
            ran = f"fastest {best['candidate']} {best['ms']:.3f} ms" if best else "no candidate ran"
            shipped_ms = f"{done[0]['ms']:.3f} ms" if _ranked(done[0]) else "-"
            print(f"  {row:9s} {role:10s} {len(done)} candidates: {ran}, shipped {shipped_ms} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        inputs = calls = reference = None
        torch.cuda.empty_cache()
    set_config(None)
    return records, ops, True


# ---------------------------------------------------------------------------------------------------------
# Compile warm-up in parallel processes


def _warm_worker(args, index: int, jobs: int, block_d: int, dtype) -> int:
    """Runs this worker's share of the tasks once each, untimed, printing {"start": task} before each and
    {"done": task, "error": ..., "fatal": ...} after; stops (exit 3) at an error that leaves CUDA unusable."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))  # the workers draw their inputs at once
    device = torch.device("cuda")
    shipped = gpu_config(block_d)
    cands = {role: candidates(role, block_d) for role in args.roles}
    mine = share(warm_tasks(args.rows, args.roles, block_d), index, jobs)
    for row in args.rows:
        todo = [task for task in mine if task[0] == row]
        if not todo:
            continue
        inputs, kwargs, _ = row_inputs(row, dtype, args.head_dim, args.seed, device)
        calls = _calls(inputs, kwargs)
        for task in todo:
            _, role, i = task
            print(json.dumps({"start": task}), flush=True)
            error = None
            try:
                set_config(dataclasses.replace(shipped, **{role: cands[role][i]}))
                calls[role]()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - the timing run meets it again and reports it
                error = _describe(e)
            fatal = error is not None and not _cuda_alive()
            print(json.dumps({"done": task, "error": error, "fatal": fatal}), flush=True)
            if fatal:
                return 3
        del inputs, calls
        torch.cuda.empty_cache()
    return 0


def worker_outcome(lines, exit_code: int) -> tuple[dict[tuple, str], int]:
    """From a warm-up worker's output and exit status: the tasks not to run in the timing process, with why
    (one that broke CUDA, one started but never done: it took its process down), and how many raised."""
    started, out, raised = [], {}, 0
    for line in lines:
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "start" in message:
            started.append(tuple(message["start"]))
        elif "done" in message:
            task = tuple(message["done"])
            started.remove(task)
            raised += message["error"] is not None
            if message["fatal"]:
                out[task] = f"left CUDA unusable in the warm-up ({message['error']})"
    for task in started:
        out[task] = f"took its warm-up process down (exit status {exit_code})"
    return out, raised


def warm_up(args, block_d: int) -> dict[tuple, str]:
    """Runs every task once in --jobs processes, so that the timing process compiles nothing (Triton's on-disk
    cache); returns the tasks not to run again (worker_outcome)."""
    tasks = warm_tasks(args.rows, args.roles, block_d)
    jobs = min(args.jobs, len(tasks))
    if jobs < 1:
        return {}
    cmd = [sys.executable, "-m", "jfa.triton.tune", "--rows", *args.rows, "--roles", *args.roles,
           "--head-dim", str(args.head_dim), "--dtype", args.dtype, "--seed", str(args.seed)]
    print(f"compiling: {len(tasks)} runs in {jobs} processes", flush=True)
    start = time.perf_counter()
    crashed, raised, failed = {}, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"worker{i}.jsonl") for i in range(jobs)]
        procs = []
        for i, log in enumerate(logs):
            with open(log, "w") as out:  # a file, not a pipe: nothing to drain while they run
                procs.append(subprocess.Popen(cmd + ["--warm", f"{i}/{jobs}"], stdout=out))
        for proc, log in zip(procs, logs, strict=True):
            code = proc.wait()
            with open(log) as f:
                lines = f.readlines()
            broke, n = worker_outcome(lines, code)
            crashed.update(broke)
            raised += n
            failed += [f"{' '.join(proc.args[-2:])}: exit status {code}"] if code else []
    print(f"compiled in {time.perf_counter() - start:.0f} s: {raised} runs raised (timed again below, which "
          f"reports why), {len(crashed)} broke their process (not run again)", flush=True)
    if failed:  # what they did not run compiles while timing
        print(f"warm-up processes that failed: {'; '.join(failed)}", flush=True)
    return crashed


def compile_candidates(roles, head_dim: int, dtype: str, arch: int = 90) -> int:
    """--compile-only: every candidate of each role (each num_stages), compiled for sm_<arch> with the
    installed triton (no GPU), no mask, with ptxas's registers, spill stores, shared memory and SASS size: which
    candidates a compiler spills on, before any is timed. 0 when all compiled."""
    from jfa.triton.compiled import ptxas_usage, role_variants

    if interpreting():
        print("unset TRITON_INTERPRET to compile the kernels")
        return 2
    failed = 0
    for role in roles:
        for cfg in candidates(role, padded_dim(head_dim)):
            for variant in role_variants(role, cfg, head_dim, head_dim, dtype):
                name = f"{role:10s} {label(dataclasses.replace(cfg, stages=(variant.num_stages,)))}"
                try:
                    usage = ptxas_usage(variant, arch)
                except Exception as error:  # noqa: BLE001 - report every failure
                    print(f"{name}  FAIL {type(error).__name__}: {' '.join(str(error).split())[:300]}")
                    failed += 1
                    continue
                print(f"{name}  {usage}", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--roles", nargs="+", default=list(ROLES), choices=ROLES)
    parser.add_argument("--iters", type=int, default=10, help="profiled calls per candidate and row")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="compile warm-up processes (0: compile while timing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every figure and the environment here")
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU: compile each candidate for sm_90 and print ptxas's registers and spills, "
                             "shared memory and SASS size")
    parser.add_argument("--warm", help=argparse.SUPPRESS)  # i/n: be warm-up worker i of n
    args = parser.parse_args(argv)
    if not (HEAD_DIM_MULTIPLE <= args.head_dim <= MAX_HEAD_DIM and args.head_dim % HEAD_DIM_MULTIPLE == 0):
        parser.error(f"--head-dim must be a multiple of {HEAD_DIM_MULTIPLE} from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}")
    args.rows = [row for row in ROWS if row in args.rows]
    args.roles = [role for role in ROLES if role in args.roles]
    unshipped = [role for role in args.roles if getattr(gpu_config(padded_dim(args.head_dim)), role) is None]
    if unshipped:
        print(f"not swept at head dim {args.head_dim} (no config ships for it): {' '.join(unshipped)}")
        args.roles = [role for role in args.roles if role not in unshipped]

    if args.compile_only:
        return compile_candidates(args.roles, args.head_dim, args.dtype)

    import torch

    if not torch.cuda.is_available():
        print("jfa.triton.tune needs a CUDA GPU (none is visible): it times the kernels on the GPU they ship for")
        return 2
    if interpreting():
        print("unset TRITON_INTERPRET: the sweep times compiled kernels, not the interpreter")
        return 2
    os.environ["JFA_TRITON_AUTOTUNE"] = "0"  # the shipped config runs at its first num_stages, as it ships
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    block_d = padded_dim(args.head_dim)
    if args.warm:
        index, jobs = (int(x) for x in args.warm.split("/"))
        return _warm_worker(args, index, jobs, block_d, dtype)

    env = environment()
    print(f"{env['gpu']}  driver {env['driver']}  CUDA {env['cuda']}  torch {env['torch']}  triton {env['triton']}  "
          f"{args.dtype} D={args.head_dim} (padded {block_d})  schedule "
          f"{os.environ.get('JFA_TRITON_SCHEDULE', 'dynamic')}  {args.iters} profiled calls each", flush=True)
    crashed = warm_up(args, block_d)
    records, ops, complete = sweep(args, block_d, dtype, crashed)
    summary = summarize(records, args.roles)
    for role in args.roles:
        if any(r["role"] == role for r in records):
            print()
            print("\n".join(role_table(role, records)))
    print()
    print("\n".join(op_table(ops)))
    print()
    print("\n".join(summary_lines(summary)))
    if args.json:
        cands = {role: [dict(dataclasses.asdict(c), label=label(c)) for c in candidates(role, block_d)]
                 for role in args.roles}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "block_d": block_d, "complete": complete,
                       "candidates": cands, "results": records, "ops": ops, "summary": summary}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
