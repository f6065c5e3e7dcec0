"""The TLX backend (`jfa.tlx.backend:BACKEND`): warp-specialised Hopper forward, dQ and dK/dV kernels; Triton
for what they do not cover.

Paths (`BACKEND.config(problem)["path"]` names the one a call takes; the verify suite records it):
- "tlx": the kernel of `jfa.tlx.forward` (TMA producer, two ping-pong wgmma consumers, persistent over a
  zigzag-dealt tile table sorted by key-block work) for every sequence longer than the Triton backend's
  packed tile (64 at these head dims), given to the Triton forward as its `fwd_pass`: tiny sequences, if the
  batch has any, run through its packed kernel, in place on the caller's tensors, whose packed tiles serve
  them far better than 128-row tiles. Which kernel a sequence gets depends on its own lengths only, so it
  gets the same bits alone and in any batch.
- "triton": the whole call through `jfa.triton.backend` when the TLX kernel does not cover it: head dims
  other than D = Dv in {64, 128} (80, 96, 192, 256, Dv != D), or a batch whose sequences are all tiny.
- "fill": no key rows at all: every row is empty (out 0, lse -inf, m -inf, l 0); nothing is launched.
- "none": no query rows (B = 0 or all q lengths 0): empty outputs, nothing is launched.
bf16 and fp16 both take the TLX path.

Backward (`config()["backward"]` says which): `jfa.triton.backend.BACKEND.backward` (packed sequences in its
own kernels), its short-query, dQ and dK/dV passes replaced by the kernels of `jfa.tlx.backward` where the
head dims are the TLX forward's (D = Dv in {64, 128}; `tlx_dkv`). The short-query pass (`tlx_short`, with key
rows) takes the Triton short-query table's tiles (at most 128 query rows, no GQA: broadcast_q's sequences
typically) in both modes: dq, dk and dv in one pass over the keys, dq held in registers, deterministic; with
broadcast_q each program sums its sequences' dq per head before storing it (`short_lists`), so the Triton
reduction over sequences reads one fp32 partial per program and head instead of one per sequence. With
deterministic=False and key rows (`tlx_dq_reduce`) one pass: the dK/dV kernel also adds dq by TMA reduce into
an fp32 array (dq summed in no fixed order; dk and dv deterministic). With deterministic=True two passes, the
dQ pass only with key rows and without broadcast_q (`tlx_dq`; broadcast_q's dQ is the Triton reduction over
sequences): deterministic, and bitwise the Triton passes' gradients (the same products added in the same
order; checked on jfa.bench's gem, long and skew rows on the H200). The TLX forward returns the residuals the
backward reads, exactly as the Triton forward does: the raw row max m and the row sum l ([Hq, rows] fp32
each, `jfa.softmax`), from which it recomputes P robustly.

Availability: fbtriton (Triton with TLX) importable, a CUDA device, and a kernel for its architecture in
`KERNELS` (sm_90 today; a Blackwell kernel slots in as another entry). `triton.language.extra.tlx` is
imported only when a kernel is launched or availability is asked, so `import jfa.tlx.backend` works with
stock triton.

Inputs are read through TMA descriptors straight from the caller's tensors when their layout allows it
(unit head-dim stride, 16-byte aligned base and row stride; fused-QKV slices qualify); otherwise from a
contiguous copy. Memory beyond inputs and outputs: m and l and the tile tables (O(T·H) fp32 and O(T) int32);
the backward's are the Triton backward's.
"""

from __future__ import annotations

import importlib
import math
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from jfa import tile_scheduler as ts
from jfa.launch import Deferred, device_facts, launch_confirmed
from jfa.problem import Problem

# Compute capability (major·10 + minor) -> module holding that architecture's `fwd_ws_kernel`.
KERNELS = {90: "jfa.tlx.forward"}
BWD_KERNELS = {90: "jfa.tlx.backward"}  # ... and the one holding its `dq_ws_kernel` and `dkv_ws_kernel`


@dataclass(frozen=True)
class TlxConfig:
    block_m: int = 128  # query rows per tile: two consumer halves of 64
    block_n: int = 128  # keys per block
    q_buffers: int = 2  # query tiles in flight (the next tile's Q loads while this one computes)
    kv_buffers: int = 2  # K/V ring depth


