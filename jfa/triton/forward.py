"""Triton forward kernels: the persistent tiled kernel for ordinary sequences and the packed kernel for tiny
ones, plus the device helpers the backward kernels share.

Ordinary tile = (sequence, BLOCK_M query rows, query head). The program loads the query block once and
walks the key blocks `jfa.block_info.kv_block_range` gives it: without causal or window in three segments,
masked blocks at the left edge (none without a window), unmasked blocks in the middle (no mask arithmetic,
unmasked loads when the head dim is a power of two), masked blocks at the right edge (the sequence's last
partial block); with causal or window in one loop that masks the blocks outside the middle
(`jfa.block_info.MASK_EDGES` says why). Every block: S = Q·Kᵀ in fp32 from the input dtype, the online
softmax of `jfa.softmax` over raw scores, P rounded to the input dtype, acc += P·V in fp32. The epilogue
writes out (rounded once), lse (natural log) and the residuals m (raw row max) and l (row sum) the backward
recomputes P from.

Packed tile = up to block/16 tiny sequences of equal slot size (see `jfa.tile_scheduler`); one program
does every head of it in a pipelined loop. Every row's whole key range fits the tile, so the softmax is
exact in one block (no rescaling) and the block-diagonal mask comes from the slot of each row and key.

Addresses: a block's first row is widened to int64 before it meets a stride, so rows × stride may exceed
2^31 (non-contiguous inputs with large strides); offsets inside a tile are int32 (the host copies the
rare tensor whose row or column stride is >= 2^22). Only scalar base pointers live across loop
iterations; each block's pointer tile is rebuilt from them.
Loads of rows or keys outside a sequence are masked with other=0 and their scores set to -inf, so NaN
stored past offsets[-1] (or in another sequence) can never reach a result.

Interpreter (TRITON_INTERPRET=1): the CPU interpreter multiplies bf16 tl.dot operands as raw bit patterns
(triton#11584) and casts fp32 -> bf16 by truncation; with INTERPRET set the kernels form the products in
fp32 (bf16/fp16 products are exact in fp32) and add them in k order in fp32 — a faithful model of the
tensor core's fp32 accumulation — and round to the input dtype with an explicit round-to-nearest-even
(`rounded`, and `stored`, which also builds bf16 subnormals from their bits).
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

from jfa.block_info import MASK_NEVER, block_masked, kv_block_range, over_blocks
from jfa.mask import visible, visible_keys
from jfa.softmax import block_probs, block_softmax, chunked_row_sum, finalize, online_update, raw_scores

# Scalar arguments that change from call to call: not specialised (a value of 1 would otherwise compile a
# separate kernel), so one compiled variant serves every batch of a given head dim, dtype and mask kind.
_RUNTIME_INTS = ("n_tiles", "n_heads", "n_kv_heads", "group", "window", "profile", "stat_h", "n_seqs", "n_elem")


def kernel(fn):
    """@triton.jit for a kernel, without specialising its per-call scalar arguments."""
    params = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[name for name in _RUNTIME_INTS if name in params])


# ---------------------------------------------------------------------------------------------------------
# Device helpers shared with the backward kernels.


@triton.jit
def _products_sum(a, b):
    """a @ b in fp32 as a sequential sum over k of exact products (interpreter only): numpy's matmul may
    order its sums by position, which would break the bitwise slot-independence of packed tiles."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)


