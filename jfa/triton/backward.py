"""Triton backward kernels. The backward is deterministic always: no atomics touch a gradient, so
`deterministic=True` changes nothing (every gradient is bitwise reproducible either way).

Ordinary sequences take two passes over the same tile tables as the forward (`jfa.tile_scheduler`):
1. `_dq_kernel`, tile = (sequence, query block, query head): D = rowsum(dO∘O) from the rounded output
   (stored for pass 2 with the rows' (m_safe, 2^-24/l) of `jfa.softmax.backward_row_stats`), then for every
   visited key block S = Q·Kᵀ, P = exp2((S - m)·c)/l recomputed from the forward's residuals m and l
   (subnormal P kept, `jfa.softmax.shifted_exp2`), dP = dO·Vᵀ, dS = P∘(dP - D) rounded to the input dtype,
   dq += dS·K; dq is written once.
2. `_dkv_kernel`, tile = (sequence, key block, key/value head): for every query head of the group and every
   query block that sees the key block (`jfa.block_info.q_block_range`), Sᵀ = K·Qᵀ, Pᵀ, dv += Pᵀ·dO
   (P rounded), dPᵀ = V·dOᵀ, dSᵀ, dk += dSᵀ·Q (dS rounded); dk and dv are written once, so keys no query
   sees get exactly 0. It reads pass 1's records (`jfa.softmax.pack_row_stats`: m_safe, 2^-24/l and D of a
   row in 16 bytes) instead of deriving the statistics from m and l and loading D beside them: the derivation
   (a full-range division and two selects per row) and three 4-byte loads per row ran once per (query block,
   key block) pair; without them the unmasked block loop compiles to 296 instructions per iteration instead
   of 480 (sm_90, D 128, triton 3.6), the same bits.
The separate dQ pass recomputes S and dP (7 matrix products per block pair instead of FlashAttention-2's
5 plus atomics) and buys bitwise reproducibility and batch invariance of every gradient.

Short-query tiles (`_bwd_short_kernel`; sequences with at most BLOCK_M query rows and no GQA, see
`jfa.tile_scheduler`) hold all of a sequence's queries, so one program per (sequence, head) does its whole
backward in one pass over the key blocks: 5 products per block, dk and dv of each key block stored as
they complete, dq accumulated in registers. Broadcast-Q batches (one shared query sequence, typically
short) and decode-like short queries over long keys go this way instead of paying a dK/dV tile per key
block that meets only a handful of query blocks.

Packed tiles (tiny sequences) hold whole sequences, so `_bwd_packed_kernel` does the whole backward of a
tile in one program: dq per head, dk and dv summed over the group's heads.

broadcast_q: dq of the shared query sequence is the sum over the B sequences. Each sequence's dq is
written as an fp32 partial at its output rows ([out_rows, Hq, D] fp32, i.e. O(T·H·D) extra memory), and
`_dq_reduce_kernel` adds the partials in sequence order, or (a short-query pass that sums its sequences' dq
per program: the tlx backend's) those it lists per head in its order (deterministic either way), and rounds once.

A dK/dV pass that also produces dq (the tlx backend's, given `dq_in_dkv` in `jfa.triton.backend.backward`)
needs D before any dq pass: `_delta_kernel` computes it for every output row, as the dQ kernel does. Where
another backend's dQ pass stores D (`dq_pass`) and `_dkv_kernel` follows, `_row_stats_kernel` packs its
records from the residuals and that D.
"""

from __future__ import annotations

import triton
import triton.language as tl

from jfa.block_info import MASK_NEVER, block_masked, kv_block_range, over_blocks, q_block_range
from jfa.mask import visible
from jfa.softmax import (
    ROW_RECORD,
    backward_row_stats,
    pack_row_stats,
    raw_scores,
    row_delta,
    shifted_exp2,
    unpack_row_stats,
)
from jfa.triton.forward import (
    head_dim_lanes,
    kernel,
    load_tile,
    mma,
    mma_acc,
    next_tile,
    packed_layout,
    packed_rows,
    packed_visible,
    prefetch_rows,
    query_tile,
    rounded,
    row_base,
    sequence_bounds,
    stored,
    tile_entry,
    tile_offsets,
)

# ---------------------------------------------------------------------------------------------------------
# Pass 1: dQ (and D) over query tiles.