# Head dim (= value head dim) -> config. Shared memory (ptxas, sm_90a): 147,872 bytes at D 64, 213,352 at 128
# (of 232,448). The fast path covers exactly these head dims.
CONFIGS = {64: TlxConfig(kv_buffers=3), 128: TlxConfig()}
NUM_WARPS = 4  # the producer's warps; the kernel adds 2 consumer warpgroups (12 warps in all)


def tlx_missing() -> str | None:
    """Why fbtriton's TLX cannot be imported, or None."""
    try:
        import triton.language.extra.tlx  # noqa: F401
    except ImportError as error:
        return f"fbtriton (Triton with TLX) is not installed: {error}"
    return None


def _arch(device: torch.device) -> int:
    return device_facts(device)[0]


# ---------------------------------------------------------------------------------------------------------
# Host planning: pure functions of the problem (no GPU, no fbtriton), cached per length profile.


def route(problem: Problem, pack_block: int) -> tuple[str, str]:
    """(path, reason) of a call; see the module docstring. `pack_block` is the Triton packed tile size."""
    d, dv = problem.head_dim, problem.head_dim_v
    if problem.out_rows == 0:
        return "none", "no query rows: nothing to launch"
    if d != dv or d not in CONFIGS:
        return "triton", f"head dims {d}/{dv}: the TLX kernel covers D = Dv in {sorted(CONFIGS)}"
    if problem.kv_rows == 0:
        return "fill", "no key rows: every row is empty, filled without a launch"
    main, _ = ts.split_packable(problem.q_lens, problem.kv_lens, pack_block)
    if main.size == 0:
        return "triton", f"every sequence is tiny (longest <= {pack_block}): Triton's packed tiles"
    return "tlx", "warp-specialised TLX kernel"