@triton.jit
def mma(a, b, INTERPRET: tl.constexpr):
    """a @ b with fp32 accumulation (operands in the input dtype; upcast when interpreting)."""
    if INTERPRET:  # noqa: SIM108 - constexpr branches, kept as statements for the Triton frontend
        c = _products_sum(a, b)
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def mma_acc(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if INTERPRET:  # noqa: SIM108
        c = acc + _products_sum(a, b)
    else:
        c = tl.dot(a, b, acc)
    return c


@triton.jit
def _rne_bf16_bits(x):
    """fp32 -> the fp32 bit pattern of its round-to-nearest-even bf16 value (low 16 bits zero)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    return (bits >> 16) << 16


@triton.jit
def rounded(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 x rounded to nearest-even in dtype DT, as a matmul operand: a DT tensor on the GPU; when
    interpreting, an fp32 tensor holding the rounded values (the interpreter's fp32 -> bf16 cast truncates)."""
    if INTERPRET:
        if DT == tl.bfloat16:  # noqa: SIM108, SIM300
            y = _rne_bf16_bits(x).to(tl.float32, bitcast=True)
        else:
            y = x.to(DT).to(tl.float32)
    else:
        y = x.to(DT)
    return y


@triton.jit
def stored(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 x rounded to nearest-even in dtype DT, for a store. When interpreting, bf16 is built from the
    bits (the interpreter's own conversions truncate and mangle subnormals)."""
    if INTERPRET:
        if DT == tl.bfloat16:  # noqa: SIM108, SIM300
            y = (_rne_bf16_bits(x) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(DT)
    else:
        y = x.to(DT)
    return y


@triton.jit
def load_tile(ptrs, row_ok, col_ok, ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr):
    """A 2-D tile; rows/columns outside the masks read as 0 (never loaded)."""
    if ROW_MASK:
        if COL_MASK:
            x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if COL_MASK:  # noqa: SIM108
            x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def row_base(ptr, row, stride_t, head, stride_h):
    """Scalar pointer to element 0 of (row, head); int64 arithmetic (rows × stride may exceed 2^31)."""
    return ptr + tl.cast(row, tl.int64) * stride_t + tl.cast(head, tl.int64) * stride_h


@triton.jit
def tile_offsets(offs_r, stride_r, offs_c, stride_c):
    """int32 in-tile offsets [R, C]; the host keeps strides below 2^22 so BLOCK × stride fits."""
    return offs_r[:, None] * stride_r + offs_c[None, :] * stride_c


@triton.jit
def next_tile(r, pid, nprog, n_tiles, counter, SCHEDULE: tl.constexpr):
    """The tile program `pid` takes after its r-th (0-based) one; >= n_tiles ends the program.

    SCHEDULE 0: static zigzag (round r: tile r·P + pid if r is even, r·P + P-1-pid if odd);
    1: dynamic, the next index of an atomic counter (offset by P: tiles 0..P-1 are taken at launch);
    2: one tile per program.
    """
    if SCHEDULE == 0:
        nr = r + 1
        t = nr * nprog + tl.where(nr % 2 == 0, pid, nprog - 1 - pid)
    elif SCHEDULE == 1:
        t = tl.atomic_add(counter, 1) + nprog
    else:
        t = pid * 0 + n_tiles
    return t


@triton.jit
def head_dim_lanes(HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """Column indices of q/k's and v's head dims padded to BLOCK_D and BLOCK_DV, and which are real columns:
    (offs_d, offs_dv, d_ok, dv_ok)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    return offs_d, offs_dv, offs_d < HEAD_DIM, offs_dv < HEAD_DIM_V


@triton.jit
def tile_entry(tiles, t, n_heads):
    """Tile t of an ordinary tile table (`jfa.tile_scheduler`: one (sequence, first row of the block) entry
    per n_heads consecutive tiles): (sequence, first row, head)."""
    entry = t // n_heads
    head = t - entry * n_heads
    return tl.load(tiles + 2 * entry), tl.load(tiles + 2 * entry + 1), head


@triton.jit
def sequence_bounds(q_offsets, out_offsets, kv_offsets, seq):
    """(q_start, out_start, q_len, kv_start, kv_len) of sequence `seq` (scalars or vectors)."""
    q_start = tl.load(q_offsets + seq)
    out_start = tl.load(out_offsets + seq)
    q_len = tl.load(out_offsets + seq + 1) - out_start
    kv_start = tl.load(kv_offsets + seq)
    kv_len = tl.load(kv_offsets + seq + 1) - kv_start
    return q_start, out_start, q_len, kv_start, kv_len


@triton.jit
def query_tile(tiles, t, n_heads, group, q_offsets, out_offsets, kv_offsets, window, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr):
    """Ordinary query tile t (the forward's and dQ's): (head, kv_head, first row m0, q_start, out_start, q_len,
    kv_start, kv_len, and the key blocks lo, full_lo, full_hi, hi its rows visit, `kv_block_range`)."""
    seq, m0, head = tile_entry(tiles, t, n_heads)
    q_start, out_start, q_len, kv_start, kv_len = sequence_bounds(q_offsets, out_offsets, kv_offsets, seq)
    kv_head = head // group
    m1 = tl.minimum(m0 + BLOCK_M, q_len)
    lo, full_lo, full_hi, hi = kv_block_range(m0, m1, q_len, kv_len, window, BLOCK_N, HAS_WINDOW, CAUSAL)
    return head, kv_head, m0, q_start, out_start, q_len, kv_start, kv_len, lo, full_lo, full_hi, hi


# ---------------------------------------------------------------------------------------------------------
# Ordinary tiles.


@triton.jit
def _fwd_blocks(acc, m_i, l_i, start, end, full_lo, full_hi, q, k_seq, v_seq, offs_m, offs_n, offs_d, offs_dv, d_ok,
                dv_ok, sk_t, sk_d, sv_t, sv_d, q_len, kv_len, window, scale_log2,
                DT: tl.constexpr, BLOCK_N: tl.constexpr, MASK_D: tl.constexpr, MASK_DV: tl.constexpr,
                NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, INTERPRET: tl.constexpr,
                MASK: tl.constexpr):
    """Key blocks [start, end) of one query block; MASK (`jfa.block_info.block_masked`) says which apply the
    visibility rule. Loads are masked unless MASK is MASK_NEVER.

    Only scalar base pointers live across iterations; each block's pointer tile is rebuilt from them (a
    loop-carried tile of 64-bit pointers would pin two registers per element).
    """
    for n in range(start, end, BLOCK_N):
        key_ok = (n + offs_n) < kv_len
        k = load_tile(k_seq + tl.cast(n, tl.int64) * sk_t + tile_offsets(offs_n, sk_t, offs_d, sk_d),
                      key_ok, d_ok, MASK != MASK_NEVER, MASK_D)
        r = raw_scores(mma(q, tl.trans(k), INTERPRET), NEG_SCALE)
        if block_masked(n, full_lo, full_hi, MASK):
            seen = visible(offs_m[:, None], (n + offs_n)[None, :], q_len, kv_len, window, HAS_WINDOW, CAUSAL)
            r = tl.where(seen, r, float("-inf"))
        p, alpha, m_i, l_i = online_update(m_i, l_i, r, scale_log2)
        v = load_tile(v_seq + tl.cast(n, tl.int64) * sv_t + tile_offsets(offs_n, sv_t, offs_dv, sv_d),
                      key_ok, dv_ok, MASK != MASK_NEVER, MASK_DV)
        acc = mma_acc(rounded(p, DT, INTERPRET), v, acc * alpha[:, None], INTERPRET)
    return acc, m_i, l_i


@kernel
def _fwd_kernel(
    Q, K, V, Out, Lse, RowMax, RowSum,
    tiles, n_tiles, counter,
    q_offsets, out_offsets, kv_offsets,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, stat_h,
    scale_log2, scale_abs, window, n_heads, group, profile,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    SCHEDULE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Persistent forward over ordinary tiles (sequence, query block, query head)."""
    DT: tl.constexpr = Out.dtype.element_ty
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
        q = load_tile(row_base(Q, q_start + m0, sq_t, head, sq_h) + tile_offsets(offs_r, sq_t, offs_d, sq_d),
                      row_ok, d_ok, True, MASK_D)
        k_seq = row_base(K, kv_start, sk_t, kv_head, sk_h)
        v_seq = row_base(V, kv_start, sv_t, kv_head, sv_h)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        acc, m_i, l_i = over_blocks(
            _fwd_blocks, (acc, m_i, l_i),
            (q, k_seq, v_seq, offs_m, offs_n, offs_d, offs_dv, d_ok, dv_ok, sk_t, sk_d, sv_t, sv_d, q_len, kv_len,
             window, scale_log2, DT, BLOCK_N, MASK_D, MASK_DV, NEG_SCALE, HAS_WINDOW, CAUSAL, INTERPRET),
            lo, full_lo, full_hi, hi, CAUSAL or HAS_WINDOW)

        out, lse = finalize(acc, m_i, l_i, scale_abs)
        o_ptrs = row_base(Out, out_start + m0, so_t, head, so_h) + tile_offsets(offs_r, so_t, offs_dv, 1)
        tl.store(o_ptrs, stored(out, DT, INTERPRET), mask=row_ok[:, None] & dv_ok[None, :])
        stat = tl.cast(head, tl.int64) * stat_h + out_start + offs_m
        tl.store(Lse + stat, lse, mask=row_ok)
        tl.store(RowMax + stat, m_i, mask=row_ok)
        tl.store(RowSum + stat, l_i, mask=row_ok)
        t = t_next
        r += 1


# ---------------------------------------------------------------------------------------------------------
# Packed tiles.


@triton.jit
def packed_layout(pack_seqs, pack_shift, g, q_offsets, out_offsets, kv_offsets,
                  BLOCK: tl.constexpr, SLOTS: tl.constexpr, ROW_SEQS: tl.constexpr):
    """Per tile row (= per tile key, the same slot map): slot, local index, and its sequence's bounds.

    Returns (slot, loc, q_start, out_start, q_len, kv_start, kv_len, row_ok, key_ok), vectors [BLOCK];
    lengths are 0 for empty slots, so their rows and keys are invalid. pack_seqs holds SLOTS entries per tile:
    with ROW_SEQS, entry e is the sequence of rows [e·BLOCK/SLOTS, (e + 1)·BLOCK/SLOTS) (`PackTable.row_seqs`),
    so a row's sequence is a load that waits for no other; otherwise entry s is slot s's (`PackTable.seqs`),
    read at the slot the tile's slot size gives. The forward takes the first (the tiny row's packed forward
    0.712 -> 0.656 ms on the H200), the backward the second (the first made it 2.13 -> 2.21 ms;
    docs/performance-log.md).
    """
    shift = tl.load(pack_shift + g)
    offs = tl.arange(0, BLOCK)
    slot = offs >> shift
    loc = offs - (slot << shift)
    if ROW_SEQS:  # noqa: SIM108 - constexpr branches, kept as statements for the Triton frontend
        seq = tl.load(pack_seqs + g * SLOTS + offs // (BLOCK // SLOTS))
    else:
        seq = tl.load(pack_seqs + g * SLOTS + slot)
    has = seq >= 0
    seq = tl.where(has, seq, 0)
    q_start, out_start, q_len, kv_start, kv_len = sequence_bounds(q_offsets, out_offsets, kv_offsets, seq)
    q_len = tl.where(has, q_len, 0)
    kv_len = tl.where(has, kv_len, 0)
    return slot, loc, q_start, out_start, q_len, kv_start, kv_len, loc < q_len, loc < kv_len


@triton.jit
def packed_rows(ptr, rows, stride_t, head, stride_h, cols, row_ok, col_ok, COL_MASK: tl.constexpr):
    """Head `head` of a packed tile's rows: tile row i is tensor row rows[i] (a scalar base per row in int64:
    the slots' rows are not contiguous), at the int32 column offsets `cols`."""
    return load_tile(row_base(ptr, rows, stride_t, head, stride_h)[:, None] + cols[None, :], row_ok, col_ok, True,
                     COL_MASK)


@triton.jit
def prefetch_rows(ptr, rows, stride_t, head, stride_h, stride_d, row_ok, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Asks L2 for head `head` of a packed tile's rows (DIM elements each, stride_d apart) where row_ok holds: a
    PTX `prefetch` per 128 bytes of a row, at an element of it (never past it), which no register receives and
    nothing waits for. A hint that changes no value; the interpreter has no PTX and skips it."""
    if not INTERPRET:
        LINE: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
        cols = tl.arange(0, max(1, BLOCK_D // LINE)) * LINE
        lines = row_base(ptr, rows, stride_t, head, stride_h)[:, None] + (cols * stride_d)[None, :]
        wanted = (row_ok[:, None] & (cols < DIM)[None, :]).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [lines, wanted], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def packed_visible(slot, loc, q_len, kv_len, row_ok, key_ok, window, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                   BY_INTERVAL: tl.constexpr):
    """[BLOCK, BLOCK] block-diagonal visibility of a packed tile (rows × keys), in one of two forms with the same
    value. BY_INTERVAL: each row's visible keys are one interval of its own slot's (`visible_keys`, moved to tile
    key indices; empty for rows past q_len), two comparisons an element. Otherwise per pair: same slot, row and
    key in their sequences, and `visible`, four to seven. The forward takes the first (ptxas for sm_90 under
    triton 3.6, D 128: 2,224 -> 2,016 SASS instructions; the tiny row's packed forward 0.655 -> 0.651 ms on the
    H200), the backward the second (the first, with fewer instructions too, made its kernel 2.124 -> 2.162 ms;
    docs/performance-log.md)."""
    if BY_INTERVAL:
        lo, hi = visible_keys(loc, q_len, kv_len, window, HAS_WINDOW, CAUSAL)
        offs = tl.arange(0, loc.shape[0])  # a tile row's index, and a tile key's
        slot_start = offs - loc
        lo = slot_start + tl.maximum(lo, 0)
        hi = tl.where(row_ok, slot_start + hi, lo)
        seen = (offs[None, :] >= lo[:, None]) & (offs[None, :] < hi[:, None])
    else:
        same = (slot[:, None] == slot[None, :]) & row_ok[:, None] & key_ok[None, :]
        seen = same & visible(loc[:, None], loc[None, :], q_len[:, None], kv_len[:, None], window, HAS_WINDOW,
                              CAUSAL)
    return seen


@triton.jit
def slot_mma(a, b, slot, SLOTS: tl.constexpr, ISOLATE: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b (fp32) in a packed tile, whose result rows, a's columns and b's rows all follow the tile's one slot
    map `slot`. ISOLATE sums each row over its own slot only, one product per slot with the other slots'
    operands zeroed: the same bits where the other slots' terms are exact zeros, and no 0·NaN from another
    sequence where they are not (`nonfinite_rows` says when a tile needs it)."""
    if ISOLATE:
        c = tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32)
        for s in range(SLOTS):
            own = slot == s
            # c's rows of slot s are still 0: only this iteration writes them.
            c = tl.where(own[:, None],
                         mma_acc(tl.where(own[None, :], a, 0.0), tl.where(own[:, None], b, 0.0), c, INTERPRET), c)
    else:
        c = mma(a, b, INTERPRET)
    return c


@triton.jit
def nonfinite_rows(x):
    """Which rows of x hold a NaN or an infinity (through the row sum, which any of them makes non-finite; a
    finite row whose sum overflows counts too, which only costs the isolated recompute)."""
    return ~(tl.abs(tl.sum(x, 1)) < float("inf"))


@triton.jit
def _fwd_packed_head(
    Q, K, V, Out, Lse, RowMax, RowSum, head, kv_head, slot, loc, q_start, out_start, kv_start, row_ok, key_ok,
    seen, offs_d, offs_dv, d_ok, dv_ok, sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, stat_h,
    scale_log2, scale_abs, DT: tl.constexpr, BLOCK: tl.constexpr, SLOTS: tl.constexpr,
    MASK_D: tl.constexpr, MASK_DV: tl.constexpr, NEG_SCALE: tl.constexpr, ISOLATE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One query head of a packed tile: stores out, lse, m and l; returns the rows whose output is not finite.
    ISOLATE (the redo launch) stores out only, from the m and l the first launch stored (they involve no other
    slot): a row sum recomputed in another kernel may add in another order (the order follows the layout the
    compiler picks), and the finite rows must keep their bits."""
    k = packed_rows(K, kv_start + loc, sk_t, kv_head, sk_h, offs_d * sk_d, key_ok, d_ok, MASK_D)
    v = packed_rows(V, kv_start + loc, sv_t, kv_head, sv_h, offs_dv * sv_d, key_ok, dv_ok, MASK_DV)
    q = packed_rows(Q, q_start + loc, sq_t, head, sq_h, offs_d * sq_d, row_ok, d_ok, MASK_D)
    s = raw_scores(mma(q, tl.trans(k), INTERPRET), NEG_SCALE)
    s = tl.where(seen, s, float("-inf"))
    stat = tl.cast(head, tl.int64) * stat_h + out_start + loc
    if ISOLATE:
        m = tl.load(RowMax + stat, mask=row_ok, other=float("-inf"))
        l = tl.load(RowSum + stat, mask=row_ok, other=0.0)
        p = block_probs(s, m, scale_log2)
    else:
        p, m = block_softmax(s, scale_log2)
        l = chunked_row_sum(p, BLOCK, BLOCK, BLOCK // SLOTS)  # chunks of a slot's alignment
    acc = slot_mma(rounded(p, DT, INTERPRET), v, slot, SLOTS, ISOLATE, INTERPRET)
    out, lse = finalize(acc, m, l, scale_abs)
    tl.store(row_base(Out, out_start + loc, so_t, head, so_h)[:, None] + offs_dv[None, :],
             stored(out, DT, INTERPRET), mask=row_ok[:, None] & dv_ok[None, :])
    if not ISOLATE:
        tl.store(Lse + stat, lse, mask=row_ok)
        tl.store(RowMax + stat, m, mask=row_ok)
        tl.store(RowSum + stat, l, mask=row_ok)
    return nonfinite_rows(out)


@triton.jit
def flag_tile(flagged, t):
    """Lists packed tile t for the redo launch: flagged[0] counts the entries (zeroed by the host for each
    launch), flagged[1 + i] is entry i."""
    tl.store(flagged + 1 + tl.atomic_add(flagged, 1), t)


@triton.jit
def _fwd_packed_tile(
    Q, K, V, Out, Lse, RowMax, RowSum, pack_seqs, pack_shift, t, t_next, n_tiles, q_offsets, out_offsets,
    kv_offsets, sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, stat_h, scale_log2, scale_abs, window,
    n_heads, group, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr, SLOTS: tl.constexpr, NEG_SCALE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, ISOLATE: tl.constexpr, FLAG_PER_HEAD: tl.constexpr,
    PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Every query head of packed tile t; returns whether any output row is not finite."""
    DT: tl.constexpr = Out.dtype.element_ty
    offs_d, offs_dv, d_ok, dv_ok = head_dim_lanes(HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
    slot, loc, q_start, out_start, q_len, kv_start, kv_len, row_ok, key_ok = packed_layout(
        pack_seqs, pack_shift, t, q_offsets, out_offsets, kv_offsets, BLOCK, SLOTS, True)
    seen = packed_visible(slot, loc, q_len, kv_len, row_ok, key_ok, window, HAS_WINDOW, CAUSAL, True)
    if FLAG_PER_HEAD:  # noqa: SIM108 - constexpr branches, kept as statements for the Triton frontend
        bad = 0
    else:
        bad = tl.zeros([BLOCK], dtype=tl.int32)
    if PREFETCH and not ISOLATE:  # the redo launch's few tiles are not worth the registers
        # The rows of the program's next tile (t_next; none past n_tiles), whose first head the last head here
        # asks L2 for: their layout's loads are issued now and waited for only then.
        has_next = t_next < n_tiles
        _, next_loc, next_q_start, _, _, next_kv_start, _, next_row_ok, next_key_ok = packed_layout(
            pack_seqs, pack_shift, tl.minimum(t_next, n_tiles - 1), q_offsets, out_offsets, kv_offsets, BLOCK,
            SLOTS, True)
        next_row_ok = next_row_ok & has_next
        next_key_ok = next_key_ok & has_next
    for head in range(n_heads):
        if PREFETCH and not ISOLATE:
            # The next head's inputs into L2 now, while this head computes (see the kernel's docstring); its
            # k and v only where it starts another kv head; after the last head, the next tile's first.
            # `jfa.triton.backend.PREFETCH_NEXT_HEAD` says which compilers get it.
            last = head + 1 == n_heads
            prefetch_rows(Q, next_q_start + next_loc, sq_t, 0, sq_h, sq_d, next_row_ok & last, HEAD_DIM, BLOCK_D,
                          INTERPRET)
            prefetch_rows(K, next_kv_start + next_loc, sk_t, 0, sk_h, sk_d, next_key_ok & last, HEAD_DIM, BLOCK_D,
                          INTERPRET)
            prefetch_rows(V, next_kv_start + next_loc, sv_t, 0, sv_h, sv_d, next_key_ok & last, HEAD_DIM_V,
                          BLOCK_DV, INTERPRET)
            ahead = head + 1 < n_heads
            new_kv = ahead & ((head + 1) % group == 0)
            prefetch_rows(Q, q_start + loc, sq_t, head + 1, sq_h, sq_d, row_ok & ahead, HEAD_DIM, BLOCK_D,
                          INTERPRET)
            prefetch_rows(K, kv_start + loc, sk_t, (head + 1) // group, sk_h, sk_d, key_ok & new_kv, HEAD_DIM,
                          BLOCK_D, INTERPRET)
            prefetch_rows(V, kv_start + loc, sv_t, (head + 1) // group, sv_h, sv_d, key_ok & new_kv, HEAD_DIM_V,
                          BLOCK_DV, INTERPRET)
        head_bad = _fwd_packed_head(
            Q, K, V, Out, Lse, RowMax, RowSum, head, head // group, slot, loc, q_start, out_start, kv_start,
            row_ok, key_ok, seen, offs_d, offs_dv, d_ok, dv_ok, sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h,
            sv_d, so_t, so_h, stat_h, scale_log2, scale_abs, DT, BLOCK, SLOTS, HEAD_DIM != BLOCK_D,
            HEAD_DIM_V != BLOCK_DV, NEG_SCALE, ISOLATE, INTERPRET)
        if FLAG_PER_HEAD:  # `jfa.triton.backend.FLAG_PER_HEAD` says which form a compiler gets
            head_bad = tl.max(head_bad.to(tl.int32), 0) > 0
        bad = tl.where(head_bad, 1, bad)
    if not FLAG_PER_HEAD:
        bad = tl.max(bad, 0)
    return bad


@kernel
def _fwd_packed_kernel(
    Q, K, V, Out, Lse, RowMax, RowSum,
    pack_seqs, pack_shift, n_tiles, counter,
    q_offsets, out_offsets, kv_offsets,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, stat_h,
    scale_log2, scale_abs, window, n_heads, group, profile,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, SLOTS: tl.constexpr,
    NEG_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    SCHEDULE: tl.constexpr, REDO: tl.constexpr, FLAG_PER_HEAD: tl.constexpr, PREFETCH: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Persistent forward over packed tiles (a group of tiny sequences), every query head in turn.

    The head loop is the kernel's inner loop. Triton's pipeliner issues the copies of the next head's q, k
    and v only at the end of an iteration, after its stores, and the next iteration starts by waiting for
    them: with any num_stages a head's loads would wait for DRAM with nothing to overlap them but the SM's
    other program. So each iteration first asks L2 for the next head's rows (`prefetch_rows`, with PREFETCH),
    and those copies find them there (the tiny row's forward 0.748 → 0.703 ms on the H200 under stock triton,
    docs/performance-log.md); the last head asks for the program's next tile's first (its packed kernel 0.648
    → 0.637 ms).

    P·V sums each row over the whole tile, the other slots at weight 0, so a NaN or infinity in one
    sequence's v would reach its neighbours (0·NaN). A tile with any non-finite output is listed
    (`flag_tile`, in counter[1:]), and a second launch with REDO does the listed tiles again (dealt
    round-robin) with the products isolated per slot (`slot_mma`), which leaves the finite rows' bits as they
    were. The redo is a launch of its own so that its registers (a product per slot) stay out of the main
    loop: inlined there they spilled into it, and a non-inlined function made ptxas serialise every wgmma of
    the caller.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if REDO:  # noqa: SIM108 - constexpr branches, kept as statements for the Triton frontend
        count = tl.load(counter + 1)
    else:
        count = n_tiles
    i = pid
    r = pid * 0
    while i < count:
        if REDO:
            t = tl.load(counter + 2 + i)
            i_next = i + nprog
        else:
            t = i
            i_next = next_tile(r, pid, nprog, n_tiles, counter, SCHEDULE)
        bad = _fwd_packed_tile(
            Q, K, V, Out, Lse, RowMax, RowSum, pack_seqs, pack_shift, t, i_next, n_tiles, q_offsets, out_offsets,
            kv_offsets, sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, stat_h, scale_log2,
            scale_abs, window, n_heads, group, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK, SLOTS, NEG_SCALE,
            HAS_WINDOW, CAUSAL, REDO, FLAG_PER_HEAD, PREFETCH, INTERPRET)
        if not REDO:  # noqa: SIM102 - a constexpr branch around a run-time one
            if bad > 0:
                flag_tile(counter + 1, t)
        i = i_next
        r += 1
