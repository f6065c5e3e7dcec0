"""Benchmark of jfa's kernels against their peers on DESIGN.md's workloads: `python -m jfa.bench`.

Rows (DESIGN.md "Reference figures"; lengths drawn with a fixed seed, q and kv lengths equal):
  gem        1024 sequences U[400, 1000), H 4
  long       8 × 4096, H 16
  skew       1 × 32768 + 2047 × U[1, 64], H 8
  tiny       32768 × U[1, 32], H 4          (memory-bound: GB/s of compulsory traffic is reported)
  broadcast  q 128 shared, kv GEM-like (1024 × U[400, 1000)), H 4

Every backend named by --backends (default: triton, tlx, torch-varlen, flex; unavailable ones are skipped with
the reason) runs through jfa.attention, so each includes the op's validation and host work. Timings are
triton.testing.do_bench means (warm-up first; the first calls, which compile and autotune, are made before
timing). Reported: forward time; backward time, the backward alone (torch.autograd.grad over one forward's
retained graph, as FlashAttention's `benchmark_backward` times it; '-' for a backward that cannot run twice over
one graph; runs before 2026-12-05 took (fwd+bwd) − fwd instead, which moved with the forward's timing);
forward+backward time (one timing of both passes as a training step takes them); TFLOP/s that count only visible
(query, key) pairs — forward 4·pairs·D per head, backward 2.5× that — the ratio of each to torch-varlen
(FlashAttention-2), GB/s of compulsory traffic (inputs read and outputs written once: q, k, v, out, lse forward;
q, k, v, out, dout, lse read and dq, dk, dv written backward) and that rate as a share of the device's copy rate
(a 1 GiB device-to-device copy timed at the start of the run), per row the memory roofline (the traffic's time at
the copy rate, and the ratio to torch-varlen of a kernel that took no longer: beyond it only by moving bytes
faster than a copy does), peak extra memory (torch.cuda.max_memory_allocated minus inputs and outputs), the
device time of the forward, the backward and the forward+backward (their kernels and copies, torch.profiler over
five back-to-back calls after a warm-up call and a first recorded one, left out) and the GPU's idle time per call
among them (what it waited for the host: in the forward the op's one wait for the offsets, then its host work
until the launch; in the backward its host work and the autograd engine's, where they outlast the previous call's
kernels), and the mean SM clock of each timing (NVML): under sustained load the H200 lowers its clock, more for a
kernel that keeps the tensor cores busier, so a time is read beside its clock.
--json writes everything with the environment (GPU, driver, CUDA, torch, triton versions, date).
`python -m jfa.bench --markdown RUN.json [RUN.json ...]` prints such runs as one markdown table (the README's),
each row's backends run by run; with several runs, a run's records carry its footnote mark, and the footnotes
name each run's triton, date, copy rate and how it timed the backward (no GPU needed).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import subprocess
import sys
import threading

import numpy as np

ROWS = ("gem", "long", "skew", "tiny", "broadcast")
MEMORY_BOUND_ROWS = ("tiny",)  # their tables give GB/s of compulsory traffic beside TFLOP/s
DEFAULT_BACKENDS = ("triton", "tlx", "torch-varlen", "flex")
PASSES = ("fwd", "bwd", "fwdbwd")  # each timed on its own: forward, backward alone, forward+backward


def lengths(row: str, seed: int = 0):
    """(q_lens, kv_lens, heads, broadcast_q) of a row."""
    rng = np.random.default_rng(seed)
    if row == "gem":
        lens = rng.integers(400, 1000, 1024)
        return lens, lens, 4, False
    if row == "long":
        lens = np.full(8, 4096)
        return lens, lens, 16, False
    if row == "skew":
        lens = np.concatenate([[32768], rng.integers(1, 65, 2047)])
        return lens, lens, 8, False
    if row == "tiny":
        lens = rng.integers(1, 33, 32768)
        return lens, lens, 4, False
    if row == "broadcast":
        kv = rng.integers(400, 1000, 1024)
        return np.full(kv.size, 128), kv, 4, True
    raise ValueError(f"unknown row {row!r}; rows are {ROWS}")


def visible_pairs(q_lens, kv_lens, window: int | None, causal: bool) -> int:
    """Exact number of visible (query, key) pairs: row i sees keys [max(0, i - w), min(kv - 1, i + w,
    i + kv - q)] (jfa.block_info's per-row interval)."""
    q_lens = np.asarray(q_lens, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    if window is None and not causal:
        return int((q_lens * kv_lens).sum())
    seq = np.repeat(np.arange(q_lens.size), q_lens)
    i = np.arange(seq.size) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    q, kv = q_lens[seq], kv_lens[seq]
    lo = np.zeros_like(i)
    hi = kv - 1
    if window is not None:
        lo = np.maximum(lo, i - window)
        hi = np.minimum(hi, i + window)
    if causal:
        hi = np.minimum(hi, i + kv - q)
    return int(np.maximum(hi - lo + 1, 0).sum())


def environment() -> dict:
    import torch
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
    }
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        env["driver"] = "unknown"
    return env


def _offsets(lens, device):
    import torch

    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.as_tensor(np.asarray(lens, dtype=np.int64)).cumsum(0)
    return out.to(device)


def row_inputs(row: str, dtype, head_dim: int, seed: int, device, causal: bool = False, window=None):
    """A row's inputs: (q, k, v, q_offsets, kv_offsets, dout) drawn from N(0, 1) on the CPU with `seed` (one
    head dim for q, k and v), the op's keyword arguments, and the visible (query, key) pairs times heads."""
    import torch

    q_lens, kv_lens, heads, broadcast = lengths(row, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q_rows = int(q_lens[0]) if broadcast else int(q_lens.sum())
    out_rows, kv_rows = int(q_lens.sum()), int(kv_lens.sum())

    def make(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q, k, v = make(q_rows, heads, head_dim), make(kv_rows, heads, head_dim), make(kv_rows, heads, head_dim)
    dout = make(out_rows, heads, head_dim)
    q_off = None if broadcast else _offsets(q_lens, device)
    kv_off = _offsets(kv_lens, device)
    kwargs = dict(max_q_len=int(q_lens.max()), max_kv_len=int(kv_lens.max()), causal=causal, window=window,
                  broadcast_q=broadcast)
    pairs = visible_pairs(q_lens, kv_lens, window, causal) * heads
    return (q, k, v, q_off, kv_off, dout), kwargs, pairs


def bench_row(row: str, backends, dtype, head_dim: int, causal: bool, window, repeats: int, seed: int,
              copy_gbps: float):
    import torch

    from jfa import backends as registry
    from jfa.peers import Unsupported

    device = torch.device("cuda")
    inputs, kwargs, pairs = row_inputs(row, dtype, head_dim, seed, device, causal, window)
    q, k, v, _, _, dout = inputs
    heads, out_rows = q.shape[1], dout.shape[0]
    fwd_flops = 4.0 * pairs * head_dim
    bwd_flops = 2.5 * fwd_flops
    elem = torch.finfo(dtype).bits // 8
    io = dict(q=q.numel(), k=k.numel(), v=v.numel(), out=out_rows * heads * head_dim)
    fwd_bytes = elem * (io["q"] + io["k"] + io["v"] + io["out"]) + 4 * heads * out_rows
    bwd_bytes = elem * (2 * (io["q"] + io["k"] + io["v"]) + 2 * io["out"]) + 4 * heads * out_rows
    input_bytes = elem * (io["q"] + io["k"] + io["v"] + io["out"])  # q, k, v and dout

    results = []
    for name in backends:
        record = {"row": row, "backend": name, "pairs": pairs, "fwd_flops": fwd_flops, "bwd_flops": bwd_flops}
        try:
            impl = registry.get(name)
            reason = impl.unavailable(device)
        except Exception as error:  # noqa: BLE001 - an unknown or broken backend is a skip
            reason = f"{type(error).__name__}: {error}"
        if reason is not None:
            record["skipped"] = reason
            results.append(record)
            print(f"  {row:9s} {name:13s} skipped: {reason}", flush=True)
            continue
        try:
            _measure(record, name, inputs, kwargs, outputs=elem * io["out"] + 4 * heads * out_rows,
                     grads=elem * (io["q"] + io["k"] + io["v"]), repeats=repeats)
        except (Unsupported, NotImplementedError) as error:
            record["skipped"] = f"{type(error).__name__}: {error}"
        except Exception as error:  # noqa: BLE001 - report and go on with the other backends
            record["error"] = f"{type(error).__name__}: {str(error)[:500]}"
        if "fwdbwd_ms" in record:
            derive(record, fwd_bytes, bwd_bytes, copy_gbps)
        results.append(record)
        torch.cuda.empty_cache()
        _print_record(record)
    compare_with_peer(results)
    return results, input_bytes


def compare_with_peer(results: list[dict]) -> None:
    """Each timed record's ratios to torch-varlen's, of one row of one run (`results`): the forward's, the
    backward's, the forward+backward's and the rooflines'."""
    peer = next((r for r in results if r["backend"] == "torch-varlen" and _measured(r)), None)
    for r in results:
        if peer is None or not _measured(r):
            continue
        for key in (k for k in PASSES if f"{k}_ms" in peer and f"{k}_ms" in r):
            r[f"{key}_vs_varlen"] = peer[f"{key}_ms"] / r[f"{key}_ms"]
        # The most any kernel could reach against FA2 here if the traffic alone set the time.
        for key in (k for k in ("fwd", "bwd") if f"{k}_ms" in peer):
            r[f"{key}_roofline_vs_varlen"] = peer[f"{key}_ms"] / r[f"{key}_floor_ms"]


def derive(record: dict, fwd_bytes: float, bwd_bytes: float, copy_gbps: float) -> None:
    """A timed record's derived figures: TFLOP/s, GB/s, and that GB/s as a share of the device's copy rate, of
    each pass timed, with the time the compulsory traffic alone takes at that rate (floor)."""
    for key, nbytes in (("fwd", fwd_bytes), ("bwd", bwd_bytes)):
        if f"{key}_ms" in record:
            record[f"{key}_tflops"] = record[f"{key}_flops"] / record[f"{key}_ms"] * 1e-9
            record[f"{key}_gbps"] = nbytes / record[f"{key}_ms"] * 1e-6
            record[f"{key}_copy_share"] = record[f"{key}_gbps"] / copy_gbps
        record[f"{key}_floor_ms"] = nbytes / copy_gbps * 1e-6


def copy_rate_gbps(nbytes: int = 2**30) -> float:
    """The device's copy rate, GB/s of bytes read plus written by a copy of `nbytes` (the memory roofline the
    rows' GB/s are measured against: DESIGN.md's ~4.3 TB/s on the H200)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_ms(lambda: dst.copy_(src), 3) * 1e-6


def _median_ms(fn, repeats: int) -> float:
    """The median of `repeats` do_bench means of fn (ms)."""
    import triton.testing

    return float(np.median([triton.testing.do_bench(fn, warmup=25, rep=100) for _ in range(repeats)]))


class SmClock:
    """The GPU's mean SM clock (MHz) over a `with` block, read every 5 ms from a thread by
    `torch.cuda.clock_rate` (NVML, with torch's mapping of CUDA_VISIBLE_DEVICES; `mhz` is None where it cannot
    be read: no pynvml, no driver). Under sustained load the H200 lowers its clock: the TLX forward on the long
    row took 1.70 ms per call in a burst of five at 1980 MHz and 1.80 ms over the last calls of one do_bench,
    and the do_bench after it ran at 1851 MHz on average, 1785 at least (2026-12-01). A time means little
    without the clock it ran at."""

    def __init__(self, device=None):
        import torch

        self._read = functools.partial(torch.cuda.clock_rate, device)
        try:
            self._read()
        except Exception:  # noqa: BLE001 - pynvml missing, no driver: no clock
            self._read = None
        self.mhz = None

    def __enter__(self):
        self._samples, self._done = [], threading.Event()
        if self._read is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.005):
            self._samples.append(self._read())

    def __exit__(self, *exc):
        self._done.set()
        if self._read is not None:
            self._thread.join()
        self.mhz = float(np.mean(self._samples)) if self._samples else None


def idle_time(intervals) -> float:
    """Within the span from the first interval's start to the last one's end, the time no interval covers
    (intervals may overlap: copies beside kernels)."""
    idle, covered_to = 0.0, None
    for start, end in sorted(intervals):
        if covered_to is not None and start > covered_to:
            idle += start - covered_to
        covered_to = end if covered_to is None else max(covered_to, end)
    return idle


def steady_calls(spans, calls: int) -> tuple[list, int]:
    """The device events (start, end) of `calls` + 1 recorded back-to-back calls less the first call's, and how
    many calls they are: the first began on an idle GPU, so its host work before the launch would count as
    idle time. Calls are told apart by count, each making the same number of events (the same path every time);
    if the count does not divide evenly, every event and every call."""
    spans = sorted(spans)
    per_call, rest = divmod(len(spans), calls + 1)
    if per_call == 0 or rest:
        return spans, calls + 1
    return spans[per_call:], calls


def _device_profile(fn, calls: int = 5) -> tuple[float, float]:
    """(device ms, idle ms) of one call over `calls` back-to-back calls, from the profiler's GPU timeline: the
    kernels' and copies' time, and the time between the first one's start and the last one's end in which the
    GPU ran nothing (what it waited for the host: its launches, and the offsets check each call syncs on).
    A first call runs under the profiler's warm-up step, untimed, and finishes before the recorded ones: the
    tracer's start-up left the GPU idle 0.6-0.9 ms in the first call it records (H200, 2026-12-01). The first
    recorded call then starts on an idle GPU, and `steady_calls` leaves it out."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    events = []  # the recorded steps' events (the profiler clears them when its cycle ends)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=1, active=calls + 1),
                 on_trace_ready=lambda prof: events.extend(prof.events())) as prof:
        for step in range(calls + 2):
            fn()
            if step in (0, calls + 1):  # the warm-up call's work stays out; the last call's is all recorded
                torch.cuda.synchronize()
            prof.step()
    spans, counted = steady_calls([(e.time_range.start, e.time_range.end) for e in events
                                   if e.device_type == DeviceType.CUDA], calls)
    device = sum(end - start for start, end in spans) / counted * 1e-3
    return device, idle_time(spans) / counted * 1e-3


def _measure(record, name, inputs, kwargs, outputs: int, grads: int, repeats: int) -> None:
    """Times the forward, the backward and the forward+backward of one backend into `record` (ms, peak extra
    bytes)."""
    import torch

    import jfa

    q, k, v, q_off, kv_off, dout = inputs
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def forward():
        with torch.no_grad():
            return jfa.attention(q, k, v, q_off, kv_off, backend=name, **kwargs)

    def backward_of_one_forward():
        """The backward alone: gradients over one forward's graph, kept for the next call (retain_graph)."""
        out = jfa.attention(*leaves, q_off, kv_off, backend=name, **kwargs)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)

    def forward_backward():
        out = jfa.attention(*leaves, q_off, kv_off, backend=name, **kwargs)
        return torch.autograd.grad(out, leaves, dout)

    for key, make, out_bytes in (("fwd", lambda: forward, outputs), ("bwd", backward_of_one_forward, grads),
                                 ("fwdbwd", lambda: forward_backward, outputs + grads)):
        fn = make()  # the backward's forward is made here, so its graph's tensors count in `base` below
        untimed = warm_up(fn, may_refuse=key == "bwd")
        if untimed:  # no backward alone to time; the forward+backward still is
            record["bwd_untimed"] = untimed
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        record[f"{key}_extra_bytes"] = max(0, torch.cuda.max_memory_allocated() - base - out_bytes)
        del result
        with SmClock(q.device) as clock:
            record[f"{key}_ms"] = _median_ms(fn, repeats)
        record[f"{key}_sm_mhz"] = clock.mhz
        record[f"{key}_device_ms"], record[f"{key}_idle_ms"] = _device_profile(fn)


def warm_up(fn, may_refuse: bool) -> str | None:
    """Calls fn twice: the first compiles, autotunes and caches the schedule, the second shows fn runs again over
    the same state. Where may_refuse (the backward alone, over one retained graph), a RuntimeError of either call
    is returned as the reason fn cannot be timed, and raised otherwise: flex's compiled backward with donated
    buffers refuses retain_graph=True at its first call (every row but gem on the H100, 2026-12-05)."""
    try:
        fn()
        fn()
    except RuntimeError as error:
        if not may_refuse:
            raise
        return f"{type(error).__name__}: {str(error)[:300]}"
    return None


def _measured(r: dict) -> bool:
    """Whether record r holds its timings (a skipped or failed backend's holds its reason instead; the backward
    alone may be missing, `bwd_untimed` saying why)."""
    return "fwd_ms" in r and "fwdbwd_ms" in r


def _print_record(r):
    if not _measured(r):
        print(f"  {r['row']:9s} {r['backend']:13s} {r.get('skipped') or r.get('error')}", flush=True)
        return
    print(f"  {r['row']:9s} {r['backend']:13s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s  "
          f"bwd {_value(r, 'bwd_ms', '8.3f')} ms {_value(r, 'bwd_tflops', '6.1f')} TF/s", flush=True)


def print_table(results) -> None:
    head = (f"{'row':9s} {'backend':13s} {'fwd ms':>8s} {'TF/s':>6s} {'xFA2':>5s} {'bwd ms':>8s} {'TF/s':>6s} "
            f"{'xFA2':>5s} {'f+b xFA2':>8s} {'fwd GB/s':>8s} {'bwd GB/s':>8s} {'copy% f/b':>9s} "
            f"{'extra MiB f/fb':>15s} {'dev ms f/b/fb':>19s} {'idle f/b/fb':>17s} {'MHz f/b/fb':>14s}")
    print(head)
    print("-" * len(head))
    for r in results:
        if not _measured(r):
            print(f"{r['row']:9s} {r['backend']:13s} {r.get('skipped') or r.get('error')}")
            continue

        def ratio(key, r=r, width=5):
            return _value(r, key, f"{width}.2f")

        extra = f"{r['fwd_extra_bytes'] / 2**20:.0f}/{r['fwdbwd_extra_bytes'] / 2**20:.0f}"
        copy = "/".join(_value(r, f"{key}_copy_share", ".0f", 100) for key in ("fwd", "bwd"))
        device, idle, clocks = (_per_pass(r, field, digits, "/") for field, digits in
                                (("device_ms", 3), ("idle_ms", 3), ("sm_mhz", 0)))
        print(f"{r['row']:9s} {r['backend']:13s} {r['fwd_ms']:8.3f} {r['fwd_tflops']:6.1f} {ratio('fwd_vs_varlen')} "
              f"{_value(r, 'bwd_ms', '8.3f')} {_value(r, 'bwd_tflops', '6.1f')} {ratio('bwd_vs_varlen')} "
              f"{ratio('fwdbwd_vs_varlen', width=8)} {r['fwd_gbps']:8.0f} {_value(r, 'bwd_gbps', '8.0f')} {copy:>9s} "
              f"{extra:>15s} {device:>19s} {idle:>17s} {clocks:>14s}")


def print_rooflines(results, copy_gbps: float) -> None:
    """Per row, the time its compulsory traffic takes at the copy rate, and the ratio to torch-varlen a
    kernel at that floor (with no host time) would have: beyond it only by moving bytes faster than a copy."""
    print(f"memory roofline at the device copy rate, {copy_gbps:.0f} GB/s (read + write):")
    seen = set()
    for r in results:
        if "fwd_roofline_vs_varlen" in r and r["row"] not in seen:
            seen.add(r["row"])
            print(f"  {r['row']:9s} fwd >= {r['fwd_floor_ms']:.3f} ms (at most {r['fwd_roofline_vs_varlen']:.2f}x "
                  f"FA2), bwd >= {r['bwd_floor_ms']:.3f} ms (at most {_value(r, 'bwd_roofline_vs_varlen', '.2f')}x "
                  "FA2)")


def _value(r: dict, key: str, spec: str, times: float = 1) -> str:
    """Record r's `key` (times `times`) formatted by `spec`, or '-' right-aligned in its width where r lacks it
    (a backward not timed alone, a ratio without a peer)."""
    if r.get(key) is None:
        return f"{'-':>{spec.split('.')[0] or 0}}"
    return f"{times * r[key]:{spec}}"


def _per_pass(r: dict, field: str, digits: int, sep: str = " / ") -> str:
    """Record r's `field` (device_ms, idle_ms, sm_mhz) of each pass, '-' where it was not measured (no NVML for
    the clock; a run before the backward had its own timing, 2026-12-05)."""
    return sep.join(_value(r, f"{key}_{field}", f".{digits}f") for key in PASSES)


def _reason_cell(reason: str, limit: int = 160) -> str:
    """Why a backend has no timings, as one markdown cell: its first line (an error's text may run over many,
    and a newline would end the table's row), '|' escaped, at most `limit` characters; the JSON keeps it whole."""
    line = reason.splitlines()[0] if reason else ""
    line = line if len(line) <= limit else line[:limit - 1] + "…"
    return line.replace("|", "\\|")


def _markdown_line(r: dict, label: str) -> str:
    """One table line of record r (the row's name only on its first line: `label` is the backend's)."""
    def rate(key):
        if f"{key}_tflops" not in r:
            return "-"
        flops = f"{r[f'{key}_tflops']:.1f}"
        return f"{flops} ({r[f'{key}_gbps']:.0f} GB/s)" if r["row"] in MEMORY_BOUND_ROWS else flops

    if not _measured(r):
        return f"| {label} | {_reason_cell(r.get('skipped') or r.get('error'))} |" + " |" * 9
    return (f"| {label} | {r['fwd_ms']:.3f} | {rate('fwd')} | {_value(r, 'fwd_vs_varlen', '.2f')} | "
            f"{_value(r, 'bwd_ms', '.3f')} | {rate('bwd')} | {_value(r, 'bwd_vs_varlen', '.2f')} | "
            f"{_value(r, 'fwdbwd_vs_varlen', '.2f')} | "
            f"{_per_pass(r, 'device_ms', 3)} | {_per_pass(r, 'idle_ms', 3)} | {_per_pass(r, 'sm_mhz', 0)} |")


def markdown_table(runs: list[dict]) -> str:
    """The runs (as --json writes them) as one markdown table: per row of ROWS, every run's records in run order;
    with several runs, each record marked with its run's footnote (¹, ², ...) and `triton` under fbtriton named
    so; then the footnotes (each says how its run timed the backward)."""
    marks = "¹²³⁴⁵⁶⁷⁸⁹" if len(runs) > 1 else ""
    lines = ["| row | backend | fwd ms | fwd TF/s | fwd ×FA2 | bwd ms | bwd TF/s | bwd ×FA2 | fwd+bwd ×FA2 "
             "| dev ms fwd / bwd / fwd+bwd | idle fwd / bwd / fwd+bwd | MHz fwd / bwd / fwd+bwd |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:  # the ratios again, so that a run written before a ratio was added gets it too
        for row in ROWS:
            compare_with_peer([r for r in run["results"] if r["row"] == row])
    for row in ROWS:
        first = True
        for i, run in enumerate(runs):
            fbtriton = "+fb" in run["environment"]["triton"]
            for r in (r for r in run["results"] if r["row"] == row):
                name = "triton under fbtriton" if fbtriton and r["backend"] == "triton" else r["backend"]
                label = f"{row if first else ''} | {name}{' ' + marks[i] if marks else ''}"
                lines.append(_markdown_line(r, label))
                first = False
    lines.append("")
    for i, run in enumerate(runs):
        env = run["environment"]
        backward = ("the backward timed alone" if any("bwd_device_ms" in r for r in run["results"])
                    else "the backward (fwd+bwd) − fwd")
        lines.append(f"{marks[i] + ' ' if marks else ''}{env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
                     f"run started {env['date']}, copy rate {run['copy_gbps']:,.0f} GB/s, {backward}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="jfa kernels vs peers on DESIGN.md's workloads (CUDA only)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="do_bench calls per measurement (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write results and environment here")
    parser.add_argument("--markdown", nargs="+", metavar="RUN.json",
                        help="print these --json runs as one markdown table instead of measuring")
    args = parser.parse_args(argv)
    if args.markdown:
        runs = []
        for path in args.markdown:
            with open(path) as f:
                runs.append(json.load(f))
        print(markdown_table(runs))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("jfa.bench needs a CUDA GPU (none is visible): nothing to measure on the CPU")
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    env = environment()
    print(f"{env['gpu']}  driver {env['driver']}  CUDA {env['cuda']}  torch {env['torch']}  triton {env['triton']}  "
          f"{args.dtype} D={args.head_dim} causal={args.causal} window={args.window}", flush=True)
    print("TFLOP/s count visible pairs only: forward 4·pairs·D per head, backward 2.5x that; "
          "backward time = the backward alone (autograd.grad over one forward's retained graph); "
          "xFA2 = torch-varlen time / this time; dev ms f/b/fb = the kernels and copies of a forward, a backward "
          "and a forward+backward (profiler); idle f/b/fb = the GPU's idle time per call between them over "
          "back-to-back calls (profiler timeline: what it waited for the host); MHz f/b/fb = the mean SM clock "
          "during each timing (NVML; '-' without pynvml).", flush=True)
    copy_gbps = copy_rate_gbps()
    results = []
    for row in args.rows:
        rows, _ = bench_row(row, args.backends, dtype, args.head_dim, args.causal, args.window, args.repeats,
                            args.seed, copy_gbps)
        results += rows
    print()
    print_table(results)
    print_rooflines(results, copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "copy_gbps": copy_gbps, "results": results}, f,
                      indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
