"""TLX warp-specialised forward kernel for Hopper (sm_90): TMA producer, two wgmma consumers in ping-pong.

Imported only when fbtriton (Triton with TLX) is installed: `jfa.tlx.backend` imports it lazily.

Tile = (sequence, BLOCK_M = 128 query rows, query head), from `jfa.tile_scheduler.query_tiles` (sorted by
key-block work; head-major within each run of a sequence's blocks, `jfa.tile_scheduler.tile_at`). The grid is
persistent: program p takes the tiles of the static zigzag dealing (round r: tile r·P + p when r is even,
r·P + P-1-p when odd), so the producer and the consumers derive the same tile sequence independently and
need no hand-off.

One CTA = three warpgroups:
- producer (the "default" task, 4 warps, 24 registers): per tile, TMA loads of the two 64-row halves of the
  query block (one per consumer) into slot r % Q_BUFFERS, then for every key block of
  `jfa.block_info.kv_block_range` a K and a V tile into a ring of KV_BUFFERS slots;
- two consumers (4 warps each, 240 registers): consumer c owns query rows [c·64, c·64 + 64) of the tile.
  Per key block: S = Q·Kᵀ (wgmma, Q and K from shared memory), the online softmax of `jfa.softmax` over raw
  scores, acc += P·V (wgmma, P from registers rounded to the input dtype). The PV product of block j - 1 runs
  while the softmax of block j is computed: the QK of block j is issued first, then the PV of block j - 1,
  and `async_dot_wait(1)` retires the QK only.
The consumers issue their QK wgmmas in turns (named barriers QK_TURN_0/QK_TURN_1), so one consumer's
softmax overlaps the other's tensor-core work (ping-pong).

Barriers (mbarriers in shared memory). A wait on parity `ph` returns once the barrier's phase of that parity
has completed; a fresh barrier counts its "previous" phase (parity 1) as completed, so a producer's first
wait on an "empty" barrier (parity 1) passes at once.
- q_full / q_empty [2·Q_BUFFERS], index 2·(r % Q_BUFFERS) + c for consumer c and the program's r-th tile;
  phase (r // Q_BUFFERS) & 1. q_full completes on the producer's expect-bytes arrival plus the TMA bytes,
  q_empty on consumer c's arrival.
- k_full/v_full, k_empty/v_empty [KV_BUFFERS], slot i % KV_BUFFERS and phase (i // KV_BUFFERS) & 1 for the
  program's i-th key block counted across its tiles. The fulls complete on TMA bytes; the empties take 2
  arrivals, since both consumers read every K and V tile. Producer and consumers walk the same blocks, so
  their counts agree.
The producer waits on the empties with the opposite parity to the consumers' waits on the fulls. Release
order: K as soon as its QK is retired, V when its PV is retired, Q after the tile's last MMA.

Jagged rows. Q/K/V are read through 2-D descriptors of shape [T, (H - 1)·s_h + D] (row stride s_t, unit
column stride) with boxes [rows, D] at column h·s_h. A block that runs past its sequence reads the next
sequence's rows (finite) or zeros (TMA fills rows past T). The mask (`jfa.mask.visible`) sets those scores to
-inf before the row max, so their p is exactly 0. (A NaN or Inf *inside another sequence's* V rows would
still leak through 0·NaN; padding past T cannot.) Query rows past the sequence are computed and never
stored: out, lse and the residuals m and l are written with a row mask (a TMA store of the whole tile
would overwrite the next sequence's rows).

Masking is decided per key block at run time: blocks outside [full_lo, full_hi) of `kv_block_range` get the
visibility mask, the others none. A tile whose rows see no key (kv_len = 0, causal with q_len > kv_len, a
window) runs one fully masked block (see `_tile`) and writes out = 0, lse = -inf, m = -inf, l = 0
(`jfa.softmax.finalize`).
"""

from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa.block_info import kv_block_range
from jfa.mask import visible
from jfa.softmax import finalize, online_update, raw_scores
from jfa.tile_scheduler import tile_at
from jfa.triton.forward import sequence_bounds