@triton.jit
def _probs_and_ds(q, do, k, v, m_b, inv_b, delta, offs_m, cols, masked, q_len, kv_len, window, scale_log2,
                  NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, INTERPRET: tl.constexpr):
    """P and dS = P∘(dP - D) [BLOCK_M, BLOCK_N] of query rows offs_m against keys `cols` (fp32, unrounded),
    P recomputed from the forward's residuals; `masked` (a scalar) applies the visibility rule. Rows past
    q_len load zero residuals (inv_b = 0), so their P and dS are 0."""
    r = raw_scores(mma(q, tl.trans(k), INTERPRET), NEG_SCALE)
    if masked:
        seen = visible(offs_m[:, None], cols[None, :], q_len, kv_len, window, HAS_WINDOW, CAUSAL)
        r = tl.where(seen, r, float("-inf"))
    p = shifted_exp2((r - m_b[:, None]) * scale_log2) * inv_b[:, None]
    dp = mma(do, tl.trans(v), INTERPRET)
    return p, p * (dp - delta[:, None])


@triton.jit
def _query_rows(Q, DOut, Out, RowMax, RowSum, q_start, out_start, m0, head, offs_r, offs_m, row_ok, offs_d, offs_dv,
                d_ok, dv_ok, sq_t, sq_h, sq_d, sdo_t, sdo_h, sdo_d, so_t, so_h, stat_h, MASK_D: tl.constexpr,
                MASK_DV: tl.constexpr):
    """What the backward needs of query rows offs_m = m0 + offs_r of a sequence and head: Q, dO,
    D = rowsum(dO∘O) from the rounded output, the rows' statistics index, and (m_safe, 2^-24/l) for
    recomputing P. Rows outside row_ok read as 0 (their statistics too, so their P is 0)."""
    q = load_tile(row_base(Q, q_start + m0, sq_t, head, sq_h) + tile_offsets(offs_r, sq_t, offs_d, sq_d),
                  row_ok, d_ok, True, MASK_D)
    do = load_tile(row_base(DOut, out_start + m0, sdo_t, head, sdo_h)
                   + tile_offsets(offs_r, sdo_t, offs_dv, sdo_d), row_ok, dv_ok, True, MASK_DV)
    o = load_tile(row_base(Out, out_start + m0, so_t, head, so_h) + tile_offsets(offs_r, so_t, offs_dv, 1),
                  row_ok, dv_ok, True, MASK_DV)
    delta = row_delta(do, o)
    stat = tl.cast(head, tl.int64) * stat_h + out_start + offs_m
    m_b, inv_b = backward_row_stats(tl.load(RowMax + stat, mask=row_ok, other=0.0),
                                    tl.load(RowSum + stat, mask=row_ok, other=0.0))
    return q, do, delta, stat, m_b, inv_b


@triton.jit
def _dq_blocks(dq, start, end, full_lo, full_hi, q, do, m_b, inv_b, delta, k_seq, v_seq, offs_m, offs_n, offs_d,
               offs_dv, d_ok, dv_ok, sk_t, sk_d, sv_t, sv_d, q_len, kv_len, window, scale_log2,
               DT: tl.constexpr, BLOCK_N: tl.constexpr, MASK_D: tl.constexpr, MASK_DV: tl.constexpr,
               NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, INTERPRET: tl.constexpr,
               MASK: tl.constexpr):
    """Key blocks [start, end) of one query block, masked as MASK says (see `_fwd_blocks`)."""
    for n in range(start, end, BLOCK_N):
        key_ok = (n + offs_n) < kv_len
        k = load_tile(k_seq + tl.cast(n, tl.int64) * sk_t + tile_offsets(offs_n, sk_t, offs_d, sk_d),
                      key_ok, d_ok, MASK != MASK_NEVER, MASK_D)
        v = load_tile(v_seq + tl.cast(n, tl.int64) * sv_t + tile_offsets(offs_n, sv_t, offs_dv, sv_d),
                      key_ok, dv_ok, MASK != MASK_NEVER, MASK_DV)
        _, ds = _probs_and_ds(q, do, k, v, m_b, inv_b, delta, offs_m, n + offs_n,
                              block_masked(n, full_lo, full_hi, MASK), q_len, kv_len, window, scale_log2, NEG_SCALE,
                              HAS_WINDOW, CAUSAL, INTERPRET)
        dq = mma_acc(rounded(ds, DT, INTERPRET), k, dq, INTERPRET)
    return (dq,)


