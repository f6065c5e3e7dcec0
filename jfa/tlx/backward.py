"""TLX warp-specialised backward passes for Hopper (sm_90), each a TMA producer and two wgmma consumers: dK/dV
(`dkv_ws_kernel`), dQ with D (`dq_ws_kernel`) and, at the end of this module, the short-query pass
(`short_ws_kernel`: the whole backward of sequences of at most 128 query rows, deterministic in both modes).

Imported only when fbtriton (Triton with TLX) is installed: `jfa.tlx.backend` imports it lazily. The rest of
the backward (packed sequences, broadcast_q's dQ reduction) stays with the Triton kernels. Two modes of the
dQ and dK/dV passes:
- deterministic=True: the dQ pass runs first and the dK/dV pass reads the D = rowsum(dO∘O) it stores. Nothing
  is accumulated with atomics, so every gradient is deterministic and batch invariant, as with the Triton
  backward; and since both add the same products to each key's dk and dv (and each row's dq) in the same
  order, the gradients are bitwise those of the Triton kernels (checked on jfa.bench's gem, long and skew rows
  on the H200).
- deterministic=False: the dK/dV pass alone, with DQ_REDUCE (D from the Triton `_delta_kernel`): it also adds
  each query block's dq into an fp32 array by TMA reduce (`_reduce_dq`), in no fixed order across tiles, so
  dq is not bitwise reproducible; dk and dv still are (same products, same order).

Tile = (sequence, BLOCK_N = 128 keys, key/value head), from `jfa.tile_scheduler.key_tiles` (sorted by the
query blocks that see the keys); persistent over the static zigzag dealing of `jfa.tlx.forward`.

One CTA = three warpgroups:
- producer (the "default" task, 4 warps): per tile, TMA loads of the two 64-key halves of K and of V (one
  half per consumer), then for every query head of the group and every query block of
  `jfa.block_info.q_block_range` (BLOCK_M = 64 rows) the Q and dO blocks and the rows' statistics m_safe and
  2^-24/l (`jfa.softmax.backward_row_stats` of the forward's m and l, computed per row before the pass by the
  Triton `_row_stats_kernel`, not per block in the consumers) and D into a ring of BUFFERS slots;
- two consumers (4 warps each): consumer c owns keys [c·64, c·64 + 64) of the tile and their dk and dv
  accumulators. Per query block: Sᵀ = K_c·Qᵀ and dPᵀ = V_c·dOᵀ issued together (wgmma from shared memory),
  Pᵀ recomputed from those statistics while dPᵀ runs (`jfa.softmax.shifted_exp2`, subnormals kept), dv += Pᵀ·dO
  issued, dSᵀ = Pᵀ∘(dPᵀ - D) while it runs, then dk += dSᵀ·Q (Pᵀ and dSᵀ from registers, rounded to the input dtype).
  dk (times the scale) and dv are stored once per tile, keys past the sequence masked.

The statistics are [Hq, rows] fp32 arrays read through flat 1-D descriptors. TMA wants a 16-byte aligned
start in the innermost dimension, so each block's box starts at the multiple of 4 elements at or below its
first row and spans 2·BLOCK_M; the consumers gather the block's rows from their offset in it
(`tlx.local_gather`). Reading them from shared memory, not from global memory in the consumers' critical
path, is what made this pass faster than the Triton kernel (11.6 → 4.1 ms per call on gem); a box starting
at an unaligned row made the H200 raise an illegal instruction.

Barriers (mbarriers; waits and phases as in `jfa.tlx.forward`):
- kv_full[c] / kv_empty[c]: consumer c's K and V halves of the program's r-th tile, phase r & 1; kv_full
  completes on the TMA bytes, kv_empty on consumer c's arrival after the tile's last MMA.
- q_full[s] / q_empty[s]: the Q, dO and statistics of the program's i-th query block (counted across its
  tiles) in slot s = i % BUFFERS, phase (i // BUFFERS) & 1; q_empty takes both consumers' arrivals.

Jagged rows: as in the forward, the descriptors of Q, dO, K and V are 2-D views [T, (H - 1)·s_h + D] and a
block running past its sequence reads the next sequence's rows (finite) or TMA's zeros past T. The
visibility rule and the row mask apply to every block: scores of invisible or foreign pairs become -inf, so
Pᵀ and dSᵀ are exactly 0 there and foreign rows add nothing to dk and dv. Keys past kv_len are computed and
never stored; a tile no query block sees stores zeros.

Registers: 240 per consumer thread (the dk and dv accumulators alone take 128), 24 for the producer's;
`python -m jfa.tlx.compile_check` (fbtriton 3.7.4, strides divisible by 16 as the launcher specialises
them) at D 128, causal and window on (`--quick`, 2026-12-02): dK/dV 147 KiB of shared memory, no spill (211 KiB
and 132 bytes of spill with the dq reduce); dQ 208 KiB, no spill.
"""

from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from jfa.block_info import q_block_range
from jfa.mask import visible
from jfa.softmax import backward_row_stats, raw_scores, row_delta, shifted_exp2
from jfa.tile_scheduler import tile_at
from jfa.tlx.forward import CONSUMER_THREADS, _load_tiles, _pass_tile, _rounds, _tile, _tile_round, query_ring_barriers
from jfa.triton.forward import sequence_bounds

# Per consumer thread: the dk and dv accumulators alone take 128 (64 keys × D 128 × 2 in fp32 over 128
# threads); the producer keeps what is left of the SM's 65,536 registers (24 for each of its 128 threads).
CONSUMER_REGISTERS = tl.constexpr(240)
STAT_ALIGN = tl.constexpr(4)  # fp32 elements per 16 bytes


