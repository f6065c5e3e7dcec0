"""The Triton backend (`jfa.triton.backend:BACKEND`): block configs, tile schedules and kernel launches.

Configs. Block shapes and warps are fixed per head-dim class (the larger padded head dim of q/k and v: <= 64,
128, 256) and dtype-independent: they decide the order of every floating-point reduction, so changing them
with the batch would break batch invariance (a sequence must get the same bits alone and inside any batch).
`triton.autotune` only chooses num_stages, keyed on head dims, dtype (the autotuner adds argument dtypes to
the key), causal/window and a coarse length-profile class of the batch (`jfa.tile_scheduler.profile_class`),
and only with JFA_TRITON_AUTOTUNE=1: a choice that follows the length profile may compile a sequence's kernel
differently alone than in a batch (the first H200 run of the premerge profile, tuned, failed batch invariance
in the packed backward, while the untuned self-test passed its batch-invariance cases), and the pipelining
depth is not promised to leave the arithmetic alone. By default the first listed stage count is used. Under
TRITON_INTERPRET=1 the same configs are used (the CPU run verifies the tiling that ships, and larger blocks
are what makes the interpreter fast enough for CI) and nothing is tuned; the unit tests force SMALL_BLOCKS
(16/32) for many block boundaries at test sizes.

Scheduling (`jfa.tile_scheduler`): JFA_TRITON_SCHEDULE = dynamic (default: atomic tile counter), static
(zigzag) or grid (one program per tile); `set_schedule` overrides it in-process. Persistent grids are
SMs × the programs an SM holds at once (`KernelConfig.resident`, from ptxas's register and shared-memory
figures), never more: static dealing assumes every program starts at once. Tile tables are cached
per distinct length profile (`Problem.lengths_key`, which names the validated offsets' values), so repeated
calls on the same batch shape skip the host work and the host-to-device copy.

Memory beyond inputs, outputs and lse: residuals m and l ([Hq, rows] fp32 each), D ([Hq, rows] fp32) in
the backward, tile tables (O(T) int32) and, with broadcast_q, fp32 dq partials ([rows, Hq, D]).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import triton

from jfa import tile_scheduler as ts
from jfa.launch import device_facts, launch_confirmed, prepare
from jfa.problem import Problem
from jfa.softmax import ROW_RECORD
from jfa.triton import backward as bwd_kernels
from jfa.triton import forward as fwd_kernels

LOG2E = 1.4426950408889634
# |sm_scale|·log2(e) is floored at this value: with sm_scale = 0 the masked scores would compute
# (-inf)·0 = NaN; a floor this small changes no unmasked probability (exp2 of < 1e-18 rounds to 1).
MIN_SCALE_LOG2 = 1e-30


def scale_log2(problem: Problem) -> float:
    """The kernels' exp2 multiplier of the raw scores: |sm_scale|·log2(e), floored at MIN_SCALE_LOG2 (the
    sign is the kernels' NEG_SCALE). Shared by the Triton launches and the tlx backend's."""
    return max(abs(problem.sm_scale) * LOG2E, MIN_SCALE_LOG2)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if interpreting():
    from jfa.triton.interpreter import skip_nested_language_patching, skip_overflow_arithmetic

    skip_nested_language_patching()
    skip_overflow_arithmetic()


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per block
    block_n: int  # keys per block
    num_warps: int
    stages: tuple[int, ...]  # num_stages candidates; the first is used without autotuning
    resident: int = 1  # programs one SM holds at once (registers, shared memory): persistent grid = SMs × this
    # ptxas's register cap per thread (Triton's `maxnreg`), None: its own choice (up to 255). A latency-bound
    # kernel may run faster with more programs per SM at fewer registers each, some spilled.
    max_registers: int | None = None


@dataclass(frozen=True)
class BackendConfig:
    fwd: KernelConfig
    dq: KernelConfig
    dkv: KernelConfig
    # Short-query backward: block_m is the longest query sequence it takes (all its rows in one tile); None:
    # no short-query path in this class (every sequence that is not packed takes the two passes).
    short_bwd: KernelConfig | None
    # Packed kernels: block_m == block_n == the packed tile size; sequences whose longer side fits are
    # packed (forward and backward separately: the backward of a packed tile holds more accumulators).
    packed_fwd: KernelConfig
    packed_bwd: KernelConfig


@functools.cache  # per call otherwise: five dataclasses built in the host time the GPU waits for
def gpu_config(block_d: int) -> BackendConfig:
    """Block configs for the H100/H200 by padded head dim (see the module docstring).

    First chosen so that `ptxas` (sm_90a) reported no or almost no register spills (checked on a CPU with
    `python -m jfa.triton.gpu_selftest --compile-only`), then retimed (below), which decides: the ordinary
    dK/dV kernel keeps ~200-450 bytes of spill at head dims 80-128 in every shape tried (the dk and dv
    accumulators plus the transposed score tile and its per-column statistics), and above 128 every retimed
    kernel spills 240-640 bytes yet runs 2-3x faster than the spill-free configs it replaced. `resident`
    follows from the registers and shared memory ptxas reports (65,536 registers and 228 KiB per SM): two
    4-warp programs of <= 255 registers fit.
    The <= 128 class's dq, dkv and packed_bwd were retimed on the H200 with `python -m jfa.triton.tune`
    (2026-11-30, triton 3.6; kernel time over jfa.bench's rows): dq at 3 stages instead of 2, 0.80x the
    time; dkv 32x64 with 4 warps, two per SM, instead of 32x128 with 8, 0.89x (0.88x on each of gem, long
    and skew); packed_bwd with 4 warps, two per SM, 0.60x on the tiny row. fwd and packed_fwd were fastest
    as shipped (within 1%). The <= 64 class's fwd, dq and dkv were retimed the same way (2026-11-30, head
    dim 64, rows gem, long and skew): four warps, two programs per SM, at 0.90x (fwd 64x64), 0.59x (dq 64x64)
    and 0.77x (dkv 32x128) of the 8-warp configs they replace; its packed configs were not retimed. So were
    the <= 256 class's (head dim 256, rows gem and long): fwd 64x32 with 4 warps at 3 stages 0.55x, dq 64x64
    0.46x, dkv 32x32 with 4 warps, two per SM (68 KiB of shared memory each), 0.32x; packed not retimed.
    The short-query backward (128 query rows x 64 keys, 8 warps: ptxas 255 registers, 190-360 bytes of spill
    at head dim 128, none at 64) was timed at head dim 128 over the skew and broadcast rows (2026-11-30):
    3 stages 0.83x the time of 2 on broadcast (1.55 against 1.86 ms), the fastest of 11 candidates; 4 warps
    2.1x slower, 128 keys 1.4x. The <= 64 class takes the same by analogy (not timed). Above 128 there is no
    short-query path: its config there (64 query rows x 32 keys, 8 warps; 204 KiB of shared memory) passed
    the verify suite on stock triton 3.6 but, compiled by fbtriton 3.7.4 (the tlx backend's backward), hit
    an illegal address on head_dims:16 (D 192) and under compute-sanitizer returned other gradients with no
    memcheck error (2026-11-30 12:55 UTC); it was never timed either (no bench row has such sequences).
    """
    if block_d <= 64:
        return BackendConfig(
            fwd=KernelConfig(64, 64, 4, (4, 3), resident=2),
            dq=KernelConfig(64, 64, 4, (3, 2), resident=2),
            dkv=KernelConfig(32, 128, 4, (2, 3), resident=2),
            short_bwd=KernelConfig(128, 64, 8, (3, 2)),
            packed_fwd=KernelConfig(64, 64, 4, (2, 1), resident=2),
            packed_bwd=KernelConfig(64, 64, 8, (2, 1)),
        )
    if block_d <= 128:
        return BackendConfig(
            fwd=KernelConfig(128, 64, 8, (3, 2)),
            dq=KernelConfig(128, 64, 8, (3, 2)),
            dkv=KernelConfig(32, 64, 4, (3, 2), resident=2),
            short_bwd=KernelConfig(128, 64, 8, (3, 2)),
            packed_fwd=KernelConfig(64, 64, 4, (2, 1), resident=2),
            packed_bwd=KernelConfig(32, 32, 4, (1,), resident=2),
        )
    return BackendConfig(
        fwd=KernelConfig(64, 32, 4, (3, 2)),
        dq=KernelConfig(64, 64, 8, (2,)),
        dkv=KernelConfig(32, 32, 4, (2, 3), resident=2),
        short_bwd=None,
        packed_fwd=KernelConfig(64, 64, 8, (2, 1)),
        packed_bwd=KernelConfig(32, 32, 8, (1,)),
    )


# Many block boundaries (sequence ends, diagonal and window blocks, several online-softmax rescales) at the
# unit tests' sizes, which the shipped blocks would mostly cover in one block: tests set it with set_config.
SMALL_BLOCKS = BackendConfig(
    fwd=KernelConfig(16, 16, 4, (1,)),
    dq=KernelConfig(16, 16, 4, (1,)),
    dkv=KernelConfig(16, 16, 4, (1,)),
    short_bwd=KernelConfig(32, 16, 4, (1,)),
    packed_fwd=KernelConfig(32, 32, 4, (1,)),
    packed_bwd=KernelConfig(32, 32, 4, (1,)),
)

# The packed forward's forms per compiler, all with the same bits; ptxas spills its registers under fbtriton (Triton
# with TLX, the tlx backend's) where stock triton fits them. How the first launch finds the tiles to redo
# (`jfa.triton.forward._fwd_packed_head`): stock triton takes a row vector carried over the heads (the tiny bench
# row's forward kernels 0.751 ms, against 0.792 with one value per head), fbtriton one value per head (1.132 ms
# against 2.209: the row vector took its spill from 444 to 948 bytes); H200, 2026-12-03. Whether each head asks
# L2 for the next head's rows (`jfa.triton.forward.prefetch_rows`; the forward's last head for the next tile's
# first): stock triton does (0.748 -> 0.703 ms, the next tile 0.648 -> 0.637 on 2026-12-05; the packed backward
# 2.215 -> 2.151), fbtriton not (its forward's spill 236 -> 272 bytes, the tlx bench row's forward 1.14 -> 1.18 ms
# of device time; the backward not measured there); H200, 2026-12-04.
FBTRITON = importlib.util.find_spec("triton.language.extra.tlx") is not None
FLAG_PER_HEAD = FBTRITON
PREFETCH_NEXT_HEAD = not FBTRITON

# The known gap the `isolation_grad` invariant finds (tests/test_triton_backend.py pins it with a strict xfail).
ISOLATION_GRAD_GAP = (
    "known and open: the packed backward multiplies a tile's slots with one another's at weight 0 (dS·K, dSᵀ·Q, "
    "Pᵀ·dO), so 0·NaN = NaN reaches the gradients of the tile's other sequences; the packed forward redoes such "
    "tiles isolated per slot, the backward not yet (every check tried added 12-22% to the tiny bench row's "
    "forward+backward on the H200)")

_config_override: BackendConfig | None = None
_schedule_override: int | None = None
_programs_override: int | None = None


def set_config(config: BackendConfig | None) -> None:
    """Forces one config for every call (tests; None restores the default)."""
    global _config_override
    _config_override = config
    _SCHEDULE_CACHE.clear()


def set_schedule(name: str | None, programs: int | None = None) -> None:
    """Forces a scheduling mode ('static', 'dynamic', 'grid') and optionally the persistent grid size."""
    global _schedule_override, _programs_override
    _schedule_override = None if name is None else ts.SCHEDULES[name]
    _programs_override = programs


def schedule_mode() -> int:
    if _schedule_override is not None:
        return _schedule_override
    name = os.environ.get("JFA_TRITON_SCHEDULE", "dynamic")
    if name not in ts.SCHEDULES:
        raise ValueError(f"JFA_TRITON_SCHEDULE must be one of {sorted(ts.SCHEDULES)}, got {name!r}")
    return ts.SCHEDULES[name]


def padded_dim(n: int) -> int:
    """A head dim as the kernels tile it: the next power of two, at least 16 (tl.dot's smallest tile)."""
    return 1 << max(4, (n - 1).bit_length())


def config_for(problem: Problem) -> BackendConfig:
    if _config_override is not None:
        return _config_override
    return gpu_config(max(padded_dim(problem.head_dim), padded_dim(problem.head_dim_v)))


# ---------------------------------------------------------------------------------------------------------
# Tile schedules, cached per length profile.

_SCHEDULE_CACHE: OrderedDict = OrderedDict()
_SCHEDULE_CACHE_SIZE = 16


@dataclass
class DeviceSchedule:
    host: ts.Schedule
    fwd: torch.Tensor
    dq: torch.Tensor
    dkv: torch.Tensor
    short_bwd: torch.Tensor
    pack_fwd_seqs: torch.Tensor
    pack_fwd_shift: torch.Tensor
    pack_bwd_seqs: torch.Tensor
    pack_bwd_shift: torch.Tensor


def effective_window(problem: Problem) -> int:
    """The window as the kernels get it: clamped to the longest sequence (|i - j| < max length always), an
    equivalent rule that keeps window arithmetic inside int32."""
    if problem.window is None:
        return 0
    longest = int(max(problem.q_lens.max(), problem.kv_lens.max())) if problem.batch else 0
    return min(problem.window, longest)


def device_schedule(problem: Problem, config: BackendConfig) -> DeviceSchedule:
    window = None if problem.window is None else effective_window(problem)
    key = (problem.lengths_key, problem.q_heads, problem.kv_heads, window, problem.causal, config,
           str(problem.device))
    value = _SCHEDULE_CACHE.get(key)
    if value is not None:
        _SCHEDULE_CACHE.move_to_end(key)
        return value
    host = ts.build_schedule(
        problem.q_lens.numpy(), problem.kv_lens.numpy(), q_heads=problem.q_heads, kv_heads=problem.kv_heads,
        window=window, causal=problem.causal, fwd_blocks=(config.fwd.block_m, config.fwd.block_n),
        dq_blocks=(config.dq.block_m, config.dq.block_n), dkv_blocks=(config.dkv.block_m, config.dkv.block_n),
        short_bwd_blocks=(config.short_bwd.block_m, config.short_bwd.block_n) if config.short_bwd else (0, 0),
        pack_fwd=config.packed_fwd.block_m, pack_bwd=config.packed_bwd.block_m,
    )
    parts = [host.fwd.entries.ravel(), host.dq.entries.ravel(), host.dkv.entries.ravel(),
             host.short_bwd.entries.ravel(),
             host.packed_fwd.row_seqs().ravel(), host.packed_fwd.shift.ravel(),
             host.packed_bwd.seqs.ravel(), host.packed_bwd.shift.ravel()]
    sizes = [p.size for p in parts]
    flat = torch.from_numpy(np.concatenate(parts).astype(np.int32)).to(problem.device)
    views = list(torch.split(flat, sizes))
    value = _SCHEDULE_CACHE[key] = DeviceSchedule(host, *views)
    while len(_SCHEDULE_CACHE) > _SCHEDULE_CACHE_SIZE:
        _SCHEDULE_CACHE.popitem(last=False)
    return value


def _programs(n_tiles: int, cfg: KernelConfig, schedule: int, device: torch.device) -> int:
    """Grid size: one program per tile (GRID), else the programs the GPU holds at once (never more: static
    dealing assumes every program runs from the start)."""
    if schedule == ts.GRID:
        return n_tiles
    if _programs_override is not None:
        return max(1, min(n_tiles, _programs_override))
    if interpreting() or device.type != "cuda":
        return max(1, min(n_tiles, 3))
    sms = device_facts(device)[1]
    return max(1, min(n_tiles, sms * cfg.resident))


# ---------------------------------------------------------------------------------------------------------
# Launching (with or without autotuning).

_TUNED: dict = {}


def _autotune_enabled() -> bool:
    return not interpreting() and os.environ.get("JFA_TRITON_AUTOTUNE", "0") == "1"


def _launch(kernel, cfg: KernelConfig, grid: int, problem: Problem, **kwargs) -> None:
    """Launches once the problem is confirmed (a speculative problem's offsets are the caller's before anything
    reads them), the launch's host work done before (`jfa.launch`)."""
    if _autotune_enabled() and len(cfg.stages) > 1:
        key = (kernel, cfg)
        if key not in _TUNED:
            configs = [triton.Config({}, num_warps=cfg.num_warps, num_stages=s, maxnreg=cfg.max_registers)
                       for s in cfg.stages]
            _TUNED[key] = triton.autotune(
                configs=configs, key=["HEAD_DIM", "HEAD_DIM_V", "profile", "CAUSAL", "HAS_WINDOW"],
                reset_to_zero=["counter"], restore_value=["counter"],
            )(kernel)
        launch_confirmed(problem, _TUNED[key], (grid,), **kwargs)
    else:
        registers = {} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}
        launch_confirmed(problem, kernel, (grid,), **kwargs, num_warps=cfg.num_warps, num_stages=cfg.stages[0],
                         **registers)


def _counter(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _common(problem: Problem) -> dict:
    scale = problem.sm_scale
    return dict(
        q_offsets=problem.q_offsets, out_offsets=problem.out_offsets, kv_offsets=problem.kv_offsets,
        scale_log2=scale_log2(problem), window=effective_window(problem),
        group=problem.group_size, HEAD_DIM=problem.head_dim, HEAD_DIM_V=problem.head_dim_v,
        BLOCK_D=padded_dim(problem.head_dim), BLOCK_DV=padded_dim(problem.head_dim_v),
        NEG_SCALE=scale < 0, HAS_WINDOW=problem.window is not None, CAUSAL=problem.causal,
        INTERPRET=interpreting(),
    )


# In-tile offsets are int32: BLOCK x stride_t + BLOCK_D x stride_d must stay below 2^31 (255·2^22·2 < 2^31).
_MAX_TILE_STRIDE = 1 << 22


def _tileable(x: torch.Tensor) -> torch.Tensor:
    """x itself, or a contiguous copy when its row or column stride is too large for int32 in-tile
    offsets (row offsets of whole sequences are int64 and take any stride)."""
    if x.stride(0) < _MAX_TILE_STRIDE and x.stride(2) < _MAX_TILE_STRIDE:
        return x
    return x.contiguous()


def _strides(prefix: str, x: torch.Tensor, dims: str) -> dict:
    return {f"{prefix}_{d}": x.stride(i) for i, d in enumerate(dims)}


def forward(q, k, v, problem: Problem, fwd_pass=None):
    """out, lse and the residuals (m, l). `fwd_pass`, if given, runs the forward of the ordinary sequences in
    place of `_fwd_kernel` (the tlx backend's kernel does): fwd_pass(q, k, v, out, lse, row_max, row_sum, table,
    problem), with `table` the tile table this kernel would have run (its sequences are the ones to do); the
    packed kernel still takes the tiny sequences, in place."""
    q, k, v = _tileable(q), _tileable(k), _tileable(v)
    rows, hq = problem.out_rows, problem.q_heads
    device = q.device
    out = torch.empty(rows, hq, problem.head_dim_v, dtype=q.dtype, device=device)
    lse, row_max, row_sum = (torch.empty(hq, rows, dtype=torch.float32, device=device) for _ in range(3))
    if rows == 0:
        return out, lse, (row_max, row_sum)
    config = config_for(problem)
    sched = device_schedule(problem, config)
    schedule = schedule_mode()
    args = dict(
        Q=q, K=k, V=v, Out=out, Lse=lse, RowMax=row_max, RowSum=row_sum,
        **_strides("sq", q, "thd"), **_strides("sk", k, "thd"), **_strides("sv", v, "thd"),
        so_t=out.stride(0), so_h=out.stride(1), stat_h=lse.stride(0),
        scale_abs=abs(problem.sm_scale), profile=sched.host.profile, SCHEDULE=schedule, **_common(problem),
    )
    table = sched.host.fwd
    if table.n_tiles and fwd_pass is not None:
        fwd_pass(q, k, v, out, lse, row_max, row_sum, table, problem)
    elif table.n_tiles:
        n = table.n_tiles
        _launch(fwd_kernels._fwd_kernel, config.fwd, _programs(n, config.fwd, schedule, device),
                problem, tiles=sched.fwd, n_tiles=n, counter=_counter(device), n_heads=hq,
                BLOCK_M=config.fwd.block_m, BLOCK_N=config.fwd.block_n, **args)
    packed = sched.host.packed_fwd
    if packed.n_tiles:
        # counter[0]: the dynamic schedule's; counter[1:]: the tiles the first launch lists for the redo launch
        # (`jfa.triton.forward.flag_tile`), whose programs read one integer and exit when none is listed.
        n = packed.n_tiles
        counter = torch.zeros(2 + n, dtype=torch.int32, device=device)
        grid = _programs(n, config.packed_fwd, schedule, device)
        for redo in (False, True):
            _launch(fwd_kernels._fwd_packed_kernel, config.packed_fwd, grid, problem, pack_seqs=sched.pack_fwd_seqs,
                    pack_shift=sched.pack_fwd_shift, n_tiles=n, counter=counter, n_heads=hq, BLOCK=packed.block,
                    SLOTS=packed.block // ts.PACK_ALIGN, REDO=redo, FLAG_PER_HEAD=FLAG_PER_HEAD,
                    PREFETCH=PREFETCH_NEXT_HEAD, **args)
    return out, lse, (row_max, row_sum)


def backward(dout, q, k, v, out, lse, residuals, problem: Problem, dkv_pass=None, dq_pass=None,
             dq_in_dkv: bool = False, short_pass=None):
    """dq, dk, dv. `dkv_pass`, if given, runs the dK/dV pass of the ordinary sequences in place of
    `_dkv_kernel` (the tlx backend's kernel does): dkv_pass(q, k, v, dout, dk, dv, row_max, row_sum, delta,
    table, problem), called after the dQ pass has stored D, with `table` the dK/dV tile table this pass would
    have run (its sequences are the ones to do). `dq_pass` likewise replaces `_dq_kernel` without broadcast_q:
    dq_pass(q, k, v, out, dout, dq, row_max, row_sum, delta, table, problem) stores dq and D of the sequences
    of the dQ tile table `table`.

    `dq_in_dkv` (with `dkv_pass`): the dK/dV pass also adds the ordinary sequences' dq, times the scale, into
    a zeroed fp32 dq at the output rows (the broadcast_q partial layout, whichever the batch), given to it
    as `dq=`; `_delta_kernel` computes D first and no dQ pass runs; the packed and short-query kernels write
    their fp32 rows there too, and `_dq_reduce_kernel` rounds (and for broadcast_q adds) them into dq. Without
    ordinary sequences (no dK/dV tiles) it does not apply: the packed kernels' usual dq is cheaper.

    `short_pass` likewise replaces `_bwd_short_kernel`: short_pass(q, k, v, out, dout, dq, dk, dv, row_max,
    row_sum, schedule, problem, partial) over the short-query tile table of `schedule` (the host `ts.Schedule`),
    `dq` the fp32 partial target when `partial`, else dq itself; like that kernel it computes its rows' D. It
    returns None, or with broadcast_q the partials `_dq_reduce_kernel` is to sum in place of one per sequence:
    device int32 [Hq, n], per head the sequences whose partial rows hold that head's terms, in the order of the
    sum (-1: none), every pass's included."""
    row_max, row_sum = residuals
    device = q.device
    dq = torch.empty(q.shape, dtype=q.dtype, device=device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=device)
    rows, hq = problem.out_rows, problem.q_heads
    if rows == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    q, k, v, dout = _tileable(q), _tileable(k), _tileable(v), _tileable(dout)
    config = config_for(problem)
    sched = device_schedule(problem, config)
    schedule = schedule_mode()
    dq_in_dkv = dq_in_dkv and sched.host.dkv.n_tiles > 0
    partial = problem.broadcast_q or dq_in_dkv
    dq_target = dq
    if partial:  # zeroed for dq_in_dkv: its dK/dV pass adds into the rows
        dq_target = (torch.zeros if dq_in_dkv else torch.empty)(rows, hq, problem.head_dim, dtype=torch.float32,
                                                                 device=device)
    args = dict(
        Q=q, K=k, V=v, DOut=dout,
        **_strides("sq", q, "thd"), **_strides("sk", k, "thd"), **_strides("sv", v, "thd"),
        **_strides("sdo", dout, "thd"), stat_h=row_max.stride(0), sm_scale=problem.sm_scale,
        profile=sched.host.profile, SCHEDULE=schedule, **_common(problem),
    )
    stats = dict(RowMax=row_max, RowSum=row_sum)  # the forward's residuals, for the passes that derive P's
    # The Triton dK/dV kernel reads its rows' records (jfa.softmax.pack_row_stats): the Triton dQ kernel stores
    # them in place of D alone, and `_row_stats` packs them after a given dq_pass.
    triton_dkv = sched.host.dkv.n_tiles > 0 and dkv_pass is None
    if triton_dkv and dq_in_dkv:
        raise ValueError("dq_in_dkv needs a dkv_pass: the Triton dK/dV kernel adds no dq")
    short_pass = short_pass if sched.host.short_bwd.n_tiles else None
    # D as an array of its own ([Hq, rows]) only for what reads or writes it there: the given dK/dV and dQ passes,
    # and the Triton dQ kernel when no Triton dK/dV pass takes its records (11 MiB on jfa.bench's gem row otherwise
    # unused).
    needs_delta = not triton_dkv or (dq_pass is not None and not partial)
    delta = torch.empty(hq, rows, dtype=torch.float32, device=device) if needs_delta else None
    row_stats = torch.empty(hq, rows, ROW_RECORD.value, dtype=torch.float32, device=device) if triton_dkv else delta
    packed = sched.host.packed_bwd
    if packed.n_tiles:
        n = packed.n_tiles
        _launch(bwd_kernels._bwd_packed_kernel, config.packed_bwd, _programs(n, config.packed_bwd, schedule, device),
                problem, Out=out, DQ=dq_target, DK=dk, DV=dv, pack_seqs=sched.pack_bwd_seqs,
                pack_shift=sched.pack_bwd_shift, n_tiles=n, counter=_counter(device), so_t=out.stride(0),
                so_h=out.stride(1),
                sdq_t=dq_target.stride(0), sdq_h=dq_target.stride(1), sdk_t=dk.stride(0), sdk_h=dk.stride(1),
                sdv_t=dv.stride(0), sdv_h=dv.stride(1), n_heads=hq, BLOCK=packed.block,
                SLOTS=packed.block // ts.PACK_ALIGN, DQ_PARTIAL=partial, PREFETCH=PREFETCH_NEXT_HEAD, **stats, **args)
    table = sched.host.short_bwd
    if dq_in_dkv:  # passes that read D and compute none
        _delta(out, dout, delta, problem)
    sources = None  # the partials of broadcast_q's dq when not one per sequence
    if short_pass is not None:
        sources = short_pass(q, k, v, out, dout, dq_target, dk, dv, row_max, row_sum, sched.host, problem, partial)
    elif table.n_tiles:
        n = table.n_tiles
        _launch(bwd_kernels._bwd_short_kernel, config.short_bwd, _programs(n, config.short_bwd, schedule, device),
                problem, Out=out, DQ=dq_target, DK=dk, DV=dv, tiles=sched.short_bwd, n_tiles=n,
                counter=_counter(device), so_t=out.stride(0), so_h=out.stride(1), sdq_t=dq_target.stride(0),
                sdq_h=dq_target.stride(1), sdk_t=dk.stride(0), sdk_h=dk.stride(1), sdv_t=dv.stride(0),
                sdv_h=dv.stride(1), n_heads=hq, BLOCK_M=config.short_bwd.block_m, BLOCK_N=config.short_bwd.block_n,
                DQ_PARTIAL=partial, **stats, **args)
    table = sched.host.dq
    if table.n_tiles and not dq_in_dkv:  # with dq_in_dkv the dK/dV pass adds dq
        if dq_pass is not None and not partial:
            dq_pass(q, k, v, out, dout, dq, row_max, row_sum, delta, table, problem)
            if triton_dkv:
                _row_stats(row_max, row_sum, row_stats, delta=delta)
        else:
            n = table.n_tiles
            _launch(bwd_kernels._dq_kernel, config.dq, _programs(n, config.dq, schedule, device),
                    problem, Out=out, DQ=dq_target, Delta=row_stats, tiles=sched.dq, n_tiles=n,
                    counter=_counter(device),
                    so_t=out.stride(0), so_h=out.stride(1), sdq_t=dq_target.stride(0), sdq_h=dq_target.stride(1),
                    n_heads=hq, BLOCK_M=config.dq.block_m, BLOCK_N=config.dq.block_n, DQ_PARTIAL=partial,
                    ROW_STATS=triton_dkv, **stats, **args)
    table = sched.host.dkv
    if table.n_tiles and dkv_pass is not None:
        dkv_pass(q, k, v, dout, dk, dv, row_max, row_sum, delta, table, problem,
                 **({"dq": dq_target} if dq_in_dkv else {}))
    elif triton_dkv:
        n = table.n_tiles
        _launch(bwd_kernels._dkv_kernel, config.dkv, _programs(n, config.dkv, schedule, device),
                problem, DK=dk, DV=dv, RowStats=row_stats, tiles=sched.dkv, n_tiles=n, counter=_counter(device),
                sdk_t=dk.stride(0), sdk_h=dk.stride(1), sdv_t=dv.stride(0), sdv_h=dv.stride(1),
                n_kv_heads=problem.kv_heads, BLOCK_M=config.dkv.block_m, BLOCK_N=config.dkv.block_n, **args)
    if partial:
        n_elem = dq.numel()
        if n_elem:
            partials = sources.shape[1] if sources is not None else problem.batch if problem.broadcast_q else 1
            prepare(bwd_kernels._dq_reduce_kernel, (triton.cdiv(n_elem, DQ_REDUCE_BLOCK),),
                    dq_target, dq, sources, partials, n_elem, hq, problem.head_dim, BLOCK=DQ_REDUCE_BLOCK,
                    UNROLL=dq_reduce_unroll(partials), WIDE_ROWS=wide_rows(hq, problem.head_dim),
                    INTERPRET=interpreting(), num_warps=4)()
    return dq, dk, dv


DQ_REDUCE_BLOCK = 512  # elements per program of `_dq_reduce_kernel`


def wide_rows(heads: int, head_dim: int) -> bool:
    """Whether `_dq_reduce_kernel` must find a block's column in its row in int64: a row of dq times a block
    reaches 2^31."""
    return heads * head_dim * DQ_REDUCE_BLOCK >= 2**31


def dq_reduce_unroll(partials: int) -> int:
    """Partials `_dq_reduce_kernel` loads per step (the order of the additions, and so the bits, the same for any):
    1 for a single one (the fp32 dq beside a dK/dV pass that adds it), where further loads would all be masked and
    still cost (H200, one launch on gem's 367 M elements: 0.787 ms with 8, 0.568 ms with 1); for broadcast_q's one
    per sequence, 32 in flight from 32 sequences on, 8 below (the tail's masked loads). Broadcast's 1024 partials of
    65 k elements (H200, 2026-12-03 15:03 UTC, `triton.testing.do_bench` over BLOCK 128-1024, 1-8 warps and 8, 16,
    32 loads, every config the same bits): 0.241 ms with 1, 0.115 with 8, 0.097 with 32 under fbtriton 3.7.4
    (the tlx backend's); 0.112 with 8, 0.106 with 32 on stock triton 3.6."""
    if partials == 1:
        return 1
    return 32 if partials >= 32 else 8


def _row_stats(row_max, row_sum, stats, scale=None, delta=None) -> None:
    """`_row_stats_kernel` over every row of the residuals ([Hq, rows] each): given `delta`, the dK/dV kernel's
    records into `stats` ([Hq, rows, ROW_RECORD]); else m_safe into `stats` and 2^-24/l into `scale`."""
    n, block = row_max.numel(), 1024
    prepare(bwd_kernels._row_stats_kernel, (triton.cdiv(n, block),),
            row_max, row_sum, row_max if delta is None else delta, stats, stats if scale is None else scale, n,
            RECORDS=delta is not None, BLOCK=block, num_warps=4)()


def backward_statistics(row_max, row_sum) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_safe, 2^-24/l) of every row ([Hq, rows] fp32 each, `jfa.softmax.backward_row_stats`), for a dK/dV
    pass that reads them instead of deriving them per block (the tlx backend's)."""
    shift, scale = torch.empty_like(row_max), torch.empty_like(row_sum)
    _row_stats(row_max, row_sum, shift, scale=scale)
    return shift, scale


def _delta(out, dout, delta, problem: Problem) -> None:
    """D = rowsum(dO∘O) of every output row into `delta` ([Hq, rows] fp32), for passes that read it."""
    rows, block = problem.out_rows, 64
    prepare(bwd_kernels._delta_kernel, (triton.cdiv(rows, block), problem.q_heads),
            out, dout, delta, rows, *out.stride(), *dout.stride(), delta.stride(0), HEAD_DIM_V=problem.head_dim_v,
            BLOCK_DV=padded_dim(problem.head_dim_v), BLOCK=block, num_warps=4)()


def interpreted_consistently() -> bool:
    """Whether triton's own library, the visibility rule and these kernels were all decorated for the
    interpreter (TRITON_INTERPRET is read when a function is decorated, i.e. at import)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from jfa.mask import visible

    return all(isinstance(f, InterpretedFunction) for f in (tl.sum, visible, fwd_kernels._fwd_kernel,
                                                              bwd_kernels._dkv_kernel))


def _on_device(device: torch.device):
    """Launch on the tensors' GPU even when another one is current."""
    import contextlib

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# Cases the verify suite runs through the interpreter (CPU), in query-key pairs x query heads x head dim.
# Measured on the ci profile (2-core CI machine): one forward+backward costs 5-40 s per 1e8 (per-program
# overhead dominates small cases) and the invariants run about five of them. Every ci case is below 3e8 except
# the D = 256 corpus batch of FAILURES.md (1.4e9: 206 s for its backward alone, ~17 minutes with its
# invariants), which the H200 profiles run instead.
INTERPRETER_WORK_LIMIT = 5e8


class TritonBackend:
    name = "triton"
    speculative = True  # every launch goes through _launch, which confirms the problem first
    description = "portable Triton kernels: persistent sorted/zigzag or dynamic tiles, packed tiny sequences"

    def unavailable(self, device: torch.device) -> str | None:
        device = torch.device(device)
        if device.type == "cuda":
            return None
        if device.type != "cpu":
            return f"the Triton kernels run on CUDA devices (or the CPU under TRITON_INTERPRET=1), not {device.type}"
        if not interpreting():
            return "set TRITON_INTERPRET=1 before importing jfa to run the Triton kernels on the CPU"
        if not interpreted_consistently():
            return ("triton was imported before TRITON_INTERPRET=1 was set: set it before importing triton or "
                    "jfa to run the Triton kernels on the CPU")
        return None

    def verify_skip(self, problem: Problem, device: torch.device) -> str | None:
        """Why the verify suite should not run this case here: under the interpreter, a case beyond
        INTERPRETER_WORK_LIMIT; on a GPU, never."""
        if torch.device(device).type != "cpu":
            return None
        work = int((problem.q_lens * problem.kv_lens).sum()) * problem.q_heads * max(problem.head_dim,
                                                                                    problem.head_dim_v)
        if work <= INTERPRETER_WORK_LIMIT:
            return None
        return (f"{work:.2e} query-key pairs x heads x head dim is beyond the interpreter's "
                f"{INTERPRETER_WORK_LIMIT:.0e} per case; GPU profiles run it")

    def invariance_waivers(self, device: torch.device) -> dict[str, str]:
        """isolation_grad (open): the packed backward multiplies a tile's slots with one another's at weight 0,
        so a NaN inside one tiny sequence reaches its tile neighbours' gradients (README: the op's known gap).
        Under the interpreter, repeated runs cannot differ by scheduling: it runs the programs one after another
        in a fixed order, so atomics never race (unwritten or uninitialised memory still shows up in the
        NaN-filled run of the `written` check); on a GPU the run-to-run checks apply."""
        waivers = {"isolation_grad": ISOLATION_GRAD_GAP}
        if torch.device(device).type == "cpu":
            waivers["run_to_run"] = ("the Triton interpreter runs programs one at a time in a fixed order "
                                     "(nothing to race); run-to-run checks run on a GPU")
        return waivers

    def forward(self, q, k, v, problem: Problem, fwd_pass=None):
        with _on_device(q.device):
            return forward(q, k, v, problem, fwd_pass)

    def backward(self, dout, q, k, v, out, lse, residuals, problem: Problem, dkv_pass=None, dq_pass=None,
                 dq_in_dkv: bool = False, short_pass=None):
        with _on_device(q.device):
            return backward(dout, q, k, v, out, lse, residuals, problem, dkv_pass, dq_pass, dq_in_dkv, short_pass)


BACKEND = TritonBackend()

__all__ = ["BACKEND", "SMALL_BLOCKS", "BackendConfig", "KernelConfig", "config_for", "gpu_config", "padded_dim",
           "set_config", "set_schedule"]