def descriptor_layout(x: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(shape, strides) of x [T, H, D] seen as the 2-D tensor [T, (H - 1)·s_h + D] (row stride s_t, unit column
    stride) whose box [rows, D] at column h·s_h is x[rows, h, :]; None when TMA cannot read x in place (head
    dim not contiguous, base or row stride not 16-byte aligned, rows aliased, a dimension past int32)."""
    t, h, d = x.shape
    s_t, s_h, s_d = x.stride()
    elem = x.element_size()
    width = (h - 1) * s_h + d
    if s_d != 1 or s_t <= 0 or s_h < 0 or (s_t * elem) % 16 or x.data_ptr() % 16 or max(t, width) >= 2**31:
        return None
    return [t, width], [s_t, 1]


@dataclass(frozen=True)
class HostPlan:
    path: str
    reason: str
    tiles: ts.TileTable | None  # TLX tiles (sorted by work; entries × q heads)
    tiny: np.ndarray  # sequences routed to the Triton forward (path "tlx" only)
    device_tables: dict = field(default_factory=dict, compare=False)  # device -> int32 tile table

    def table_on(self, device: torch.device) -> torch.Tensor:
        """The tile table on `device`, copied once per plan."""
        return _table_on(self.tiles, self.device_tables, device)


def _table_on(tiles: ts.TileTable, copies: dict, device: torch.device) -> torch.Tensor:
    """The run rows of `tiles` (the TLX kernels deal tiles head-major within runs: `jfa.tile_scheduler`) on
    `device`, copied once into `copies` (device -> tensor)."""
    key = str(device)
    if key not in copies:
        copies[key] = torch.from_numpy(tiles.run_rows.ravel()).to(device)
    return copies[key]


_PLANS: OrderedDict = OrderedDict()
_PLAN_CACHE_SIZE = 16


def _cached(cache: OrderedDict, key, build):
    """cache[key], built by build() on a miss; the cache keeps its _PLAN_CACHE_SIZE most recent entries."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    cache[key] = value = build()
    while len(cache) > _PLAN_CACHE_SIZE:
        cache.popitem(last=False)
    return value


def pack_block_for(problem: Problem) -> int:
    """The Triton backend's packed tile size for this problem (the sequences it packs are "tiny")."""
    from jfa.triton import backend as triton_backend

    return triton_backend.config_for(problem).packed_fwd.block_m


def host_plan(problem: Problem, pack_block: int) -> HostPlan:
    """The call's route and, for the TLX path, its tile table; cached per length profile (with the rest of what
    the route depends on), so a repeated profile costs a dictionary lookup."""
    from jfa.triton.backend import effective_window

    window = None if problem.window is None else effective_window(problem)

    def build() -> HostPlan:
        path, reason = route(problem, pack_block)
        if path != "tlx":
            return HostPlan(path, reason, None, np.zeros(0, np.int64))
        cfg = CONFIGS[problem.head_dim]
        q_lens, kv_lens = problem.q_lens.numpy(), problem.kv_lens.numpy()
        main, tiny = ts.split_packable(q_lens, kv_lens, pack_block)
        tiles = ts.query_tiles(q_lens, kv_lens, main, cfg.block_m, cfg.block_n, window, problem.causal,
                               problem.q_heads)
        return HostPlan(path, reason, tiles, tiny)

    key = (problem.lengths_key, problem.head_dim, problem.head_dim_v, problem.q_heads, window, problem.causal,
           pack_block)
    return _cached(_PLANS, key, build)


# ---------------------------------------------------------------------------------------------------------
# Launching.


def _descriptor(x: torch.Tensor, box_rows: int, defer: bool = True, written: bool = False):
    """(TMA descriptor of x [T, H, D] as `descriptor_layout` sees it, with boxes of box_rows × D; x's head stride).
    Where TMA reads x in place and `defer`, the descriptor is made at the launch, only if that launch is not
    prepared already (`jfa.launch.Deferred`); where TMA cannot, now, of a contiguous copy. `written`: the kernel
    stores into x through it, where a copy would lose the stores, so that case raises instead (the op allocates
    such outputs contiguous, which TMA reads in place).

    Why the backward's launches defer and the forward's does not (`_launch_tlx`): the first backward launch waits
    for its host work while the GPU idles (the forward's kernels end before it), and deferring (every launch's
    then) took the tlx broadcast forward+backward from 2.31 to 2.16 ms a call on the H200
    (docs/performance-log.md); the forward's host work is done before its `confirm()`, which waits for the
    previous call's kernels anyway, and an A/B of the forward alone measured it slower with deferred descriptors
    (not explained)."""
    layout = descriptor_layout(x)
    if layout is None:
        if written:
            raise RuntimeError(f"a TMA store target of shape {tuple(x.shape)}, strides {x.stride()} that TMA cannot "
                               "address in place (a copy would lose the stores)")
        x = x.contiguous()
        layout = descriptor_layout(x)
    elif defer:
        return Deferred(_tensor_descriptor, (x,), (box_rows,)), x.stride(1)
    return _tensor_descriptor(x, box_rows, layout), x.stride(1)


def _tensor_descriptor(x: torch.Tensor, box_rows: int, layout=None):
    """The TMA descriptor of x read in place; `layout` is `descriptor_layout(x)` where the caller has it already
    (a deferred one is made from x alone)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    shape, strides = layout or descriptor_layout(x)
    return TensorDescriptor(x, shape=shape, strides=strides, block_shape=[box_rows, x.shape[2]])


def _persistent_programs(n_tiles: int, device: torch.device) -> int:
    """Grid of a persistent TLX kernel: one CTA per SM (each holds the SM's shared memory), at most one per tile."""
    return min(n_tiles, device_facts(device)[1])


def _launch_tlx(q, k, v, out, lse, row_max, row_sum, plan: HostPlan, problem: Problem) -> None:
    from jfa.triton.backend import effective_window, scale_log2

    device = q.device
    cfg = CONFIGS[problem.head_dim]
    kernel = importlib.import_module(KERNELS[_arch(device)]).fwd_ws_kernel
    desc_q, sq_h = _descriptor(q, cfg.block_m // 2, defer=False)
    desc_k, sk_h = _descriptor(k, cfg.block_n, defer=False)
    desc_v, sv_h = _descriptor(v, cfg.block_n, defer=False)
    n_tiles = plan.tiles.n_tiles
    programs = _persistent_programs(n_tiles, device)
    scale = problem.sm_scale
    with torch.cuda.device(device):
        launch_confirmed(
            problem, kernel, (programs,),
            desc_q, desc_k, desc_v, out, lse, row_max, row_sum,
            plan.table_on(device), n_tiles, problem.q_offsets, problem.out_offsets, problem.kv_offsets,
            sq_h, sk_h, sv_h, out.stride(0), out.stride(1), lse.stride(0), q.shape[0], k.shape[0],
            scale_log2(problem), abs(scale), effective_window(problem), problem.q_heads,
            problem.group_size,
            HEAD_DIM=problem.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, Q_BUFFERS=cfg.q_buffers,
            KV_BUFFERS=cfg.kv_buffers, NEG_SCALE=scale < 0, HAS_WINDOW=problem.window is not None,
            CAUSAL=problem.causal, num_warps=NUM_WARPS, num_stages=1,
        )


# The dK/dV pass (`jfa.tlx.backward`): query rows per block, keys per tile, depth of the Q/dO ring.
BWD_BLOCK_M, BWD_BLOCK_N, BWD_BUFFERS = 64, 128, 2
# The short-query pass: every query row of a sequence (the Triton short-query table's BLOCK_M), keys per block
# (that table's BLOCK_N, by which its tiles are sorted), depths of the K and V rings (K: two pairs of blocks; V:
# a slot is also where a block's dk and dv go out, so it is held until their TMA stores have read it).
SHORT_BLOCK_M, SHORT_BLOCK_N, SHORT_K_BUFFERS, SHORT_V_BUFFERS = 128, 64, 4, 3
_KEY_TABLES: OrderedDict = OrderedDict()


def tlx_dkv(problem: Problem) -> bool:
    """Whether the TLX dK/dV pass covers the problem's head dims (those of the TLX forward)."""
    return problem.head_dim == problem.head_dim_v and problem.head_dim in CONFIGS


def tlx_dq(problem: Problem) -> bool:
    """Whether the TLX dQ pass runs: the head dims of the dK/dV pass, at least one key row (a TMA descriptor
    needs one; without keys the Triton pass writes dq = 0 and D without reading any), and no broadcast_q (its
    dq is a reduction over sequences, the Triton pass's)."""
    return tlx_dkv(problem) and problem.kv_rows > 0 and not problem.broadcast_q


def tlx_dq_reduce(problem: Problem) -> bool:
    """Whether the TLX dK/dV pass also produces dq, added by TMA reduce into an fp32 array (no dQ pass): for
    deterministic=False where the dK/dV pass runs, with key rows (broadcast_q included: the reduce adds into
    each sequence's partial rows, which the Triton reduction then sums in order)."""
    return not problem.deterministic and tlx_dkv(problem) and problem.kv_rows > 0


def backward_route(problem: Problem) -> str:
    """Which passes of the backward are TLX kernels (`config()["backward"]`), of those with tiles in the Triton
    backward's schedule (the TLX passes take its short-query, dQ and dK/dV tiles); "triton" when none."""
    from jfa.triton.backend import config_for, device_schedule

    host = device_schedule(problem, config_for(problem)).host
    passes = []
    if host.short_bwd.n_tiles and tlx_short(problem):
        passes.append("TLX short-query pass")
    if host.dkv.n_tiles and tlx_dq_reduce(problem):
        passes.append("TLX dK/dV pass adding dq by TMA reduce (deterministic=False)")
    elif host.dkv.n_tiles and tlx_dq(problem):
        passes.append("TLX dQ and dK/dV passes")
    elif host.dkv.n_tiles and tlx_dkv(problem):
        passes.append("TLX dK/dV pass, Triton dQ")
    return ", ".join(passes + ["Triton for the rest"]) if passes else "triton"


def key_table(problem: Problem, triton_table: ts.TileTable, window) -> tuple[ts.TileTable, dict]:
    """The TLX dK/dV tile table (key tiles of BWD_BLOCK_N over the sequences of the Triton dK/dV table, the
    ordinary ones) and its device copies by device, cached per length profile and head dim (which sequences
    the Triton backward packs depends on its head-dim class)."""
    def build() -> tuple[ts.TileTable, dict]:
        seqs = np.unique(triton_table.entries[:, 0])
        return ts.key_tiles(problem.q_lens.numpy(), problem.kv_lens.numpy(), seqs, BWD_BLOCK_N, BWD_BLOCK_M, window,
                            problem.causal, problem.kv_heads, problem.group_size), {}

    key = (problem.lengths_key, problem.kv_heads, problem.group_size, window, problem.causal, problem.head_dim)
    return _cached(_KEY_TABLES, key, build)


# The dQ pass: query rows per tile (two consumer halves of 64), keys per block, ring depths.
DQ_BLOCK_M, DQ_BLOCK_N, DQ_Q_BUFFERS, DQ_KV_BUFFERS = 128, 64, 2, 2
_QUERY_TABLES: OrderedDict = OrderedDict()


def query_table(problem: Problem, triton_table: ts.TileTable, window) -> tuple[ts.TileTable, dict]:
    """The TLX dQ tile table (query tiles of DQ_BLOCK_M over the sequences of the Triton dQ table) and its
    device copies by device, cached per length profile and head dim (as `key_table`)."""
    def build() -> tuple[ts.TileTable, dict]:
        seqs = np.unique(triton_table.entries[:, 0])
        return ts.query_tiles(problem.q_lens.numpy(), problem.kv_lens.numpy(), seqs, DQ_BLOCK_M, DQ_BLOCK_N, window,
                              problem.causal, problem.q_heads), {}

    key = (problem.lengths_key, problem.q_heads, window, problem.causal, problem.head_dim)
    return _cached(_QUERY_TABLES, key, build)


def _launch_dq(q, k, v, out, dout, dq, row_max, row_sum, delta, triton_table, problem: Problem) -> None:
    """The TLX dQ pass (`jfa.tlx.backward.dq_ws_kernel`) over the sequences of the Triton dQ tile table: dq
    and D (stored in `delta` for the dK/dV pass)."""
    from jfa.triton.backend import effective_window, scale_log2

    device = q.device
    window = effective_window(problem)  # 0 without one
    table, copies = query_table(problem, triton_table, None if problem.window is None else window)
    kernel = importlib.import_module(BWD_KERNELS[_arch(device)]).dq_ws_kernel
    desc_q, sq_h = _descriptor(q, DQ_BLOCK_M // 2)
    desc_do, sdo_h = _descriptor(dout, DQ_BLOCK_M // 2)
    desc_k, sk_h = _descriptor(k, DQ_BLOCK_N)
    desc_v, sv_h = _descriptor(v, DQ_BLOCK_N)
    n_tiles = table.n_tiles
    programs = _persistent_programs(n_tiles, device)
    scale = problem.sm_scale
    launch_confirmed(
        problem, kernel, (programs,),
        desc_q, desc_do, desc_k, desc_v, out, dq, row_max, row_sum, delta,
        _table_on(table, copies, device), n_tiles, problem.q_offsets, problem.out_offsets, problem.kv_offsets,
        sq_h, sdo_h, sk_h, sv_h, out.stride(0), out.stride(1), dq.stride(0), dq.stride(1), row_max.stride(0),
        q.shape[0], dout.shape[0], k.shape[0], scale_log2(problem), scale, window,
        problem.q_heads, problem.group_size,
        HEAD_DIM=problem.head_dim, BLOCK_M=DQ_BLOCK_M, BLOCK_N=DQ_BLOCK_N, Q_BUFFERS=DQ_Q_BUFFERS,
        KV_BUFFERS=DQ_KV_BUFFERS, NEG_SCALE=scale < 0, HAS_WINDOW=problem.window is not None, CAUSAL=problem.causal,
        num_warps=NUM_WARPS, num_stages=1,
    )


def _statistics_descriptor(x: torch.Tensor, block_m: int):
    """A flat 1-D descriptor of the [Hq, rows] fp32 statistics x with boxes of 2·block_m, for blocks of block_m
    rows (the kernel starts each box at the 16-byte aligned element at or below a block's first row, at most 3
    before it): made at the launch (`jfa.launch.Deferred`) where x is contiguous and holds a box; otherwise now,
    of a copy (arrays shorter than a box are copied into one)."""
    box = 2 * block_m
    if x.is_contiguous() and x.numel() >= box:
        return Deferred(_flat_descriptor, (x,), (box,))
    flat = x.reshape(-1)
    if flat.numel() < box:
        flat = torch.cat([flat, flat.new_zeros(box - flat.numel())])
    return _flat_descriptor(flat, box)


def _flat_descriptor(x: torch.Tensor, box: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = x.view(-1)
    return TensorDescriptor(flat, shape=[flat.numel()], strides=[1], block_shape=[box])


def _launch_dkv(q, k, v, dout, dk, dv, row_max, row_sum, delta, triton_table, problem: Problem, dq=None) -> None:
    """The TLX dK/dV pass (`jfa.tlx.backward`) over the sequences of the Triton dK/dV tile table; D (delta) is
    the dQ pass's. The pass reads (m_safe, 2^-24/l) of each row, computed here from m and l by one Triton
    kernel, in place of m and l (which its consumers would turn into those once per query block and key
    tile). The statistics share one layout ([Hq, rows], contiguous, as both forwards and the Triton backward
    allocate them). `dq` (fp32 [out rows, Hq, D], contiguous): the pass adds dq there too."""
    from jfa.triton.backend import backward_statistics, effective_window, scale_log2

    device = q.device
    window = effective_window(problem)  # 0 without one
    table, copies = key_table(problem, triton_table, None if problem.window is None else window)
    kernel = importlib.import_module(BWD_KERNELS[_arch(device)]).dkv_ws_kernel
    desc_q, sq_h = _descriptor(q, BWD_BLOCK_M)
    desc_do, sdo_h = _descriptor(dout, BWD_BLOCK_M)
    desc_k, sk_h = _descriptor(k, BWD_BLOCK_N // 2)
    desc_v, sv_h = _descriptor(v, BWD_BLOCK_N // 2)
    desc_shift, desc_scale, desc_delta = (_statistics_descriptor(x, BWD_BLOCK_M)
                                          for x in (*backward_statistics(row_max, row_sum), delta))
    desc_dq = None
    if dq is not None:  # boxes of one 64-row block × half a head's columns, at column head·D + c·D/2
        from triton.tools.tensor_descriptor import TensorDescriptor

        width = dq.shape[1] * dq.shape[2]
        desc_dq = TensorDescriptor(dq.view(dq.shape[0], width), shape=[dq.shape[0], width], strides=[width, 1],
                                   block_shape=[BWD_BLOCK_M, problem.head_dim // 2])
    n_tiles = table.n_tiles
    programs = _persistent_programs(n_tiles, device)
    scale = problem.sm_scale
    launch_confirmed(
        problem, kernel, (programs,),
        desc_q, desc_do, desc_k, desc_v, desc_shift, desc_scale, desc_delta, desc_dq, dk, dv,
        _table_on(table, copies, device), n_tiles, problem.q_offsets, problem.out_offsets, problem.kv_offsets,
        sq_h, sdo_h, sk_h, sv_h, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        0 if dq is None else problem.head_dim, row_max.stride(0),
        q.shape[0], dout.shape[0], k.shape[0], scale_log2(problem), scale, window,
        problem.kv_heads, problem.group_size,
        HEAD_DIM=problem.head_dim, BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, BUFFERS=BWD_BUFFERS,
        NEG_SCALE=scale < 0, HAS_WINDOW=problem.window is not None, CAUSAL=problem.causal, DQ_REDUCE=dq is not None,
        num_warps=NUM_WARPS, num_stages=1,
    )


def tlx_short(problem: Problem) -> bool:
    """Whether the TLX short-query pass takes the Triton short-query table's tiles: the head dims of the dK/dV
    pass, with key rows (a TMA descriptor needs one)."""
    return tlx_dkv(problem) and problem.kv_rows > 0


def short_lists(problem: Problem, schedule: ts.Schedule, programs: int, accumulate: bool):
    """The short-query pass's tiles dealt to `programs` programs (`ts.program_lists` of the Triton short-query
    table of `schedule`; `accumulate`: broadcast_q's segments) on the problem's device: (tiles, rows, starts,
    sources), kept with the schedule (so per length profile, mask and config), copied once per device.
    `sources`, with `accumulate`: per head the partials the dq reduction sums, the segments' and then every
    packed sequence's (the Triton packed kernel writes one per sequence); None otherwise."""
    key = ("tlx short lists", programs, accumulate, str(problem.device))
    if key not in schedule.derived:
        lists = ts.program_lists(schedule.short_bwd, programs, accumulate)
        parts = [schedule.short_bwd.entries.ravel(), lists.rows.ravel(), lists.starts]
        if accumulate:
            packed = np.sort(schedule.packed_bwd.seqs[schedule.packed_bwd.seqs >= 0])
            heads = lists.sources.shape[0]
            sources = np.concatenate([lists.sources, np.broadcast_to(packed, (heads, packed.size))], axis=1)
            parts.append(sources.ravel())
        flat = torch.from_numpy(np.concatenate(parts).astype(np.int32)).to(problem.device)
        views = list(torch.split(flat, [part.size for part in parts]))
        schedule.derived[key] = (*views[:3], views[3].view(sources.shape) if accumulate else None)
    return schedule.derived[key]


def _launch_short(q, k, v, out, dout, dq, dk, dv, row_max, row_sum, schedule: ts.Schedule, problem: Problem,
                  partial: bool):
    """The TLX short-query pass (`jfa.tlx.backward.short_ws_kernel`) over the Triton short-query table of
    `schedule` (the host schedule; blocks of SHORT_BLOCK_M × SHORT_BLOCK_N, as the kernel walks them): dq (the
    fp32 partial at the output rows when `partial`), dk and dv of its sequences, from D = rowsum(dO∘O) it
    computes from `out` and `dout`.
    With broadcast_q each program sums its tiles' dq per segment (`short_lists`) and the call returns the
    partials the dq reduction is to sum (device int32 [Hq, n], -1 padding); otherwise None (one per sequence)."""
    from jfa.triton.backend import effective_window, scale_log2

    device = q.device
    kernel = importlib.import_module(BWD_KERNELS[_arch(device)]).short_ws_kernel
    desc_q, sq_h = _descriptor(q, SHORT_BLOCK_M)
    desc_do, sdo_h = _descriptor(dout, SHORT_BLOCK_M)
    desc_k, sk_h = _descriptor(k, SHORT_BLOCK_N)
    desc_v, sv_h = _descriptor(v, SHORT_BLOCK_N)
    desc_dk, desc_dv = (_descriptor(x, SHORT_BLOCK_N, written=True)[0] for x in (dk, dv))
    desc_m, desc_l = (_statistics_descriptor(x, SHORT_BLOCK_M) for x in (row_max, row_sum))
    programs = _persistent_programs(schedule.short_bwd.n_tiles, device)
    tiles, rows, starts, sources = short_lists(problem, schedule, programs, problem.broadcast_q)
    scale = problem.sm_scale
    launch_confirmed(
        problem, kernel, (programs,),
        desc_q, desc_do, desc_k, desc_v, desc_m, desc_l, out, dq, dk, dv, desc_dk, desc_dv,
        tiles, rows, starts, problem.q_offsets, problem.out_offsets, problem.kv_offsets,
        sq_h, sdo_h, out.stride(0), out.stride(1), sk_h, sv_h, dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1),
        row_max.stride(0), q.shape[0], dout.shape[0], k.shape[0], scale_log2(problem), scale,
        effective_window(problem), problem.q_heads,
        HEAD_DIM=problem.head_dim, BLOCK_M=SHORT_BLOCK_M, BLOCK_N=SHORT_BLOCK_N, K_BUFFERS=SHORT_K_BUFFERS,
        V_BUFFERS=SHORT_V_BUFFERS, NEG_SCALE=scale < 0, HAS_WINDOW=problem.window is not None,
        CAUSAL=problem.causal, DQ_PARTIAL=partial, num_warps=NUM_WARPS, num_stages=1,
    )
    return sources


class TlxBackend:
    name = "tlx"
    speculative = True  # _launch_tlx and the Triton launches confirm the problem first
    description = ("TLX warp-specialised Hopper forward (TMA producer, ping-pong wgmma consumers, persistent "
                   "zigzag tiles) and short-query, dQ and dK/dV passes for D = Dv in {64, 128}; Triton forward "
                   "and backward otherwise and for tiny sequences, and broadcast-Q's dQ reduction")

    def unavailable(self, device: torch.device) -> str | None:
        missing = tlx_missing()
        if missing:
            return missing
        device = torch.device(device)
        if device.type != "cuda":
            return f"the TLX kernels run on CUDA GPUs, not {device.type}"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return "the TLX kernels cannot run under TRITON_INTERPRET=1"
        arch = _arch(device)
        if arch not in KERNELS:
            have = ", ".join(f"sm_{a}" for a in sorted(KERNELS))
            return f"no TLX kernel for sm_{arch} yet (kernels: {have})"
        return None

    def invariance_waivers(self, device: torch.device) -> dict[str, str]:
        """dq_order: without deterministic=True the TLX dK/dV pass adds dq by TMA reduce, in no fixed order.
        isolation, isolation_grad (open): blocks that run past their sequence's end read the next sequence's rows
        by TMA (no per-sequence bound) and weigh them 0, so a NaN there becomes 0·NaN = NaN; the backward's packed
        tiles, the Triton backend's, have the gap `jfa.triton.backend.ISOLATION_GRAD_GAP` names (README: the op's
        known gap)."""
        from jfa.triton.backend import ISOLATION_GRAD_GAP

        tma = ("known and open: TLX blocks that run past their sequence's end read the next sequence's rows (TMA has "
               "no per-sequence bound) at weight 0, and 0·NaN = NaN")
        return {"dq_order": "deterministic=False adds dq by TMA reduce in no fixed order: dq's padding and batch "
                            "checks compare deterministic=True calls",
                "isolation": tma, "isolation_grad": f"{tma}; and {ISOLATION_GRAD_GAP}"}

    def config(self, problem: Problem) -> dict:
        """Which path a call takes and why; for the TLX path its kernel config and tile counts."""
        plan = host_plan(problem, pack_block_for(problem))
        info = {"path": plan.path, "reason": plan.reason, "backward": backward_route(problem)}
        if plan.path == "tlx":
            info.update(asdict(CONFIGS[problem.head_dim]), schedule="static zigzag", tiles=plan.tiles.n_tiles,
                        triton_sequences=int(plan.tiny.size))
        return info

    def forward(self, q, k, v, problem: Problem):
        """Path "tlx": the Triton forward with the TLX kernel in place of its ordinary-sequence kernel, so the
        tiny sequences run through the packed Triton kernel in place, on the caller's tensors."""
        plan = host_plan(problem, pack_block_for(problem))
        if plan.path in ("triton", "tlx"):
            from jfa.triton.backend import BACKEND as TRITON

            def fwd_pass(q, k, v, out, lse, row_max, row_sum, table, problem):
                # `table` holds the sequences of plan.tiles: both split the batch with split_packable at the
                # same packed tile size (checked by tests/test_tlx.py).
                _launch_tlx(q, k, v, out, lse, row_max, row_sum, plan, problem)

            return TRITON.forward(q, k, v, problem, fwd_pass=fwd_pass if plan.path == "tlx" else None)
        rows, hq = problem.out_rows, problem.q_heads
        out = torch.empty(rows, hq, problem.head_dim_v, dtype=q.dtype, device=q.device)
        lse, row_max, row_sum = (torch.empty(hq, rows, dtype=torch.float32, device=q.device) for _ in range(3))
        if plan.path == "fill":
            out.zero_()
            lse.fill_(-math.inf)
            row_max.fill_(-math.inf)
            row_sum.zero_()
        return out, lse, (row_max, row_sum)

    def backward(self, dout, q, k, v, out, lse, residuals, problem: Problem):
        """The Triton backend's backward (residuals m and l are those the Triton forward writes), its
        short-query, dQ and dK/dV passes replaced by the TLX kernels where those cover the problem
        (`tlx_short`, `tlx_dq`, `tlx_dkv`)."""
        from jfa.triton.backend import BACKEND as TRITON

        short_pass = _launch_short if tlx_short(problem) else None
        if tlx_dq_reduce(problem):
            return TRITON.backward(dout, q, k, v, out, lse, residuals, problem, dkv_pass=_launch_dkv, dq_in_dkv=True,
                                   short_pass=short_pass)
        return TRITON.backward(dout, q, k, v, out, lse, residuals, problem,
                               dkv_pass=_launch_dkv if tlx_dkv(problem) else None,
                               dq_pass=_launch_dq if tlx_dq(problem) else None, short_pass=short_pass)


BACKEND = TlxBackend()

__all__ = ["BACKEND", "CONFIGS", "KERNELS", "TlxConfig", "descriptor_layout", "host_plan", "route"]