# Hardware named barriers (ids 1-15; 0 is the CTA-wide barrier) that pass the right to issue a QK wgmma
# between the consumers: consumer 0 waits on QK_TURN_0 and then arrives on QK_TURN_1, consumer 1 the other
# way round. Each is completed by the 2 × 128 consumer threads (128 arrive, 128 wait).
QK_TURN_0 = tl.constexpr(9)
QK_TURN_1 = tl.constexpr(10)
CONSUMER_THREADS = tl.constexpr(256)
# Per consumer thread; the producer gets what is left (65,536 per SM): 24, as the dQ pass's producer (the same
# _load_tiles) has. At 232 (the producer 40) ptxas spilled 96 bytes at D 128 (168 with causal and window); at 240
# (the producer 24) 8 bytes (40): gem's forward 2.637 -> 2.486 ms of device time on the H200, long's 1.982 ->
# 1.945, the same bits.
CONSUMER_REGISTERS = tl.constexpr(240)


@triton.jit
def _tile_round(r, pid, nprog):
    """The tile index of this program's r-th round under static zigzag dealing."""
    return r * nprog + tl.where(r % 2 == 0, pid, nprog - 1 - pid)


@triton.jit
def _rounds(pid, nprog, n_tiles):
    """How many tiles this program takes: every full round, plus the last partial one if its slot is in it."""
    full = n_tiles // nprog
    last = tl.where(full % 2 == 0, pid, nprog - 1 - pid)
    return full + (last < n_tiles - full * nprog).to(tl.int32)


@triton.jit
def _tile(tiles, t, n_heads, q_offsets, out_offsets, kv_offsets, window,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
          RUNS: tl.constexpr):
    """Tile t (`jfa.tile_scheduler.tile_at`): (head, m0, q_start, out_start, q_len, kv_start, kv_len, lo, full_lo,
    full_hi, hi).

    A tile whose rows see no key still gets one key block [lo, lo + BLOCK_N), fully masked (it lies outside
    [full_lo, full_hi)): every tile then runs the same branch-free pipeline, and its rows come out with
    m = -inf, l = 0 (out = 0, lse = -inf). The block may lie past the keys; TMA reads zeros there.
    """
    seq, m0, head = tile_at(tiles, t, n_heads, RUNS)
    q_start, out_start, q_len, kv_start, kv_len = sequence_bounds(q_offsets, out_offsets, kv_offsets, seq)
    lo, full_lo, full_hi, hi = kv_block_range(m0, tl.minimum(m0 + BLOCK_M, q_len), q_len, kv_len, window,
                                              BLOCK_N, HAS_WINDOW, CAUSAL)
    hi = tl.maximum(hi, lo + BLOCK_N)
    return head, m0, q_start, out_start, q_len, kv_start, kv_len, lo, full_lo, full_hi, hi