@kernel
def _dq_kernel(
    Q, K, V, Out, DOut, DQ, RowMax, RowSum, Delta,
    tiles, n_tiles, counter,
    q_offsets, out_offsets, kv_offsets,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, sdo_t, sdo_h, sdo_d, sdq_t, sdq_h, stat_h,
    scale_log2, sm_scale, window, n_heads, group, profile,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, DQ_PARTIAL: tl.constexpr,
    ROW_STATS: tl.constexpr, SCHEDULE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dq (or its fp32 per-sequence partial with broadcast_q) over ordinary query tiles; for their rows, at
    Delta, either the records of `jfa.softmax.pack_row_stats` ([Hq, rows, ROW_RECORD] fp32; ROW_STATS, for
    `_dkv_kernel`) or D alone ([Hq, rows], for a dK/dV pass of another backend)."""
    DT: tl.constexpr = Q.dtype.element_ty
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    MASK_DV: tl.constexpr = HEAD_DIM_V != BLOCK_DV
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_d, offs_dv, d_ok, dv_ok = head_dim_lanes(HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_M)

    t = pid
    r = pid * 0
    while t < n_tiles:
        t_next = next_tile(r, pid, nprog, n_tiles, counter, SCHEDULE)
        head, kv_head, m0, q_start, out_start, q_len, kv_start, kv_len, lo, full_lo, full_hi, hi = query_tile(
            tiles, t, n_heads, group, q_offsets, out_offsets, kv_offsets, window, BLOCK_M, BLOCK_N, HAS_WINDOW, CAUSAL)

        offs_m = m0 + offs_r
        row_ok = offs_m < q_len
        q, do, delta, stat, m_b, inv_b = _query_rows(
            Q, DOut, Out, RowMax, RowSum, q_start, out_start, m0, head, offs_r, offs_m, row_ok, offs_d, offs_dv, d_ok,
            dv_ok, sq_t, sq_h, sq_d, sdo_t, sdo_h, sdo_d, so_t, so_h, stat_h, MASK_D, MASK_DV)
        if ROW_STATS:
            tl.store(Delta + stat[:, None] * ROW_RECORD + tl.arange(0, ROW_RECORD)[None, :],
                     pack_row_stats(m_b, inv_b, delta), mask=row_ok[:, None])
        else:
            tl.store(Delta + stat, delta, mask=row_ok)

        k_seq = row_base(K, kv_start, sk_t, kv_head, sk_h)
        v_seq = row_base(V, kv_start, sv_t, kv_head, sv_h)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq = over_blocks(
            _dq_blocks, (dq,),
            (q, do, m_b, inv_b, delta, k_seq, v_seq, offs_m, offs_n, offs_d, offs_dv, d_ok, dv_ok, sk_t, sk_d, sv_t,
             sv_d, q_len, kv_len, window, scale_log2, DT, BLOCK_N, MASK_D, MASK_DV, NEG_SCALE, HAS_WINDOW, CAUSAL,
             INTERPRET),
            lo, full_lo, full_hi, hi, CAUSAL or HAS_WINDOW)[0]
        dq = dq * sm_scale
        mask = row_ok[:, None] & d_ok[None, :]
        if DQ_PARTIAL:
            tl.store(row_base(DQ, out_start + m0, sdq_t, head, sdq_h) + tile_offsets(offs_r, sdq_t, offs_d, 1),
                     dq, mask=mask)
        else:
            tl.store(row_base(DQ, q_start + m0, sdq_t, head, sdq_h) + tile_offsets(offs_r, sdq_t, offs_d, 1),
                     stored(dq, DT, INTERPRET), mask=mask)
        t = t_next
        r += 1


# ---------------------------------------------------------------------------------------------------------
# Pass 2: dK, dV over key tiles.


@triton.jit
def _dkv_blocks(dk, dv, start, end, full_lo, full_hi, k, v, q_seq, do_seq, RowStats, stat_base,
                offs_r, offs_n, offs_d, offs_dv, d_ok, dv_ok, sq_t, sq_d, sdo_t, sdo_d, q_len, kv_len, window,
                scale_log2, DT: tl.constexpr, BLOCK_M: tl.constexpr, MASK_D: tl.constexpr, MASK_DV: tl.constexpr,
                NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, INTERPRET: tl.constexpr,
                MASK: tl.constexpr):
    """Query blocks [start, end) against one key block; masked blocks (MASK, see `_fwd_blocks`) apply the rule
    and mask rows >= q_len. Only scalar base pointers live across iterations."""
    ROW_MASK: tl.constexpr = MASK != MASK_NEVER
    for m in range(start, end, BLOCK_M):
        offs_m = m + offs_r
        row_ok = offs_m < q_len
        q = load_tile(q_seq + tl.cast(m, tl.int64) * sq_t + tile_offsets(offs_r, sq_t, offs_d, sq_d),
                      row_ok, d_ok, ROW_MASK, MASK_D)
        do = load_tile(do_seq + tl.cast(m, tl.int64) * sdo_t + tile_offsets(offs_r, sdo_t, offs_dv, sdo_d),
                       row_ok, dv_ok, ROW_MASK, MASK_DV)
        records = RowStats + (stat_base + offs_m)[:, None] * ROW_RECORD + tl.arange(0, ROW_RECORD)[None, :]
        if ROW_MASK:  # noqa: SIM108 - rows past the sequence read (0, 0, 0): their P and dS are 0
            rec = tl.load(records, mask=row_ok[:, None], other=0.0)
        else:
            rec = tl.load(records)
        m_b, inv_b, delta = unpack_row_stats(rec, BLOCK_M)
        r = raw_scores(mma(k, tl.trans(q), INTERPRET), NEG_SCALE)  # Sᵀ: [BLOCK_N, BLOCK_M]
        if block_masked(m, full_lo, full_hi, MASK):
            seen = visible(offs_m[None, :], offs_n[:, None], q_len, kv_len, window, HAS_WINDOW, CAUSAL)
            r = tl.where(seen & row_ok[None, :], r, float("-inf"))
        p = shifted_exp2((r - m_b[None, :]) * scale_log2) * inv_b[None, :]
        dv = mma_acc(rounded(p, DT, INTERPRET), do, dv, INTERPRET)
        dp = mma(v, tl.trans(do), INTERPRET)
        ds = p * (dp - delta[None, :])
        dk = mma_acc(rounded(ds, DT, INTERPRET), q, dk, INTERPRET)
    return dk, dv


@kernel
def _dkv_kernel(
    Q, K, V, DOut, DK, DV, RowStats,
    tiles, n_tiles, counter,
    q_offsets, out_offsets, kv_offsets,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, sdo_t, sdo_h, sdo_d, sdk_t, sdk_h, sdv_t, sdv_h, stat_h,
    scale_log2, sm_scale, window, n_kv_heads, group, profile,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    SCHEDULE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dk, dv over ordinary key tiles (sequence, key block, key/value head), summed over the group, from the
    records (m_safe, 2^-24/l, D; `jfa.softmax.pack_row_stats`) `_dq_kernel` stored for their query rows."""
    DT: tl.constexpr = Q.dtype.element_ty
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    MASK_DV: tl.constexpr = HEAD_DIM_V != BLOCK_DV
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_d, offs_dv, d_ok, dv_ok = head_dim_lanes(HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_N)

    t = pid
    r = pid * 0
    while t < n_tiles:
        t_next = next_tile(r, pid, nprog, n_tiles, counter, SCHEDULE)
        seq, n0, kv_head = tile_entry(tiles, t, n_kv_heads)
        q_start, out_start, q_len, kv_start, kv_len = sequence_bounds(q_offsets, out_offsets, kv_offsets, seq)
        n1 = tl.minimum(n0 + BLOCK_N, kv_len)
        lo, full_lo, full_hi, hi = q_block_range(n0, n1, q_len, kv_len, window, BLOCK_M, HAS_WINDOW, CAUSAL)
        # A key block running past the sequence's end takes the masked path throughout: unmasked, its
        # zero-filled key rows would score 0 and overflow exp2 against a very negative row max (harmless
        # in rows that are never stored, but inf and NaN have no business in the accumulators).
        partial_keys = n0 + BLOCK_N > kv_len
        full_lo = tl.where(partial_keys, hi, full_lo)
        full_hi = tl.where(partial_keys, hi, full_hi)

        offs_n = n0 + offs_c
        key_ok = offs_n < kv_len
        k = load_tile(row_base(K, kv_start + n0, sk_t, kv_head, sk_h) + tile_offsets(offs_c, sk_t, offs_d, sk_d),
                      key_ok, d_ok, True, MASK_D)
        v = load_tile(row_base(V, kv_start + n0, sv_t, kv_head, sv_h) + tile_offsets(offs_c, sv_t, offs_dv, sv_d),
                      key_ok, dv_ok, True, MASK_DV)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        for hh in range(group):
            head = kv_head * group + hh
            q_seq = row_base(Q, q_start, sq_t, head, sq_h)
            do_seq = row_base(DOut, out_start, sdo_t, head, sdo_h)
            stat_base = tl.cast(head, tl.int64) * stat_h + out_start
            dk, dv = over_blocks(
                _dkv_blocks, (dk, dv),
                (k, v, q_seq, do_seq, RowStats, stat_base, offs_r, offs_n, offs_d, offs_dv, d_ok, dv_ok,
                 sq_t, sq_d, sdo_t, sdo_d, q_len, kv_len, window, scale_log2, DT, BLOCK_M, MASK_D, MASK_DV, NEG_SCALE,
                 HAS_WINDOW, CAUSAL, INTERPRET),
                lo, full_lo, full_hi, hi, CAUSAL or HAS_WINDOW)
        dk = dk * sm_scale
        tl.store(row_base(DK, kv_start + n0, sdk_t, kv_head, sdk_h) + tile_offsets(offs_c, sdk_t, offs_d, 1),
                 stored(dk, DT, INTERPRET), mask=key_ok[:, None] & d_ok[None, :])
        tl.store(row_base(DV, kv_start + n0, sdv_t, kv_head, sdv_h) + tile_offsets(offs_c, sdv_t, offs_dv, 1),
                 stored(dv, DT, INTERPRET), mask=key_ok[:, None] & dv_ok[None, :])
        t = t_next
        r += 1


# ---------------------------------------------------------------------------------------------------------
# Short-query tiles: the whole backward of a (sequence, head) in one pass over the keys.


@triton.jit
def _short_blocks(dq, start, end, full_lo, full_hi, q, do, m_b, inv_b, delta, k_seq, v_seq, dk_seq, dv_seq, offs_m,
                  offs_n, offs_d, offs_dv, d_ok, dv_ok, sk_t, sk_d, sv_t, sv_d, sdk_t, sdv_t, q_len, kv_len, window,
                  scale_log2, sm_scale,
                  DT: tl.constexpr, BLOCK_N: tl.constexpr, MASK_D: tl.constexpr, MASK_DV: tl.constexpr,
                  NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, INTERPRET: tl.constexpr,
                  MASK: tl.constexpr):
    """Key blocks [start, end) against every query row of the sequence, masked as MASK says (see
    `_fwd_blocks`): each block's dk = dSᵀ·Q and dv = Pᵀ·dO are complete and stored; dq += dS·K accumulates."""
    for n in range(start, end, BLOCK_N):
        key_ok = (n + offs_n) < kv_len
        k = load_tile(k_seq + tl.cast(n, tl.int64) * sk_t + tile_offsets(offs_n, sk_t, offs_d, sk_d),
                      key_ok, d_ok, MASK != MASK_NEVER, MASK_D)
        v = load_tile(v_seq + tl.cast(n, tl.int64) * sv_t + tile_offsets(offs_n, sv_t, offs_dv, sv_d),
                      key_ok, dv_ok, MASK != MASK_NEVER, MASK_DV)
        p, ds = _probs_and_ds(q, do, k, v, m_b, inv_b, delta, offs_m, n + offs_n,
                              block_masked(n, full_lo, full_hi, MASK), q_len, kv_len, window, scale_log2, NEG_SCALE,
                              HAS_WINDOW, CAUSAL, INTERPRET)
        ds = rounded(ds, DT, INTERPRET)
        dq = mma_acc(ds, k, dq, INTERPRET)
        dv = mma(tl.trans(rounded(p, DT, INTERPRET)), do, INTERPRET)
        dk = mma(tl.trans(ds), q, INTERPRET) * sm_scale
        _store_key_block(dk_seq, dv_seq, n, dk, dv, key_ok, offs_n, offs_d, offs_dv, d_ok, dv_ok, sdk_t, sdv_t, DT,
                         INTERPRET)
    return (dq,)


@triton.jit
def _store_key_block(dk_seq, dv_seq, n, dk, dv, key_ok, offs_n, offs_d, offs_dv, d_ok, dv_ok, sdk_t, sdv_t,
                     DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 dk and dv of the key block starting at n, stored in the output dtype; keys outside key_ok are
    not written."""
    tl.store(dk_seq + tl.cast(n, tl.int64) * sdk_t + tile_offsets(offs_n, sdk_t, offs_d, 1),
             stored(dk, DT, INTERPRET), mask=key_ok[:, None] & d_ok[None, :])
    tl.store(dv_seq + tl.cast(n, tl.int64) * sdv_t + tile_offsets(offs_n, sdv_t, offs_dv, 1),
             stored(dv, DT, INTERPRET), mask=key_ok[:, None] & dv_ok[None, :])


@triton.jit
def _zero_key_blocks(dk_seq, dv_seq, start, end, kv_len, offs_n, offs_d, offs_dv, d_ok, dv_ok, sdk_t, sdv_t,
                     DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """dk = dv = 0 for the keys of blocks [start, end) (keys no query sees)."""
    for n in range(start, end, BLOCK_N):
        _store_key_block(dk_seq, dv_seq, n, tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32),
                         tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32), (n + offs_n) < kv_len, offs_n, offs_d,
                         offs_dv, d_ok, dv_ok, sdk_t, sdv_t, DT, INTERPRET)


@kernel
def _bwd_short_kernel(
    Q, K, V, Out, DOut, DQ, DK, DV, RowMax, RowSum,
    tiles, n_tiles, counter,
    q_offsets, out_offsets, kv_offsets,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, sdo_t, sdo_h, sdo_d,
    sdq_t, sdq_h, sdk_t, sdk_h, sdv_t, sdv_h, stat_h,
    scale_log2, sm_scale, window, n_heads, group, profile,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, DQ_PARTIAL: tl.constexpr,
    SCHEDULE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dq (or its fp32 partial with broadcast_q), dk and dv of short-query tiles (sequence, head): all of the
    sequence's q_len <= BLOCK_M query rows at once against every key block in turn (5 matrix products per
    block, no second pass). The scheduler sends only sequences whose key/value head serves one query head
    (group == 1), so each key block's dk and dv are written once, by this tile; keys outside the visited
    blocks get exact zeros."""
    DT: tl.constexpr = Q.dtype.element_ty
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    MASK_DV: tl.constexpr = HEAD_DIM_V != BLOCK_DV
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_d, offs_dv, d_ok, dv_ok = head_dim_lanes(HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)

    t = pid
    r = pid * 0
    while t < n_tiles:
        t_next = next_tile(r, pid, nprog, n_tiles, counter, SCHEDULE)
        entry = t // n_heads
        head = t - entry * n_heads
        kv_head = head // group
        seq = tl.load(tiles + 2 * entry)
        q_start, out_start, q_len, kv_start, kv_len = sequence_bounds(q_offsets, out_offsets, kv_offsets, seq)
        lo, full_lo, full_hi, hi = kv_block_range(q_len * 0, q_len, q_len, kv_len, window, BLOCK_N, HAS_WINDOW,
                                                  CAUSAL)

        row_ok = offs_m < q_len
        q, do, delta, _, m_b, inv_b = _query_rows(
            Q, DOut, Out, RowMax, RowSum, q_start, out_start, 0, head, offs_m, offs_m, row_ok, offs_d, offs_dv, d_ok,
            dv_ok, sq_t, sq_h, sq_d, sdo_t, sdo_h, sdo_d, so_t, so_h, stat_h, MASK_D, MASK_DV)

        k_seq = row_base(K, kv_start, sk_t, kv_head, sk_h)
        v_seq = row_base(V, kv_start, sv_t, kv_head, sv_h)
        dk_seq = row_base(DK, kv_start, sdk_t, kv_head, sdk_h)
        dv_seq = row_base(DV, kv_start, sdv_t, kv_head, sdv_h)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq = over_blocks(
            _short_blocks, (dq,),
            (q, do, m_b, inv_b, delta, k_seq, v_seq, dk_seq, dv_seq, offs_m, offs_n, offs_d, offs_dv, d_ok, dv_ok, sk_t,
             sk_d, sv_t, sv_d, sdk_t, sdv_t, q_len, kv_len, window, scale_log2, sm_scale, DT, BLOCK_N, MASK_D,
             MASK_DV, NEG_SCALE, HAS_WINDOW, CAUSAL, INTERPRET),
            lo, full_lo, full_hi, hi, CAUSAL or HAS_WINDOW)[0]
        _zero_key_blocks(dk_seq, dv_seq, 0, lo, kv_len, offs_n, offs_d, offs_dv, d_ok, dv_ok, sdk_t, sdv_t, DT,
                         BLOCK_N, BLOCK_D, BLOCK_DV, INTERPRET)
        _zero_key_blocks(dk_seq, dv_seq, hi, kv_len, kv_len, offs_n, offs_d, offs_dv, d_ok, dv_ok, sdk_t, sdv_t, DT,
                         BLOCK_N, BLOCK_D, BLOCK_DV, INTERPRET)
        dq = dq * sm_scale
        mask = row_ok[:, None] & d_ok[None, :]
        if DQ_PARTIAL:
            tl.store(row_base(DQ, out_start, sdq_t, head, sdq_h) + tile_offsets(offs_m, sdq_t, offs_d, 1), dq,
                     mask=mask)
        else:
            tl.store(row_base(DQ, q_start, sdq_t, head, sdq_h) + tile_offsets(offs_m, sdq_t, offs_d, 1),
                     stored(dq, DT, INTERPRET), mask=mask)
        t = t_next
        r += 1


# ---------------------------------------------------------------------------------------------------------
# Packed tiles: the whole backward in one program.


@kernel
def _bwd_packed_kernel(
    Q, K, V, Out, DOut, DQ, DK, DV, RowMax, RowSum,
    pack_seqs, pack_shift, n_tiles, counter,
    q_offsets, out_offsets, kv_offsets,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, sdo_t, sdo_h, sdo_d,
    sdq_t, sdq_h, sdk_t, sdk_h, sdv_t, sdv_h, stat_h,
    scale_log2, sm_scale, window, n_heads, group, profile,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, SLOTS: tl.constexpr,
    NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, DQ_PARTIAL: tl.constexpr,
    SCHEDULE: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dq, dk, dv of packed tiles (a group of tiny sequences), every query head in turn (a pipelined
    loop); dk and dv add up over the consecutive query heads of a group and are written after its last.
    With PREFETCH each head first asks L2 for the next head's q, dO and O rows, as the packed forward does
    (`jfa.triton.forward._fwd_packed_kernel` says why): the tiny row's backward kernel 2.215 → 2.151 ms on the
    H200 under stock triton, where the same for k and v (the next kv head's) gained nothing and all five
    together lost (docs/performance-log.md)."""
    DT: tl.constexpr = Q.dtype.element_ty
    MASK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    MASK_DV: tl.constexpr = HEAD_DIM_V != BLOCK_DV
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_d, offs_dv, d_ok, dv_ok = head_dim_lanes(HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)

    t = pid
    r = pid * 0
    while t < n_tiles:
        t_next = next_tile(r, pid, nprog, n_tiles, counter, SCHEDULE)
        slot, loc, q_start, out_start, q_len, kv_start, kv_len, row_ok, key_ok = packed_layout(
            pack_seqs, pack_shift, t, q_offsets, out_offsets, kv_offsets, BLOCK, SLOTS, False)
        seen = packed_visible(slot, loc, q_len, kv_len, row_ok, key_ok, window, HAS_WINDOW, CAUSAL, False)
        dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
        for head in range(n_heads):
            kv_head = head // group
            if PREFETCH:
                ahead = row_ok & (head + 1 < n_heads)
                prefetch_rows(Q, q_start + loc, sq_t, head + 1, sq_h, sq_d, ahead, HEAD_DIM, BLOCK_D, INTERPRET)
                prefetch_rows(DOut, out_start + loc, sdo_t, head + 1, sdo_h, sdo_d, ahead, HEAD_DIM_V, BLOCK_DV,
                              INTERPRET)
                prefetch_rows(Out, out_start + loc, so_t, head + 1, so_h, 1, ahead, HEAD_DIM_V, BLOCK_DV, INTERPRET)
            k = packed_rows(K, kv_start + loc, sk_t, kv_head, sk_h, offs_d * sk_d, key_ok, d_ok, MASK_D)
            v = packed_rows(V, kv_start + loc, sv_t, kv_head, sv_h, offs_dv * sv_d, key_ok, dv_ok, MASK_DV)
            q = packed_rows(Q, q_start + loc, sq_t, head, sq_h, offs_d * sq_d, row_ok, d_ok, MASK_D)
            do = packed_rows(DOut, out_start + loc, sdo_t, head, sdo_h, offs_dv * sdo_d, row_ok, dv_ok, MASK_DV)
            o = packed_rows(Out, out_start + loc, so_t, head, so_h, offs_dv, row_ok, dv_ok, MASK_DV)
            delta = row_delta(do, o)
            stat = tl.cast(head, tl.int64) * stat_h + out_start + loc
            m_b, inv_b = backward_row_stats(tl.load(RowMax + stat, mask=row_ok, other=0.0),
                                            tl.load(RowSum + stat, mask=row_ok, other=0.0))
            s = raw_scores(mma(q, tl.trans(k), INTERPRET), NEG_SCALE)
            s = tl.where(seen, s, float("-inf"))
            p = shifted_exp2((s - m_b[:, None]) * scale_log2) * inv_b[:, None]
            dp = mma(do, tl.trans(v), INTERPRET)
            ds = rounded(p * (dp - delta[:, None]), DT, INTERPRET)
            dq = mma(ds, k, INTERPRET) * sm_scale
            mask = row_ok[:, None] & d_ok[None, :]
            if DQ_PARTIAL:
                tl.store(row_base(DQ, out_start + loc, sdq_t, head, sdq_h)[:, None] + offs_d[None, :], dq,
                         mask=mask)
            else:
                tl.store(row_base(DQ, q_start + loc, sdq_t, head, sdq_h)[:, None] + offs_d[None, :],
                         stored(dq, DT, INTERPRET), mask=mask)
            dv = mma_acc(tl.trans(rounded(p, DT, INTERPRET)), do, dv, INTERPRET)
            dk = mma_acc(tl.trans(ds), q, dk, INTERPRET)
            # After the group's last query head: write this key/value head's dk, dv and start over.
            last = (loc * 0 + head % group) == group - 1  # a vector: the interpreter rejects scalar masks
            tl.store(row_base(DK, kv_start + loc, sdk_t, kv_head, sdk_h)[:, None] + offs_d[None, :],
                     stored(dk * sm_scale, DT, INTERPRET), mask=(key_ok & last)[:, None] & d_ok[None, :])
            tl.store(row_base(DV, kv_start + loc, sdv_t, kv_head, sdv_h)[:, None] + offs_dv[None, :],
                     stored(dv, DT, INTERPRET), mask=(key_ok & last)[:, None] & dv_ok[None, :])
            dk = tl.where(last[:, None], 0.0, dk)
            dv = tl.where(last[:, None], 0.0, dv)
        t = t_next
        r += 1


# ---------------------------------------------------------------------------------------------------------
# broadcast_q: the deterministic sum of per-sequence dq partials.


@kernel
def _dq_reduce_kernel(Part, DQ, Sources, n_parts, n_elem, n_heads, head_dim, BLOCK: tl.constexpr,
                      UNROLL: tl.constexpr, WIDE_ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    """DQ[e] = sum over j < n_parts (in order) of Part[b·n_elem + e], b = j without Sources, else the head's
    Sources[h, j] (int32 [n_heads, n_parts], -1: none; DQ is [rows, n_heads, head_dim]); UNROLL loads in
    flight per step."""
    DT: tl.constexpr = DQ.dtype.element_ty
    # The block's first element in int64 (dq may pass 2^31 elements: offset_overflow), the rest int32 from it.
    # Its column in a row of n_heads·head_dim elements comes from the program id in int32 (an int64 division
    # per program took broadcast's reduction on the tlx backend from 14.5 to 19.5 µs on an H100), or in int64
    # where row_width·BLOCK passes 2^31 (WIDE_ROWS: over 16,384 heads of D 256).
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    ok = offs < n_elem - start
    row_width = n_heads * head_dim
    if WIDE_ROWS:
        column = ((pid % row_width).to(tl.int64) * BLOCK % row_width).to(tl.int32) + offs
    else:
        column = (pid % row_width) * BLOCK % row_width + offs
    head_row = (column // head_dim) % n_heads * n_parts  # Sources' row of each element's head
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j0 in range(0, n_parts, UNROLL):
        for u in tl.static_range(UNROLL):
            j = tl.full([], 0, tl.int64) + j0 + u
            take = ok & ((offs * 0 + j) < n_parts)  # a vector: the interpreter rejects scalar & vector masks
            if Sources is None:
                b = j
            else:
                b = tl.load(Sources + head_row + j, mask=take, other=-1).to(tl.int64)
                take = take & (b >= 0)
            acc += tl.load(Part + (b * n_elem + start) + offs, mask=take, other=0.0)
    tl.store(DQ + start + offs, stored(acc, DT, INTERPRET), mask=ok)


@triton.jit
def _row_stats_kernel(RowMax, RowSum, Delta, Stats, Scale, n, RECORDS: tl.constexpr, BLOCK: tl.constexpr):
    """`backward_row_stats` (m_safe, 2^-24/l) of every element of the flat [Hq·rows] residuals, the same bits
    as the dQ kernels': with RECORDS, `pack_row_stats` records with D into Stats (for `_dkv_kernel`, where D
    came from another backend's dQ pass); else m_safe into Stats and 2^-24/l into Scale (for the tlx dK/dV
    pass, which reads them in place of m and l)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    m_b, inv_b = backward_row_stats(tl.load(RowMax + offs, mask=ok, other=0.0),
                                    tl.load(RowSum + offs, mask=ok, other=0.0))
    if RECORDS:
        records = Stats + tl.cast(offs, tl.int64)[:, None] * ROW_RECORD + tl.arange(0, ROW_RECORD)[None, :]
        tl.store(records, pack_row_stats(m_b, inv_b, tl.load(Delta + offs, mask=ok, other=0.0)), mask=ok[:, None])
    else:
        tl.store(Stats + offs, m_b, mask=ok)
        tl.store(Scale + offs, inv_b, mask=ok)


@triton.jit
def _delta_kernel(Out, DOut, Delta, rows, so_t, so_h, so_d, sdo_t, sdo_h, sdo_d, stat_h, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr):
    """Delta[h, r] = rowsum(dO∘O) of output row r, head h = program_id(1), from the rounded output (as
    `_query_rows` computes it for the dQ pass)."""
    offs_r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_DV)
    row_ok = offs_r < rows
    ok = row_ok[:, None] & (offs_d < HEAD_DIM_V)[None, :]
    rows64 = tl.cast(offs_r, tl.int64)[:, None]
    o = tl.load(Out + rows64 * so_t + head * so_h + offs_d[None, :] * so_d, mask=ok, other=0.0)
    do = tl.load(DOut + rows64 * sdo_t + head * sdo_h + offs_d[None, :] * sdo_d, mask=ok, other=0.0)
    tl.store(Delta + head * stat_h + offs_r, row_delta(do, o), mask=row_ok)
