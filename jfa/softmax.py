"""The online softmax, written once for every kernel (Triton forward/backward, later TLX).

Numerics (why the recipe looks like this; FAILURES.md lists the kernels that broke without it):
- Scores stay raw: r = q·k in fp32 straight from the MMA (negated when sm_scale < 0, which is exact), so
  the running max m is a max over raw scores and -inf marks invisible keys and empty rows.
- p = exp2((r - m) * c) with c = |sm_scale|·log2(e): subtract first, then multiply. No expression of the
  form a*b - c exists, so FMA contraction cannot round the max element differently from m (with logits
  ~2e11, q = k = v = 133120 in bf16, `qk*scale - m*scale` contracted to fma(qk, scale, -m*scale) gives
  exp2(+large) = inf).
- m starts at -inf, never at a finite "small" value; rows that have seen no visible key keep m = -inf and
  every subtraction uses m_safe = 0 for them, so (-inf) - (-inf) = NaN never forms.
- The backward recomputes P from the raw row max m and the row sum l stored by the forward (not from
  lse = m·|scale| + log l, whose log l is lost in fp32 when m is huge).
- Subnormal probabilities survive in the backward: Triton lowers tl.exp2 on fp32 to
  `ex2.approx.ftz.f32`, which flushes results below 2^-126 to zero. In the forward that is harmless
  (every output is a convex combination dominated by probabilities >= 1/n; a flushed p < 2^-126 moves
  it by less than 2^-126·|V|, and a flushed alpha drops an accumulator worth < 2^-126 of the new one),
  so the forward keeps the fast tl.exp2. In the backward, dk and dv of a key seen only with tiny
  probabilities are themselves tiny and would lose their (subnormal) values, so P is recomputed as
  2^(x + 24)·(2^-24/l): normal down to x = -150, below which the true value rounds to 0 in fp32 anyway,
  with the 2^-24 folded into the per-row 1/l (no extra work). The shift rounds x + 24 to fp32 (relative
  error <= 2^-20 in P, far below the input dtype's rounding of P and dS).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def shifted_exp2(x):
    """2^(x + 24): never subnormal for x >= -150 (tl.exp2 flushes subnormal results to zero); the backward
    multiplies it by `backward_row_stats`'s 2^-24/l."""
    return tl.exp2(x + 24.0)


@triton.jit
def raw_scores(qk, NEG_SCALE: tl.constexpr):
    """Raw scores ordered like the logits: qk, or -qk when sm_scale < 0 (so logits = |scale|·r)."""
    r = qk
    if NEG_SCALE:
        r = -qk
    return r


@triton.jit
def safe_max(m):
    """The row max to subtract: m, or 0 for rows with no visible key (m = -inf)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def online_update(m_i, l_i, r, scale_log2):
    """One key block of the online softmax over raw scores r [M, N] (-inf where invisible).

    Returns (p, alpha, m_new, l_new): the block's unnormalised probabilities exp2((r - m_new)·c), the factor
    alpha that rescales the previous accumulator and row sum, and the updated running max and sum.
    """
    m_new = tl.maximum(m_i, tl.max(r, 1))
    m_safe = safe_max(m_new)
    alpha = tl.exp2((m_i - m_safe) * scale_log2)
    p = tl.exp2((r - m_safe[:, None]) * scale_log2)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def block_probs(r, m, scale_log2):
    """Unnormalised probabilities of rows held whole in one block, given their raw row max m."""
    return tl.exp2((r - safe_max(m)[:, None]) * scale_log2)


@triton.jit
def block_softmax(r, scale_log2):
    """Softmax of rows held whole in one block (packed tiles): unnormalised p and the raw row max m."""
    m = tl.max(r, 1)
    return block_probs(r, m, scale_log2), m


@triton.jit
def finalize(acc, m_i, l_i, scale_abs):
    """Normalised output and natural-log lse; rows with no visible key get out = 0 and lse = -inf.

    One reciprocal per row, then a multiply per element: on the GPU `acc / l` compiles to div.full.f32, a
    reciprocal and a multiply per element, so this gives the same bits (checked on jfa.bench's rows, both
    backends, on the H200) with one MUFU reciprocal per row instead of one per element."""
    has = l_i > 0
    out = tl.where(has[:, None], acc * (1.0 / tl.where(has, l_i, 1.0))[:, None], 0.0)
    lse = tl.where(has, m_i * scale_abs + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def backward_row_stats(m, l):
    """(m_safe, w) for recomputing the normalised P = shifted_exp2((r - m_safe)·c) · w, w = 2^-24 / l
    (0 for empty rows): one multiply per element, as in the forward."""
    return safe_max(m), tl.where(l > 0, 5.9604644775390625e-08 / tl.where(l > 0, l, 1.0), 0.0)


# What the dK/dV pass reads of each query row, once per (query block, key block) pair: one 16-byte record
# (m_safe, 2^-24/l, D, 0) per row and head, so that a block's statistics are one vector load per row and no
# division, where deriving them from m and l in every pair cost a third of the pass's loop (`jfa.triton.backward`).
ROW_RECORD = tl.constexpr(4)


@triton.jit
def pack_row_stats(m_b, inv_b, delta):
    """[rows, ROW_RECORD] records (m_b, inv_b, delta, 0) of `backward_row_stats`' (m_b, inv_b) and D."""
    rec = tl.join(tl.join(m_b, delta), tl.join(inv_b, tl.zeros_like(inv_b)))  # [rows, 2, 2]: [r, i, j] = 2i + j
    return tl.reshape(rec, [m_b.shape[0], ROW_RECORD])


@triton.jit
def unpack_row_stats(rec, ROWS: tl.constexpr):
    """(m_b, inv_b, delta) of [ROWS, ROW_RECORD] records written by `pack_row_stats`."""
    even, odd = tl.split(tl.reshape(rec, [ROWS, 2, 2]))
    m_b, delta = tl.split(even)
    inv_b, _ = tl.split(odd)
    return m_b, inv_b, delta


@triton.jit
def row_delta(do, o):
    """D = rowsum(dO∘O) in fp32, O the rounded output: one expression for every kernel that computes it (the
    dQ passes, and the D kernel of the one-pass backward), so they agree bitwise."""
    return tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)


@triton.jit
def chunked_row_sum(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Row sums of p [BLOCK_M, BLOCK_N] whose bits do not depend on where a row's nonzeros sit.

    Packed tiles place a sequence's keys at any CHUNK-aligned column offset. Each CHUNK-wide chunk is
    summed (the same reduction for every chunk), then the chunk sums are added in column order starting
    from 0; the other sequences' chunks are exact zeros, so a sequence gets the same bits in any slot.
    """
    parts = tl.sum(tl.reshape(p, [BLOCK_M, BLOCK_N // CHUNK, CHUNK]), 2)
    chunk = tl.arange(0, BLOCK_N // CHUNK)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in tl.static_range(BLOCK_N // CHUNK):
        total += tl.sum(tl.where(chunk[None, :] == c, parts, 0.0), 1)
    return total