@triton.jit
def _load_tiles(desc_q, desc_do, desc_k, desc_v, q_tiles, do_tiles, k_tiles, v_tiles, q_full, q_empty, k_full,
                k_empty, v_full, v_empty, tiles, n_tiles, q_offsets, out_offsets, kv_offsets, sq_h, sdo_h, sk_h, sv_h,
                q_rows, out_rows, kv_rows, window, n_heads, group, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, Q_BUFFERS: tl.constexpr, KV_BUFFERS: tl.constexpr,
                HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """The producer of the query-tile kernels (this forward; the dQ pass, which passes `desc_do`, None here):
    TMA loads of every tile's query halves (and dO halves, behind the same barrier) and key/value blocks."""
    HALF: tl.constexpr = BLOCK_M // 2
    ELEM: tl.constexpr = tlx.size_of(tlx.dtype_of(desc_q))
    HALVES: tl.constexpr = 1 if desc_do is None else 2  # tiles per consumer slot: Q, or Q and dO
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    kv_count = 0
    for r in range(0, _rounds(pid, nprog, n_tiles)):
        head, m0, q_start, out_start, q_len, kv_start, kv_len, lo, full_lo, full_hi, hi = _tile(
            tiles, _tile_round(r, pid, nprog), n_heads, q_offsets, out_offsets, kv_offsets, window,
            BLOCK_M, BLOCK_N, HAS_WINDOW, CAUSAL, True)
        q_slot = (r % Q_BUFFERS) * 2
        q_phase = (r // Q_BUFFERS) & 1
        for c in tl.static_range(2):
            # Row clamped into the tensor: a half past the sequence is never stored, and only such a half
            # (or the masked block of a tile without keys) can start past the last row.
            row = tl.minimum(q_start + m0 + c * HALF, q_rows - 1)
            tlx.barrier_wait(q_empty[q_slot + c], q_phase ^ 1)  # consumer c released this slot's last tile
            tlx.barrier_expect_bytes(q_full[q_slot + c], HALVES * ELEM * HALF * HEAD_DIM)
            tlx.async_descriptor_load(desc_q, q_tiles[q_slot + c], [row, head * sq_h], q_full[q_slot + c])
            if desc_do is not None:
                tlx.async_descriptor_load(desc_do, do_tiles[q_slot + c],
                                          [tl.minimum(out_start + m0 + c * HALF, out_rows - 1), head * sdo_h],
                                          q_full[q_slot + c])
        kv_head = head // group
        for n in range(lo, hi, BLOCK_N):
            slot = kv_count % KV_BUFFERS
            phase = (kv_count // KV_BUFFERS) & 1
            row = tl.minimum(kv_start + n, kv_rows - 1)
            tlx.barrier_wait(k_empty[slot], phase ^ 1)  # both consumers retired the products that read this slot
            tlx.barrier_expect_bytes(k_full[slot], ELEM * BLOCK_N * HEAD_DIM)
            tlx.async_descriptor_load(desc_k, k_tiles[slot], [row, kv_head * sk_h], k_full[slot])
            tlx.barrier_wait(v_empty[slot], phase ^ 1)  # ... and those that read this V slot
            tlx.barrier_expect_bytes(v_full[slot], ELEM * BLOCK_N * HEAD_DIM)
            tlx.async_descriptor_load(desc_v, v_tiles[slot], [row, kv_head * sv_h], v_full[slot])
            kv_count += 1


@triton.jit
def _wait_turn(cid: tl.constexpr):
    if cid == 0:
        tlx.named_barrier_wait(QK_TURN_0, CONSUMER_THREADS)
    else:
        tlx.named_barrier_wait(QK_TURN_1, CONSUMER_THREADS)


@triton.jit
def _hand_turn(cid: tl.constexpr):
    if cid == 0:
        tlx.named_barrier_arrive(QK_TURN_1, CONSUMER_THREADS)
    else:
        tlx.named_barrier_arrive(QK_TURN_0, CONSUMER_THREADS)


@triton.jit
def _qk_in_turn(q_tile, k_tile, cid: tl.constexpr):
    """S = Q·Kᵀ issued when it is this consumer's turn; hands the turn to the other consumer."""
    _wait_turn(cid)
    qk = tlx.async_dot(q_tile, tlx.local_trans(k_tile))
    _hand_turn(cid)
    return qk


@triton.jit
def _pass_tile(q_full, q_empty, k_full, k_empty, v_full, v_empty, q_slot, q_phase, lo, hi, kv_count,
               cid: tl.constexpr, BLOCK_N: tl.constexpr, KV_BUFFERS: tl.constexpr, TURNS: tl.constexpr):
    """A consumer of a query-tile kernel (this forward, the dQ pass) whose rows all lie past the sequence (the
    second half of a sequence's last tile when it has at most 64 rows) computes nothing: it only keeps its
    barrier phases (and, with TURNS, the QK turns) in step with the producer and the other consumer, which
    then has the tensor cores to itself. It waits for each slot to be full before releasing it, so that its
    arrivals never count towards a later phase of the slot."""
    tlx.barrier_wait(q_full[q_slot], q_phase)
    for _n in range(lo, hi, BLOCK_N):
        slot = kv_count % KV_BUFFERS
        phase = (kv_count // KV_BUFFERS) & 1
        tlx.barrier_wait(k_full[slot], phase)
        if TURNS:
            _wait_turn(cid)
            _hand_turn(cid)
        tlx.barrier_arrive(k_empty[slot], 1)
        tlx.barrier_wait(v_full[slot], phase)
        tlx.barrier_arrive(v_empty[slot], 1)
        kv_count += 1
    tlx.barrier_arrive(q_empty[q_slot], 1)
    return kv_count


@triton.jit
def _softmax_block(qk, m_i, l_i, n, rows, full_lo, full_hi, q_len, kv_len, window, scale_log2,
                   BLOCK_N: tl.constexpr, NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """Raw scores of key block n, masked when the block is not fully visible, through the online softmax."""
    r = raw_scores(qk, NEG_SCALE)
    if (n < full_lo) | (n >= full_hi):
        seen = visible(rows[:, None], (n + tl.arange(0, BLOCK_N))[None, :], q_len, kv_len, window, HAS_WINDOW,
                       CAUSAL)
        r = tl.where(seen, r, float("-inf"))
    return online_update(m_i, l_i, r, scale_log2)


@triton.jit
def _attend_tiles(q_tiles, k_tiles, v_tiles, q_full, q_empty, k_full, k_empty, v_full, v_empty, Out, Lse, RowMax,
                  RowSum, tiles, n_tiles, q_offsets, out_offsets, kv_offsets, so_t, so_h, stat_h, scale_log2,
                  scale_abs, window, n_heads, cid: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, Q_BUFFERS: tl.constexpr, KV_BUFFERS: tl.constexpr, NEG_SCALE: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """Consumer `cid`: attention of query rows [cid·64, cid·64 + 64) of every tile of this program."""
    HALF: tl.constexpr = BLOCK_M // 2
    DT: tl.constexpr = Out.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if cid == 1:
        tlx.named_barrier_arrive(QK_TURN_0, CONSUMER_THREADS)  # consumer 0 takes the first turn
    kv_count = 0
    for r in range(0, _rounds(pid, nprog, n_tiles)):
        head, m0, q_start, out_start, q_len, kv_start, kv_len, lo, full_lo, full_hi, hi = _tile(
            tiles, _tile_round(r, pid, nprog), n_heads, q_offsets, out_offsets, kv_offsets, window,
            BLOCK_M, BLOCK_N, HAS_WINDOW, CAUSAL, True)
        q_slot = (r % Q_BUFFERS) * 2 + cid
        q_phase = (r // Q_BUFFERS) & 1
        if m0 + cid * HALF >= q_len:  # no row of this half exists: nothing to compute or store
            kv_count = _pass_tile(q_full, q_empty, k_full, k_empty, v_full, v_empty, q_slot, q_phase, lo, hi,
                                  kv_count, cid, BLOCK_N, KV_BUFFERS, True)
        else:
            rows = m0 + cid * HALF + tl.arange(0, HALF)
            m_i = tl.full([HALF], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([HALF], dtype=tl.float32)
            acc = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
            q_tile = q_tiles[q_slot]
            tlx.barrier_wait(q_full[q_slot], q_phase)
            # Block lo: S only (nothing to accumulate yet).
            slot = kv_count % KV_BUFFERS
            tlx.barrier_wait(k_full[slot], (kv_count // KV_BUFFERS) & 1)
            qk = tlx.async_dot_wait(0, _qk_in_turn(q_tile, k_tiles[slot], cid))
            tlx.barrier_arrive(k_empty[slot], 1)
            p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, lo, rows, full_lo, full_hi, q_len, kv_len, window,
                                                scale_log2, BLOCK_N, NEG_SCALE, HAS_WINDOW, CAUSAL)
            kv_count += 1
            for n in range(lo + BLOCK_N, hi, BLOCK_N):
                slot = kv_count % KV_BUFFERS
                prev = (kv_count - 1) % KV_BUFFERS
                tlx.barrier_wait(k_full[slot], (kv_count // KV_BUFFERS) & 1)
                qk = _qk_in_turn(q_tile, k_tiles[slot], cid)
                # PV of the previous block (its p is relative to the current running max) behind the QK.
                tlx.barrier_wait(v_full[prev], ((kv_count - 1) // KV_BUFFERS) & 1)
                acc = tlx.async_dot(p.to(DT), v_tiles[prev], acc)
                qk = tlx.async_dot_wait(1, qk)  # retires the QK; the PV may still run
                tlx.barrier_arrive(k_empty[slot], 1)
                p, alpha, m_i, l_i = _softmax_block(qk, m_i, l_i, n, rows, full_lo, full_hi, q_len, kv_len, window,
                                                    scale_log2, BLOCK_N, NEG_SCALE, HAS_WINDOW, CAUSAL)
                acc = tlx.async_dot_wait(0, acc)
                tlx.barrier_arrive(v_empty[prev], 1)
                acc = acc * alpha[:, None]
                kv_count += 1
            prev = (kv_count - 1) % KV_BUFFERS
            tlx.barrier_wait(v_full[prev], ((kv_count - 1) // KV_BUFFERS) & 1)
            acc = tlx.async_dot_wait(0, tlx.async_dot(p.to(DT), v_tiles[prev], acc))
            tlx.barrier_arrive(v_empty[prev], 1)
            tlx.barrier_arrive(q_empty[q_slot], 1)  # every MMA reading this Q has retired

            out, lse = finalize(acc, m_i, l_i, scale_abs)
            row_ok = rows < q_len
            o_rows = tl.cast(out_start + rows, tl.int64) * so_t + tl.cast(head, tl.int64) * so_h
            tl.store(Out + o_rows[:, None] + tl.arange(0, HEAD_DIM)[None, :], out.to(DT), mask=row_ok[:, None])
            stat = tl.cast(head, tl.int64) * stat_h + out_start + rows
            tl.store(Lse + stat, lse, mask=row_ok)
            tl.store(RowMax + stat, m_i, mask=row_ok)
            tl.store(RowSum + stat, l_i, mask=row_ok)


@triton.jit
def query_ring_barriers(Q_BUFFERS: tl.constexpr, KV_BUFFERS: tl.constexpr):
    """The mbarriers of a query-tile kernel (this forward, the dQ pass): q_full/q_empty per consumer and Q slot
    (one arrival each), k and v full (the producer's TMA) and empty (both consumers) per ring slot."""
    q_full = tlx.alloc_barriers(num_barriers=2 * Q_BUFFERS, arrive_count=1)
    q_empty = tlx.alloc_barriers(num_barriers=2 * Q_BUFFERS, arrive_count=1)
    k_full = tlx.alloc_barriers(num_barriers=KV_BUFFERS, arrive_count=1)
    k_empty = tlx.alloc_barriers(num_barriers=KV_BUFFERS, arrive_count=2)
    v_full = tlx.alloc_barriers(num_barriers=KV_BUFFERS, arrive_count=1)
    v_empty = tlx.alloc_barriers(num_barriers=KV_BUFFERS, arrive_count=2)
    return q_full, q_empty, k_full, k_empty, v_full, v_empty


@triton.jit(do_not_specialize=["n_tiles", "n_heads", "group", "window", "stat_h", "q_rows", "kv_rows"])
def fwd_ws_kernel(
    desc_q, desc_k, desc_v, Out, Lse, RowMax, RowSum,
    tiles, n_tiles, q_offsets, out_offsets, kv_offsets,
    sq_h, sk_h, sv_h, so_t, so_h, stat_h, q_rows, kv_rows,
    scale_log2, scale_abs, window, n_heads, group,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_BUFFERS: tl.constexpr,
    KV_BUFFERS: tl.constexpr,
    NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Persistent warp-specialised forward over the tiles of `tiles` (`TileTable.run_rows`: sequence, m0, run)."""
    HALF: tl.constexpr = BLOCK_M // 2
    DT: tl.constexpr = tlx.dtype_of(desc_q)
    q_tiles = tlx.local_alloc((HALF, HEAD_DIM), DT, 2 * Q_BUFFERS)  # slot s of consumer c: 2s + c
    k_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), DT, KV_BUFFERS)
    v_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), DT, KV_BUFFERS)
    q_full, q_empty, k_full, k_empty, v_full, v_empty = query_ring_barriers(Q_BUFFERS, KV_BUFFERS)
    with tlx.async_tasks():
        with tlx.async_task("default"):
            _load_tiles(desc_q, None, desc_k, desc_v, q_tiles, None, k_tiles, v_tiles, q_full, q_empty, k_full,
                        k_empty, v_full, v_empty, tiles, n_tiles, q_offsets, out_offsets, kv_offsets, sq_h, 0, sk_h,
                        sv_h, q_rows, 0, kv_rows, window, n_heads, group, HEAD_DIM, BLOCK_M, BLOCK_N, Q_BUFFERS,
                        KV_BUFFERS, HAS_WINDOW, CAUSAL)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS, replicate=2):
            _attend_tiles(q_tiles, k_tiles, v_tiles, q_full, q_empty, k_full, k_empty, v_full, v_empty, Out, Lse,
                          RowMax, RowSum, tiles, n_tiles, q_offsets, out_offsets, kv_offsets, so_t, so_h, stat_h,
                          scale_log2, scale_abs, window, n_heads, tlx.async_task_replica_id(), HEAD_DIM, BLOCK_M,
                          BLOCK_N, Q_BUFFERS, KV_BUFFERS, NEG_SCALE, HAS_WINDOW, CAUSAL)