@triton.jit
def _key_tile(tiles, t, n_kv_heads, q_offsets, out_offsets, kv_offsets, window, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """Tile t (`jfa.tile_scheduler.tile_at` over run rows): (kv_head, n0, q_start, out_start, q_len, kv_start,
    kv_len, lo, hi), [lo, hi) the query blocks that see keys [n0, n0 + BLOCK_N) of the sequence."""
    seq, n0, kv_head = tile_at(tiles, t, n_kv_heads, True)
    q_start, out_start, q_len, kv_start, kv_len = sequence_bounds(q_offsets, out_offsets, kv_offsets, seq)
    lo, _, _, hi = q_block_range(n0, tl.minimum(n0 + BLOCK_N, kv_len), q_len, kv_len, window, BLOCK_M, HAS_WINDOW,
                                 CAUSAL)
    return kv_head, n0, q_start, out_start, q_len, kv_start, kv_len, lo, hi


@triton.jit
def _load_blocks(desc_q, desc_do, desc_k, desc_v, desc_shift, desc_scale, desc_delta, q_tiles, do_tiles, k_tiles,
                 v_tiles, shift_tiles, scale_tiles, delta_tiles, q_full, q_empty, kv_full, kv_empty, tiles, n_tiles,
                 q_offsets, out_offsets, kv_offsets, sq_h, sdo_h, sk_h, sv_h, stat_h, q_rows, out_rows, kv_rows, window,
                 n_kv_heads, group, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BUFFERS: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """The producer: TMA loads of every tile's key/value halves and of the query blocks that see them, with
    their rows' statistics (m_safe, 2^-24/l and D: flat views of the [Hq, rows] fp32 arrays)."""
    HALF: tl.constexpr = BLOCK_N // 2
    ELEM: tl.constexpr = tlx.size_of(tlx.dtype_of(desc_q))
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    count = 0
    for r in range(0, _rounds(pid, nprog, n_tiles)):
        kv_head, n0, q_start, out_start, q_len, kv_start, kv_len, lo, hi = _key_tile(
            tiles, _tile_round(r, pid, nprog), n_kv_heads, q_offsets, out_offsets, kv_offsets, window, BLOCK_M,
            BLOCK_N, HAS_WINDOW, CAUSAL)
        for c in tl.static_range(2):
            # Clamped into the tensor: only a half past the sequence (never stored) can start past the last row.
            row = tl.minimum(kv_start + n0 + c * HALF, kv_rows - 1)
            tlx.barrier_wait(kv_empty[c], (r & 1) ^ 1)  # consumer c finished the previous tile
            tlx.barrier_expect_bytes(kv_full[c], 2 * ELEM * HALF * HEAD_DIM)
            tlx.async_descriptor_load(desc_k, k_tiles[c], [row, kv_head * sk_h], kv_full[c])
            tlx.async_descriptor_load(desc_v, v_tiles[c], [row, kv_head * sv_h], kv_full[c])
        for hh in range(group):
            head = kv_head * group + hh
            for m in range(lo, hi, BLOCK_M):
                slot = count % BUFFERS
                tlx.barrier_wait(q_empty[slot], ((count // BUFFERS) & 1) ^ 1)  # both consumers released it
                tlx.barrier_expect_bytes(q_full[slot], 2 * ELEM * BLOCK_M * HEAD_DIM + 3 * 4 * 2 * BLOCK_M)
                tlx.async_descriptor_load(desc_q, q_tiles[slot], [tl.minimum(q_start + m, q_rows - 1), head * sq_h],
                                          q_full[slot])
                tlx.async_descriptor_load(desc_do, do_tiles[slot],
                                          [tl.minimum(out_start + m, out_rows - 1), head * sdo_h], q_full[slot])
                # TMA needs a 16-byte aligned start in the innermost dimension: the box starts at the row's
                # multiple of 4 below, and the consumers read from the row's offset in it.
                stat = head * stat_h + out_start + m
                aligned = stat - stat % STAT_ALIGN
                tlx.async_descriptor_load(desc_shift, shift_tiles[slot], [aligned], q_full[slot])
                tlx.async_descriptor_load(desc_scale, scale_tiles[slot], [aligned], q_full[slot])
                tlx.async_descriptor_load(desc_delta, delta_tiles[slot], [aligned], q_full[slot])
                count += 1


# Named barriers (ids 9 and 10 are the forward's): both consumers' dSᵀ halves of a block are in shared memory;
# both halves of a short-query tile's D are (`_short_tiles`).
DS_READY = tl.constexpr(11)
DELTA_READY = tl.constexpr(12)


@triton.jit
def _reduce_dq(dst, ds_tiles, dq_stage, k_tiles, desc_dq, count, row, column0, sm_scale, cid: tl.constexpr,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """dq += dS·K of one query block, consumer `cid`'s half of the columns (the split of FlashAttention-3's
    Hopper backward: each consumer's registers hold 64 rows × D/2 of dq, not 64 × D beside dk and dv). The
    block's dSᵀ halves (one per consumer) meet in shared memory, double-buffered by block so a consumer one
    block ahead never overwrites what the other's product still reads; the product, times the scale, goes
    through a staging buffer to a TMA reduce-add into the fp32 dq at (row, column0 + cid·D/2)."""
    COLS: tl.constexpr = HEAD_DIM // 2
    ds_slot = (count % 2) * 2
    tlx.local_store(ds_tiles[ds_slot + cid], dst)
    tlx.fence("async_shared")
    tlx.named_barrier_wait(DS_READY, CONSUMER_THREADS)
    dq = tlx.async_dot(tlx.local_trans(ds_tiles[ds_slot]), tlx.local_slice(k_tiles[0], [0, cid * COLS], [HALF, COLS]))
    dq = tlx.async_dot(tlx.local_trans(ds_tiles[ds_slot + 1]),
                       tlx.local_slice(k_tiles[1], [0, cid * COLS], [HALF, COLS]), dq)
    dq = tlx.async_dot_wait(0, dq)
    tlx.async_descriptor_store_wait(0)  # the previous block's reduce has read the staging buffer
    tlx.local_store(dq_stage[cid], dq * sm_scale)
    tlx.fence("async_shared")
    tlx.async_descriptor_store(desc_dq, dq_stage[cid], [row, column0 + cid * COLS], store_reduce="add")


@triton.jit
def _accumulate_tiles(q_tiles, do_tiles, k_tiles, v_tiles, shift_tiles, scale_tiles, delta_tiles, q_full, q_empty,
                      kv_full, kv_empty, ds_tiles, dq_stage, desc_dq, DK, DV, tiles, n_tiles, q_offsets, out_offsets,
                      kv_offsets, sdk_t, sdk_h, sdv_t, sdv_h, sdq_h, stat_h, scale_log2, sm_scale, window, n_kv_heads,
                      group, cid: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BUFFERS: tl.constexpr, NEG_SCALE: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, DQ_REDUCE: tl.constexpr):
    """Consumer `cid`: dk and dv of keys [cid·64, cid·64 + 64) of every tile of this program; with DQ_REDUCE
    also columns [cid·D/2, cid·D/2 + D/2) of every query block's dq over the tile's 128 keys, added into the
    fp32 dq behind `desc_dq` by TMA reduce."""
    HALF: tl.constexpr = BLOCK_N // 2
    DT: tl.constexpr = DK.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    count = 0
    for r in range(0, _rounds(pid, nprog, n_tiles)):
        kv_head, n0, q_start, out_start, q_len, kv_start, kv_len, lo, hi = _key_tile(
            tiles, _tile_round(r, pid, nprog), n_kv_heads, q_offsets, out_offsets, kv_offsets, window, BLOCK_M,
            BLOCK_N, HAS_WINDOW, CAUSAL)
        keys = n0 + cid * HALF + tl.arange(0, HALF)
        k_tile = k_tiles[cid]
        v_tile = v_tiles[cid]
        dk = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
        tlx.barrier_wait(kv_full[cid], r & 1)
        for hh in range(group):
            head = kv_head * group + hh
            for m in range(lo, hi, BLOCK_M):
                rows = m + offs_r
                stat_at = (head * stat_h + out_start + m) % STAT_ALIGN + offs_r  # in the slot's statistics box
                row_ok = rows < q_len
                slot = count % BUFFERS
                tlx.barrier_wait(q_full[slot], (count // BUFFERS) & 1)
                st = tlx.async_dot(k_tile, tlx.local_trans(q_tiles[slot]))  # Sᵀ [HALF, BLOCK_M]
                dpt = tlx.async_dot(v_tile, tlx.local_trans(do_tiles[slot]))  # dPᵀ, runs during the exponents
                st = tlx.async_dot_wait(1, st)
                # The rule and the row mask on every block (a few integer compares per element; the blocks
                # inside the sequence's fully visible range pass them all). Rows past the sequence read another
                # sequence's statistics or TMA's zeros: their scores are -inf here, so their Pᵀ is 0 whatever
                # they say (finite: `_row_stats_kernel` wrote them for every row from the forward's m and l).
                seen = visible(rows[None, :], keys[:, None], q_len, kv_len, window, HAS_WINDOW, CAUSAL)
                s_raw = tl.where(seen & row_ok[None, :], raw_scores(st, NEG_SCALE), float("-inf"))
                m_b = tlx.local_gather(shift_tiles[slot], stat_at, 0)  # `backward_row_stats`, per row beforehand
                inv_b = tlx.local_gather(scale_tiles[slot], stat_at, 0)
                pt = shifted_exp2((s_raw - m_b[None, :]) * scale_log2) * inv_b[None, :]
                dv = tlx.async_dot(pt.to(DT), do_tiles[slot], dv)  # runs during dSᵀ
                dpt = tlx.async_dot_wait(1, dpt)
                # D of rows past the sequence may never have been written (a packed sequence's rows, whose D
                # stays in the packed kernel): 0 there, since 0 · NaN would poison dk.
                delta = tl.where(row_ok, tlx.local_gather(delta_tiles[slot], stat_at, 0), 0.0)
                dst = (pt * (dpt - delta[None, :])).to(DT)
                dk = tlx.async_dot(dst, q_tiles[slot], dk)
                if DQ_REDUCE:
                    _reduce_dq(dst, ds_tiles, dq_stage, k_tiles, desc_dq, count, out_start + m,
                               head * sdq_h, sm_scale, cid, HEAD_DIM, HALF)
                dv = tlx.async_dot_wait(0, dv)
                dk = tlx.async_dot_wait(0, dk)
                tlx.barrier_arrive(q_empty[slot], 1)
                count += 1
        if DQ_REDUCE:  # the other consumer's dq products read this consumer's K half too
            tlx.barrier_arrive(kv_empty[0], 1)
            tlx.barrier_arrive(kv_empty[1], 1)
        else:
            tlx.barrier_arrive(kv_empty[cid], 1)  # every MMA reading this tile's K and V has retired
        key_ok = (keys < kv_len)[:, None]
        dk_rows = tl.cast(kv_start + keys, tl.int64) * sdk_t + tl.cast(kv_head, tl.int64) * sdk_h
        dv_rows = tl.cast(kv_start + keys, tl.int64) * sdv_t + tl.cast(kv_head, tl.int64) * sdv_h
        tl.store(DK + dk_rows[:, None] + offs_d[None, :], (dk * sm_scale).to(DT), mask=key_ok)
        tl.store(DV + dv_rows[:, None] + offs_d[None, :], dv.to(DT), mask=key_ok)
    if DQ_REDUCE:
        tlx.async_descriptor_store_wait(0)  # the last reduce has read the staging buffer before the CTA exits


@triton.jit(do_not_specialize=["n_tiles", "n_kv_heads", "group", "window", "stat_h", "q_rows", "out_rows",
                               "kv_rows"])
def dkv_ws_kernel(
    desc_q, desc_do, desc_k, desc_v, desc_shift, desc_scale, desc_delta, desc_dq, DK, DV,
    tiles, n_tiles, q_offsets, out_offsets, kv_offsets,
    sq_h, sdo_h, sk_h, sv_h, sdk_t, sdk_h, sdv_t, sdv_h, sdq_h, stat_h, q_rows, out_rows, kv_rows,
    scale_log2, sm_scale, window, n_kv_heads, group,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUFFERS: tl.constexpr,
    NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, DQ_REDUCE: tl.constexpr,
):
    """Persistent warp-specialised dK/dV over the key tiles of `tiles` (`TileTable.run_rows`: sequence, n0,
    run); with DQ_REDUCE also dq, added into the fp32 [out rows, Hq·D] view behind `desc_dq` (None without)."""
    HALF: tl.constexpr = BLOCK_N // 2
    DT: tl.constexpr = tlx.dtype_of(desc_q)
    k_tiles = tlx.local_alloc((HALF, HEAD_DIM), DT, 2)  # consumer c's keys in slot c
    v_tiles = tlx.local_alloc((HALF, HEAD_DIM), DT, 2)
    q_tiles = tlx.local_alloc((BLOCK_M, HEAD_DIM), DT, BUFFERS)
    do_tiles = tlx.local_alloc((BLOCK_M, HEAD_DIM), DT, BUFFERS)
    shift_tiles = tlx.local_alloc((2 * BLOCK_M,), tl.float32, BUFFERS)  # a block's rows at offset < STAT_ALIGN
    scale_tiles = tlx.local_alloc((2 * BLOCK_M,), tl.float32, BUFFERS)
    delta_tiles = tlx.local_alloc((2 * BLOCK_M,), tl.float32, BUFFERS)
    kv_full = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    kv_empty = tlx.alloc_barriers(num_barriers=2, arrive_count=2 if DQ_REDUCE else 1)
    q_full = tlx.alloc_barriers(num_barriers=BUFFERS, arrive_count=1)
    q_empty = tlx.alloc_barriers(num_barriers=BUFFERS, arrive_count=2)
    ds_tiles = None
    dq_stage = None
    if DQ_REDUCE:
        ds_tiles = tlx.local_alloc((HALF, BLOCK_M), DT, 4)  # block parity p, consumer c: slot 2p + c
        dq_stage = tlx.local_alloc((BLOCK_M, HEAD_DIM // 2), tl.float32, 2)  # one per consumer
    with tlx.async_tasks():
        with tlx.async_task("default"):
            _load_blocks(desc_q, desc_do, desc_k, desc_v, desc_shift, desc_scale, desc_delta, q_tiles, do_tiles,
                         k_tiles, v_tiles, shift_tiles, scale_tiles, delta_tiles, q_full, q_empty, kv_full, kv_empty,
                         tiles, n_tiles, q_offsets, out_offsets, kv_offsets, sq_h, sdo_h, sk_h, sv_h, stat_h, q_rows,
                         out_rows, kv_rows, window, n_kv_heads, group, HEAD_DIM, BLOCK_M, BLOCK_N, BUFFERS, HAS_WINDOW,
                         CAUSAL)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS, replicate=2):
            _accumulate_tiles(q_tiles, do_tiles, k_tiles, v_tiles, shift_tiles, scale_tiles, delta_tiles, q_full,
                              q_empty, kv_full, kv_empty, ds_tiles, dq_stage, desc_dq, DK, DV, tiles, n_tiles,
                              q_offsets, out_offsets, kv_offsets, sdk_t, sdk_h, sdv_t, sdv_h, sdq_h, stat_h,
                              scale_log2, sm_scale, window, n_kv_heads, group, tlx.async_task_replica_id(), HEAD_DIM,
                              BLOCK_M, BLOCK_N, BUFFERS, NEG_SCALE, HAS_WINDOW, CAUSAL, DQ_REDUCE)


# ---------------------------------------------------------------------------------------------------------
# The dQ pass (and D): query tiles, as the forward's. Tile = (sequence, BLOCK_M = 128 query rows, query head)
# from `jfa.tile_scheduler.query_tiles`; consumer c owns rows [c·64, c·64 + 64): at the tile's start D from O
# (global) and dO (shared), stored for the dK/dV pass; per key block S = Q·Kᵀ and dP = dO·Vᵀ issued together,
# P while dP runs, dS = P∘(dP - D), dq += dS·K (dS from registers); dq (times the scale) stored once. Barriers
# as in `jfa.tlx.forward` (q_full/q_empty per consumer and slot, k/v full and empty per ring slot, the empties
# taking both consumers' arrivals; V is released once dP retires, K once dq's product does).


@triton.jit
def _dq_tiles(q_tiles, do_tiles, k_tiles, v_tiles, q_full, q_empty, k_full, k_empty, v_full, v_empty, Out, DQ, RowMax,
              RowSum, Delta, tiles, n_tiles, q_offsets, out_offsets, kv_offsets, so_t, so_h, sdq_t, sdq_h, stat_h,
              scale_log2, sm_scale, window, n_heads, cid: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_BUFFERS: tl.constexpr, KV_BUFFERS: tl.constexpr,
              NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """Consumer `cid`: D and dq of query rows [cid·64, cid·64 + 64) of every tile of this program."""
    HALF: tl.constexpr = BLOCK_M // 2
    DT: tl.constexpr = DQ.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_count = 0
    for r in range(0, _rounds(pid, nprog, n_tiles)):
        head, m0, q_start, out_start, q_len, kv_start, kv_len, lo, _, _, hi = _tile(
            tiles, _tile_round(r, pid, nprog), n_heads, q_offsets, out_offsets, kv_offsets, window, BLOCK_M,
            BLOCK_N, HAS_WINDOW, CAUSAL, True)
        q_slot = (r % Q_BUFFERS) * 2 + cid
        q_phase = (r // Q_BUFFERS) & 1
        if m0 + cid * HALF >= q_len:  # no row of this half exists (see _pass_tile)
            kv_count = _pass_tile(q_full, q_empty, k_full, k_empty, v_full, v_empty, q_slot, q_phase, lo, hi,
                                  kv_count, cid, BLOCK_N, KV_BUFFERS, False)
        else:
            rows = m0 + cid * HALF + tl.arange(0, HALF)
            row_ok = rows < q_len
            stat = tl.cast(head, tl.int64) * stat_h + out_start + rows
            m_b, inv_b = backward_row_stats(tl.load(RowMax + stat, mask=row_ok, other=0.0),
                                            tl.load(RowSum + stat, mask=row_ok, other=0.0))
            o_rows = tl.cast(out_start + rows, tl.int64) * so_t + tl.cast(head, tl.int64) * so_h
            o = tl.load(Out + o_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            tlx.barrier_wait(q_full[q_slot], q_phase)
            q_tile = q_tiles[q_slot]
            do_tile = do_tiles[q_slot]
            # D = rowsum(dO∘O) from the rounded output, stored for the dK/dV pass (as the Triton dQ pass does).
            delta = row_delta(tlx.local_load(do_tile), o)
            tl.store(Delta + stat, delta, mask=row_ok)
            dq = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
            for n in range(lo, hi, BLOCK_N):
                slot = kv_count % KV_BUFFERS
                phase = (kv_count // KV_BUFFERS) & 1
                tlx.barrier_wait(k_full[slot], phase)
                tlx.barrier_wait(v_full[slot], phase)
                s = tlx.async_dot(q_tile, tlx.local_trans(k_tiles[slot]))  # S [HALF, BLOCK_N]
                dp = tlx.async_dot(do_tile, tlx.local_trans(v_tiles[slot]))  # dP, runs during the exponents
                s = tlx.async_dot_wait(1, s)
                keys = n + tl.arange(0, BLOCK_N)
                seen = visible(rows[:, None], keys[None, :], q_len, kv_len, window, HAS_WINDOW, CAUSAL)
                s_raw = tl.where(seen & row_ok[:, None], raw_scores(s, NEG_SCALE), float("-inf"))
                p = shifted_exp2((s_raw - m_b[:, None]) * scale_log2) * inv_b[:, None]
                dp = tlx.async_dot_wait(0, dp)
                tlx.barrier_arrive(v_empty[slot], 1)
                dq = tlx.async_dot((p * (dp - delta[:, None])).to(DT), k_tiles[slot], dq)
                dq = tlx.async_dot_wait(0, dq)
                tlx.barrier_arrive(k_empty[slot], 1)
                kv_count += 1
            tlx.barrier_arrive(q_empty[q_slot], 1)  # every MMA reading this tile's Q and dO has retired
            dq_rows = tl.cast(q_start + rows, tl.int64) * sdq_t + tl.cast(head, tl.int64) * sdq_h
            tl.store(DQ + dq_rows[:, None] + offs_d[None, :], (dq * sm_scale).to(DT), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_tiles", "n_heads", "group", "window", "stat_h", "q_rows", "out_rows", "kv_rows"])
def dq_ws_kernel(
    desc_q, desc_do, desc_k, desc_v, Out, DQ, RowMax, RowSum, Delta,
    tiles, n_tiles, q_offsets, out_offsets, kv_offsets,
    sq_h, sdo_h, sk_h, sv_h, so_t, so_h, sdq_t, sdq_h, stat_h, q_rows, out_rows, kv_rows,
    scale_log2, sm_scale, window, n_heads, group,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_BUFFERS: tl.constexpr,
    KV_BUFFERS: tl.constexpr, NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Persistent warp-specialised dQ pass (and D) over the query tiles of `tiles` (`TileTable.run_rows`:
    sequence, m0, run)."""
    HALF: tl.constexpr = BLOCK_M // 2
    DT: tl.constexpr = tlx.dtype_of(desc_q)
    q_tiles = tlx.local_alloc((HALF, HEAD_DIM), DT, 2 * Q_BUFFERS)  # slot s of consumer c: 2s + c
    do_tiles = tlx.local_alloc((HALF, HEAD_DIM), DT, 2 * Q_BUFFERS)
    k_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), DT, KV_BUFFERS)
    v_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), DT, KV_BUFFERS)
    q_full, q_empty, k_full, k_empty, v_full, v_empty = query_ring_barriers(Q_BUFFERS, KV_BUFFERS)
    with tlx.async_tasks():
        with tlx.async_task("default"):
            _load_tiles(desc_q, desc_do, desc_k, desc_v, q_tiles, do_tiles, k_tiles, v_tiles, q_full, q_empty, k_full,
                        k_empty, v_full, v_empty, tiles, n_tiles, q_offsets, out_offsets, kv_offsets, sq_h, sdo_h,
                        sk_h, sv_h, q_rows, out_rows, kv_rows, window, n_heads, group, HEAD_DIM, BLOCK_M, BLOCK_N,
                        Q_BUFFERS, KV_BUFFERS, HAS_WINDOW, CAUSAL)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS, replicate=2):
            _dq_tiles(q_tiles, do_tiles, k_tiles, v_tiles, q_full, q_empty, k_full, k_empty, v_full, v_empty, Out, DQ,
                      RowMax, RowSum, Delta, tiles, n_tiles, q_offsets, out_offsets, kv_offsets, so_t, so_h, sdq_t,
                      sdq_h, stat_h, scale_log2, sm_scale, window, n_heads, tlx.async_task_replica_id(), HEAD_DIM,
                      BLOCK_M, BLOCK_N, Q_BUFFERS, KV_BUFFERS, NEG_SCALE, HAS_WINDOW, CAUSAL)


# ---------------------------------------------------------------------------------------------------------
# The short-query backward (`short_ws_kernel`): tile = (sequence, query head) of a sequence whose q_len <= 128
# query rows are all resident (the Triton short-query table: no GQA, so each key's dk and dv come from this
# tile alone). The producer loads the tile's Q, dO and row statistics (m, l) once, then the sequence's key
# blocks of 64 through rings of K_BUFFERS and V_BUFFERS. Each consumer computes D = rowsum(dO∘O) of half the
# rows at the tile's start (O read from global memory, its load issued before the wait for dO) into shared
# memory for both (named barrier DELTA_READY), so no D kernel runs before this pass (jfa.bench's broadcast row,
# H200, 2026-12-04: forward+backward 2.004 -> 1.932 ms a call, the same dk and dv bits). The consumers take
# the blocks in pairs, consumer c block 2i + c of pair i, against all the query rows: Sᵀ = K·Qᵀ and
# dPᵀ = V·dOᵀ, Pᵀ recomputed, dv = Pᵀ·dO
# and dk = dSᵀ·Q complete and stored at once. dq stays in registers over the whole sequence, split by columns
# (consumer c holds dq[:, c·D/2 : (c + 1)·D/2], 128 rows × D/2 in fp32): each pair's two dSᵀ tiles meet in
# shared memory (named barrier DS_READY) and each consumer adds both blocks' dS·K to its columns. The tiles come
# from a host-made list per program (`jfa.tile_scheduler.program_lists`), and dq is stored at the end of each
# *segment* of it: without broadcast_q every tile is one (the zigzag dealing; dq, or the fp32 partial at the
# output rows when `DQ_PARTIAL`, stored once per tile), and the products and their order are the Triton
# short-query kernel's (128 × 64 blocks), so are the bits (dq, dk and dv on jfa.bench's broadcast row, H200,
# 2026-12-01, before the segments). With broadcast_q (every sequence's dq adds into the same query rows) a
# segment is a program's run of tiles of one head: it sums their dq in registers and stores one fp32 partial,
# at its first sequence's output rows, which the Triton reduction sums with the others in a fixed order (about
# 132 + Hq partials instead of B·Hq; on jfa.bench's broadcast row, H200, 2026-12-04, the reduction 0.093 ->
# 0.015 ms, this pass 1.468 -> 1.474 ms, forward+backward 0.969x, the same dk and dv bits). The dealing is
# static, so dq stays deterministic; its bits differ from the Triton kernel's (another order of the sum).
# Barriers: q_full/q_empty (one slot; q_empty takes both consumers' arrivals), k_full/k_empty and v_full/v_empty
# per ring slot (k_empty: both consumers, after the pair's dq products read the block's K; v_empty: the block's
# consumer, once its dv and dk went out through the slot (below): V is released before the pair's dq products,
# so its ring is shorter than K's), ds_free[c]: the
# other consumer has read consumer c's last dSᵀ (consumer c waits on it before writing the next one).
# Measured on the broadcast row (H200, 2026-12-01): the statistics read from global memory per block instead
# of from shared memory made the kernel 1.77 -> 2.15 ms, and the K ring of 4 that the freed shared memory
# allows won back only 2% of that (2.11 ms). The K ring is 4 deep (2026-12-03): with 3, the second block of
# pair i + 1 waits until pair i's dq products release K; 4 holds two whole pairs. It fits because the fp32 dq
# is stored in column parts (`_store_dq`), whose layout conversion needs a part of the scratch: 1.756 -> 1.678
# ms a call on the broadcast row, the same dk and dv bits (docs/performance-log.md). dv and dk are stored through
# the block's V slot, free once dPᵀ retired (2026-12-03): rounded to bf16 in the product's layout, then read back
# in the global store's, where the store's own conversion ran on fp32 in four rounds of shared-memory scratch
# with barriers; spill at D 128 444 -> 228 bytes, and 1.670 -> 1.472 ms a call on the broadcast row (the same
# dk and dv bits). At D 128 a block within its sequence goes out from the slot by TMA store (`_store_keys`), with
# the V ring of 3 that the dq store's eighths make room for: 1.647 -> 1.403 ms a call on an H100 (2026-12-05).
# The producer issues K and V of a block in turn; issuing K ahead of V did not help (nor a V ring of 3 alone, nor
# consumers out of step at the pair's meeting: docs/performance-log.md).


@triton.jit
def _program_rows(list_starts):
    """(first row, number of rows) of this program's part of a `jfa.tile_scheduler.ProgramLists` list."""
    first = tl.load(list_starts + tl.program_id(0))
    return first, tl.load(list_starts + tl.program_id(0) + 1) - first


@triton.jit
def _load_short(desc_q, desc_do, desc_k, desc_v, desc_m, desc_l, q_tile, do_tile, k_tiles, v_tiles,
                m_tile, l_tile, q_full, q_empty, k_full, k_empty, v_full, v_empty, tiles, lists,
                list_starts, q_offsets, out_offsets, kv_offsets, sq_h, sdo_h, sk_h, sv_h, stat_h, q_rows, out_rows,
                kv_rows, window, n_heads,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_BUFFERS: tl.constexpr,
                V_BUFFERS: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """The producer: per tile the query block with its dO and statistics, then every key block it visits."""
    ELEM: tl.constexpr = tlx.size_of(tlx.dtype_of(desc_q))
    list_start, n_listed = _program_rows(list_starts)
    kv_count = 0
    for r in range(0, n_listed):
        head, _, q_start, out_start, _, kv_start, _, lo, _, _, hi = _tile(
            tiles, tl.load(lists + 2 * (list_start + r)), n_heads, q_offsets, out_offsets, kv_offsets, window, BLOCK_M,
            BLOCK_N, HAS_WINDOW, CAUSAL, False)
        tlx.barrier_wait(q_empty[0], (r & 1) ^ 1)  # both consumers retired the previous tile's products
        tlx.barrier_expect_bytes(q_full[0], 2 * ELEM * BLOCK_M * HEAD_DIM + 2 * 4 * 2 * BLOCK_M)
        tlx.async_descriptor_load(desc_q, q_tile[0], [tl.minimum(q_start, q_rows - 1), head * sq_h], q_full[0])
        tlx.async_descriptor_load(desc_do, do_tile[0], [tl.minimum(out_start, out_rows - 1), head * sdo_h],
                                  q_full[0])
        stat = head * stat_h + out_start
        aligned = stat - stat % STAT_ALIGN  # TMA's 16-byte aligned start, as in `_load_blocks`
        tlx.async_descriptor_load(desc_m, m_tile[0], [aligned], q_full[0])
        tlx.async_descriptor_load(desc_l, l_tile[0], [aligned], q_full[0])
        for n in range(lo, hi, BLOCK_N):
            # Clamped into the tensor: only a block past the sequence (never stored) can start past the last row.
            row = tl.minimum(kv_start + n, kv_rows - 1)
            slot = kv_count % K_BUFFERS
            tlx.barrier_wait(k_empty[slot], ((kv_count // K_BUFFERS) & 1) ^ 1)
            tlx.barrier_expect_bytes(k_full[slot], ELEM * BLOCK_N * HEAD_DIM)
            tlx.async_descriptor_load(desc_k, k_tiles[slot], [row, head * sk_h], k_full[slot])
            slot = kv_count % V_BUFFERS
            tlx.barrier_wait(v_empty[slot], ((kv_count // V_BUFFERS) & 1) ^ 1)
            tlx.barrier_expect_bytes(v_full[slot], ELEM * BLOCK_N * HEAD_DIM)
            tlx.async_descriptor_load(desc_v, v_tiles[slot], [row, head * sv_h], v_full[slot])
            kv_count += 1


@triton.jit
def _zero_keys(DK, DV, kv_start, head, start, end, sdk_t, sdk_h, sdv_t, sdv_h, DT: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk = dv = 0 for keys [start, end) (keys no query row sees). The Triton kernels' `_zero_key_blocks` does
    the same; called here instead, its int64 row-base pointers raised ptxas's spills of this register-bound
    kernel from 512 to 692 bytes at D 128."""
    offs_d = tl.arange(0, HEAD_DIM)
    zeros = tl.zeros([BLOCK_N, HEAD_DIM], dtype=DT)
    for n in range(start, end, BLOCK_N):
        keys = n + tl.arange(0, BLOCK_N)
        key_ok = (keys < end)[:, None]
        key_rows = tl.cast(kv_start + keys, tl.int64)
        tl.store(DK + (key_rows * sdk_t + tl.cast(head, tl.int64) * sdk_h)[:, None] + offs_d[None, :], zeros,
                 mask=key_ok)
        tl.store(DV + (key_rows * sdv_t + tl.cast(head, tl.int64) * sdv_h)[:, None] + offs_d[None, :], zeros,
                 mask=key_ok)


@triton.jit
def _short_tiles(q_tile, do_tile, k_tiles, v_tiles, m_tile, l_tile, delta_tile, q_full, q_empty, k_full, k_empty,
                 v_full, v_empty, ds_tiles, ds_free, Out, so_t, so_h, DQ, DK, DV, desc_dk, desc_dv, tiles, lists,
                 list_starts, q_offsets, out_offsets, kv_offsets, sdq_t, sdq_h, sdk_t, sdk_h, sdv_t, sdv_h, stat_h,
                 scale_log2, sm_scale, window, n_heads,
                 cid: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_BUFFERS: tl.constexpr,
                 V_BUFFERS: tl.constexpr, NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                 DQ_PARTIAL: tl.constexpr):
    """Consumer `cid`: dk and dv of key blocks 2i + cid of every tile of this program, and columns
    [cid·D/2, cid·D/2 + D/2) of dq, summed over each segment of the program's list (`ProgramLists`) and stored
    at its end."""
    COLS: tl.constexpr = HEAD_DIM // 2
    HALF: tl.constexpr = BLOCK_M // 2
    DT: tl.constexpr = DK.dtype.element_ty
    list_start, n_listed = _program_rows(list_starts)
    offs_q = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_count = 0  # key blocks of this program's earlier tiles (the ring position of block 0 of this one)
    written = 0  # dSᵀ tiles this consumer has written (the phase of ds_free[cid])
    dq = tl.zeros([BLOCK_M, COLS], dtype=tl.float32)
    for r in range(0, n_listed):
        head, _, _, out_start, q_len, kv_start, kv_len, lo, full_lo, full_hi, hi = _tile(
            tiles, tl.load(lists + 2 * (list_start + r)), n_heads, q_offsets, out_offsets, kv_offsets, window, BLOCK_M,
            BLOCK_N, HAS_WINDOW, CAUSAL, False)
        row_ok = offs_q < q_len
        stat_at = (head * stat_h + out_start) % STAT_ALIGN + offs_q  # in the statistics boxes
        n_blocks = tl.cdiv(hi - lo, BLOCK_N)
        # D = rowsum(dO∘O) of this consumer's half of the rows (`row_delta`, as the D kernel), into delta_tile
        # for both; O's load goes out before the wait for dO. Rows past the sequence get 0 (masked below too).
        half_rows = cid * HALF + tl.arange(0, HALF)
        o = tl.load(Out + (tl.cast(out_start + half_rows, tl.int64) * so_t + tl.cast(head, tl.int64) * so_h)[:, None]
                    + offs_d[None, :], mask=(half_rows < q_len)[:, None], other=0.0)
        tlx.barrier_wait(q_full[0], r & 1)
        tlx.local_store(tlx.local_slice(delta_tile[0], [cid * HALF], [HALF]),
                        row_delta(tlx.local_load(tlx.local_slice(do_tile[0], [cid * HALF, 0], [HALF, HEAD_DIM])), o))
        tlx.named_barrier_wait(DELTA_READY, CONSUMER_THREADS)
        for i in range(0, tl.cdiv(n_blocks, 2)):
            j = 2 * i + cid
            if j < n_blocks:
                slot = (kv_count + j) % K_BUFFERS
                v_slot = (kv_count + j) % V_BUFFERS
                tlx.barrier_wait(k_full[slot], ((kv_count + j) // K_BUFFERS) & 1)
                # One product in flight at a time: beside dq's 64 registers a thread, two [64, 128] fp32 tiles
                # and the rows' statistics fill the 240; the other consumer's products fill the gaps.
                st = tlx.async_dot_wait(0, tlx.async_dot(k_tiles[slot], tlx.local_trans(q_tile[0])))  # Sᵀ
                # Foreign rows (past q_len) get -inf on every block, the rule only on blocks outside
                # [full_lo, full_hi) (keys past kv_len among them), as in the forward.
                s_raw = tl.where(row_ok[None, :], raw_scores(st, NEG_SCALE), float("-inf"))
                n = lo + j * BLOCK_N
                if (n < full_lo) | (n >= full_hi):
                    seen = visible(offs_q[None, :], (n + tl.arange(0, BLOCK_N))[:, None], q_len, kv_len, window,
                                   HAS_WINDOW, CAUSAL)
                    s_raw = tl.where(seen, s_raw, float("-inf"))
                m_b, inv_b = backward_row_stats(tlx.local_gather(m_tile[0], stat_at, 0),
                                                tlx.local_gather(l_tile[0], stat_at, 0))
                pt = shifted_exp2((s_raw - m_b[None, :]) * scale_log2) * inv_b[None, :]
                tlx.barrier_wait(v_full[v_slot], ((kv_count + j) // V_BUFFERS) & 1)
                dpt = tlx.async_dot_wait(0, tlx.async_dot(v_tiles[v_slot], tlx.local_trans(do_tile[0])))  # dPᵀ
                # D of rows past the sequence may never have been written: 0 there (0 · NaN would poison dk).
                delta = tl.where(row_ok, tlx.local_gather(delta_tile[0], offs_q, 0), 0.0)
                dst = (pt * (dpt - delta[None, :])).to(DT)
                pt = pt.to(DT)
                tlx.barrier_wait(ds_free[cid], (written & 1) ^ 1)  # the other consumer read the last one
                tlx.local_store(ds_tiles[cid], dst)
                tlx.fence("async_shared")
                written += 1
                dv = tlx.async_dot_wait(0, tlx.async_dot(pt, do_tile[0]))
                # dv and dk go to global memory through the block's V slot (dPᵀ has retired), stored there in bf16
                # in the product's layout (`_store_keys`)
                tlx.local_store(v_tiles[v_slot], dv.to(DT))
                _store_keys(desc_dv, DV, v_tiles[v_slot], kv_start, n, kv_len, head, sdv_t, sdv_h, HEAD_DIM, BLOCK_N)
                dk = tlx.async_dot_wait(0, tlx.async_dot(dst, q_tile[0]))
                tlx.async_descriptor_store_wait(0)  # dv's TMA store has read the slot
                tlx.local_store(v_tiles[v_slot], (dk * sm_scale).to(DT))
                _store_keys(desc_dk, DK, v_tiles[v_slot], kv_start, n, kv_len, head, sdk_t, sdk_h, HEAD_DIM, BLOCK_N)
                tlx.async_descriptor_store_wait(0)  # and dk's, before the producer's next load into the slot
                tlx.fence("async_shared")  # the producer's next TMA load into the slot comes after these accesses
                tlx.barrier_arrive(v_empty[v_slot], 1)
            tlx.named_barrier_wait(DS_READY, CONSUMER_THREADS)  # the pair's dSᵀ tiles are in shared memory
            first = (kv_count + 2 * i) % K_BUFFERS
            dq = tlx.async_dot(tlx.local_trans(ds_tiles[0]),
                               tlx.local_slice(k_tiles[first], [0, cid * COLS], [BLOCK_N, COLS]), dq)
            paired = 2 * i + 1 < n_blocks
            second = (kv_count + 2 * i + 1) % K_BUFFERS
            if paired:
                dq = tlx.async_dot(tlx.local_trans(ds_tiles[1]),
                                   tlx.local_slice(k_tiles[second], [0, cid * COLS], [BLOCK_N, COLS]), dq)
            dq = tlx.async_dot_wait(0, dq)
            tlx.barrier_arrive(k_empty[first], 1)
            if cid == 1:
                tlx.barrier_arrive(ds_free[0], 1)
            if paired:
                tlx.barrier_arrive(k_empty[second], 1)
                if cid == 0:
                    tlx.barrier_arrive(ds_free[1], 1)
        tlx.barrier_arrive(q_empty[0], 1)  # every product reading this tile's Q and dO has retired
        kv_count += n_blocks
        # Keys outside [lo, hi) (a window's) are seen by no row: exact zeros, consumer 0 below, 1 above.
        if cid == 0:
            _zero_keys(DK, DV, kv_start, head, 0, lo, sdk_t, sdk_h, sdv_t, sdv_h, DT, HEAD_DIM, BLOCK_N)
        else:
            _zero_keys(DK, DV, kv_start, head, hi, kv_len, sdk_t, sdk_h, sdv_t, sdv_h, DT, HEAD_DIM, BLOCK_N)
        dest = tl.load(lists + 2 * (list_start + r) + 1)
        if dest >= 0:  # the segment ends: its dq goes to sequence dest's rows
            _store_dq(dq * sm_scale, DQ, q_offsets, out_offsets, dest, head, row_ok, sdq_t, sdq_h, cid, DT, BLOCK_M,
                      COLS, DQ_PARTIAL)
            dq = tl.zeros([BLOCK_M, COLS], dtype=tl.float32)


@triton.jit
def _store_keys(desc, ptr, slot, kv_start, n, kv_len, head, s_t, s_h, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [n, n + BLOCK_N) of a sequence's dk or dv, in `slot` (the input dtype), to global memory: by a TMA
    store where the block lies within the sequence (the consumer goes on while it runs: with the stores from
    registers, the broadcast row's pass took 1.647 ms a call on an H100, 1.094 ms without any), else from
    registers with the keys past kv_len masked (a TMA box would write the next sequence's rows).

    A TMA store needs the slot's shared-memory layout to be its descriptor's. Rows of more than 128 bytes (D 128)
    have a 128-byte swizzle in both; at D 64 the slot's is 128-byte (wgmma's choice) and a [64, 64] box's is
    64-byte, so D 64 stores from registers."""
    ROW_BYTES: tl.constexpr = HEAD_DIM * ptr.dtype.element_ty.primitive_bitwidth // 8
    tlx.fence("async_shared")  # the slot's writes come before the TMA engine's reads
    if ROW_BYTES > 128:
        if n + BLOCK_N <= kv_len:
            tlx.async_descriptor_store(desc, slot, [kv_start + n, head * s_h])
        else:
            _store_key_rows(ptr, slot, kv_start, n, kv_len, head, s_t, s_h, HEAD_DIM, BLOCK_N)
    else:
        _store_key_rows(ptr, slot, kv_start, n, kv_len, head, s_t, s_h, HEAD_DIM, BLOCK_N)


@triton.jit
def _store_key_rows(ptr, slot, kv_start, n, kv_len, head, s_t, s_h, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_store_keys` from registers: `slot` read back in the store's layout (one pass where the store's own
    layout conversion of the fp32 product took four), keys past kv_len masked."""
    keys = n + tl.arange(0, BLOCK_N)
    rows = tl.cast(kv_start + keys, tl.int64) * s_t + tl.cast(head, tl.int64) * s_h
    tl.store(ptr + rows[:, None] + tl.arange(0, HEAD_DIM)[None, :], tlx.local_load(slot), mask=(keys < kv_len)[:, None])


@triton.jit
def _store_dq(dq, DQ, q_offsets, out_offsets, dest, head, row_ok, sdq_t, sdq_h, cid: tl.constexpr, DT: tl.constexpr,
              BLOCK_M: tl.constexpr, COLS: tl.constexpr, DQ_PARTIAL: tl.constexpr):
    """Consumer `cid`'s columns of a segment's dq (times the scale) at sequence dest's rows: the fp32 partial at
    its output rows when DQ_PARTIAL, else dq itself at its query rows.

    Stored in eight column parts: the store's layout conversion goes through shared memory, and a part's needs
    an eighth of the whole's (16 KB a consumer in fp32), which is what makes the K ring of 4 and the V ring of 3
    fit."""
    offs_q = tl.arange(0, BLOCK_M)
    if DQ_PARTIAL:
        dq_rows = tl.cast(tl.load(out_offsets + dest) + offs_q, tl.int64) * sdq_t + tl.cast(head, tl.int64) * sdq_h
        value = dq
    else:
        dq_rows = tl.cast(tl.load(q_offsets + dest) + offs_q, tl.int64) * sdq_t + tl.cast(head, tl.int64) * sdq_h
        value = dq.to(DT)
    P8: tl.constexpr = COLS // 8
    base = DQ + dq_rows[:, None] + (cid * COLS + tl.arange(0, P8))[None, :]
    # [i, j, a, b, c] holds column (4a + 2b + c)·P8 + j; each split takes the last bit off.
    parts = tl.permute(tl.reshape(value, [BLOCK_M, 2, 2, 2, P8]), [0, 4, 1, 2, 3])
    c0, c1 = tl.split(parts)
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    _store_column_parts(base, c0b0, 0, row_ok, P8)
    _store_column_parts(base, c1b0, P8, row_ok, P8)
    _store_column_parts(base, c0b1, 2 * P8, row_ok, P8)
    _store_column_parts(base, c1b1, 3 * P8, row_ok, P8)


@triton.jit
def _store_column_parts(base, pair, column, row_ok, P8: tl.constexpr):
    """The two parts of `pair` ([rows, P8, 2]: a = 0, 1) at columns `column` and `column` + 4·P8 of `base`."""
    a0, a1 = tl.split(pair)
    tl.store(base + column, a0, mask=row_ok[:, None])
    tl.store(base + column + 4 * P8, a1, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_heads", "window", "stat_h", "q_rows", "out_rows", "kv_rows"])
def short_ws_kernel(
    desc_q, desc_do, desc_k, desc_v, desc_m, desc_l, Out, DQ, DK, DV, desc_dk, desc_dv,
    tiles, lists, list_starts, q_offsets, out_offsets, kv_offsets,
    sq_h, sdo_h, so_t, so_h, sk_h, sv_h, sdq_t, sdq_h, sdk_t, sdk_h, sdv_t, sdv_h, stat_h, q_rows, out_rows, kv_rows,
    scale_log2, sm_scale, window, n_heads,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_BUFFERS: tl.constexpr,
    V_BUFFERS: tl.constexpr, NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    DQ_PARTIAL: tl.constexpr,
):
    """Persistent warp-specialised short-query backward over the tiles of `tiles` (int32 [n_entries, 2]:
    sequence, 0; heads adjacent), program p taking those of rows [list_starts[p], list_starts[p + 1]) of
    `lists` (`jfa.tile_scheduler.ProgramLists`): dq (the fp32 partial at the output rows when DQ_PARTIAL) of
    each segment, dk and dv."""
    DT: tl.constexpr = tlx.dtype_of(desc_q)
    q_tile = tlx.local_alloc((BLOCK_M, HEAD_DIM), DT, 1)
    do_tile = tlx.local_alloc((BLOCK_M, HEAD_DIM), DT, 1)
    m_tile = tlx.local_alloc((2 * BLOCK_M,), tl.float32, 1)  # the rows at offset < STAT_ALIGN
    l_tile = tlx.local_alloc((2 * BLOCK_M,), tl.float32, 1)
    delta_tile = tlx.local_alloc((BLOCK_M,), tl.float32, 1)
    k_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), DT, K_BUFFERS)
    v_tiles = tlx.local_alloc((BLOCK_N, HEAD_DIM), DT, V_BUFFERS)
    ds_tiles = tlx.local_alloc((BLOCK_N, BLOCK_M), DT, 2)  # consumer c's dSᵀ of the current pair in slot c
    q_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)
    q_empty = tlx.alloc_barriers(num_barriers=1, arrive_count=2)
    k_full = tlx.alloc_barriers(num_barriers=K_BUFFERS, arrive_count=1)
    k_empty = tlx.alloc_barriers(num_barriers=K_BUFFERS, arrive_count=2)
    v_full = tlx.alloc_barriers(num_barriers=V_BUFFERS, arrive_count=1)
    v_empty = tlx.alloc_barriers(num_barriers=V_BUFFERS, arrive_count=1)
    ds_free = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    with tlx.async_tasks():
        with tlx.async_task("default"):
            _load_short(desc_q, desc_do, desc_k, desc_v, desc_m, desc_l, q_tile, do_tile, k_tiles,
                        v_tiles, m_tile, l_tile, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                        tiles, lists, list_starts, q_offsets, out_offsets, kv_offsets, sq_h, sdo_h, sk_h, sv_h, stat_h,
                        q_rows, out_rows, kv_rows, window, n_heads, HEAD_DIM, BLOCK_M, BLOCK_N, K_BUFFERS, V_BUFFERS,
                        HAS_WINDOW, CAUSAL)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGISTERS, replicate=2):
            _short_tiles(q_tile, do_tile, k_tiles, v_tiles, m_tile, l_tile, delta_tile, q_full, q_empty, k_full,
                         k_empty, v_full, v_empty, ds_tiles, ds_free, Out, so_t, so_h, DQ, DK, DV, desc_dk, desc_dv,
                         tiles, lists, list_starts, q_offsets, out_offsets, kv_offsets, sdq_t, sdq_h, sdk_t, sdk_h,
                         sdv_t, sdv_h, stat_h, scale_log2, sm_scale, window, n_heads, tlx.async_task_replica_id(),
                         HEAD_DIM, BLOCK_M, BLOCK_N, K_BUFFERS, V_BUFFERS, NEG_SCALE, HAS_WINDOW, CAUSAL, DQ_PARTIAL)
