"""Host-side tile tables for the persistent kernels, shared by forward and backward (and the TLX backend).

A *tile* is one work item of a kernel. Ordinary sequences are cut into blocks along one dimension:
- query tiles (forward, dQ): (sequence, query block start, query head); the work of a tile is the number
  of key blocks it visits (`jfa.block_info.kv_block_range`, so causal and window masks are counted);
- key tiles (dK/dV): (sequence, key block start, key/value head); work = query blocks that see it, times
  the query heads of the group.
Tables hold one *entry* (sequence, block start) per block, sorted by work descending (stable, so ties keep
sequence order). A table of n entries and H heads has n·H tiles, ordered in one of two ways (`tile_at`, on
the device, and `TileTable.tile`, its host twin):
- heads adjacent (the Triton kernels): tile t is entry t // H, head t % H;
- head-major within runs (the TLX kernels): a *run* is a maximal stretch of at least HEAD_MAJOR_MIN_RUN
  adjacent entries of one sequence (its blocks of equal work: all of them without a mask); any other entry
  is a run of its own. The run of L entries from entry s owns tiles [s·H, (s + L)·H) and deals them head by
  head: tile s·H + u is entry s + u % L, head u // L (L = 1: heads adjacent). The programs running at once
  then take many blocks of one (sequence, head) rather than every head of a few blocks, so each key/value
  (or query) block is read by more of them while it sits in L2 (see HEAD_MAJOR_MIN_RUN for the figures).

Tiles are dealt to persistent programs in one of three ways (the kernels implement them; the functions
below are the host reference the tests compare against):
- STATIC: zigzag (boustrophedon) dealing of the sorted tiles: in round r program p takes tile
  r·P + p when r is even and r·P + (P - 1 - p) when r is odd, so the heaviest tiles spread over programs
  and each program's total work evens out;
- DYNAMIC: a program takes tile `pid` first and then the next unclaimed tile from an atomic counter (the
  Hopper stand-in for Blackwell's Cluster Launch Control): greedy longest-processing-time-first;
- GRID: one program per tile (no persistence), hardware block order.
A kernel may instead walk a host-made list per program (`program_lists`, the TLX short-query pass): the zigzag
dealing, or for broadcast_q's dq, a sum over the sequences, contiguous head-major chunks of equal cost whose
tiles' dq each program sums in registers per head (one partial per program and head, not per sequence).

Short-query sequences (backward only): a sequence with 1 <= q_len <= short block and more than a packed
tile's worth of rows or keys, when each key/value head serves one query head (no GQA), gets one tile per
(sequence, head) in the `short_bwd` table, sorted by the key blocks it visits: its program holds every
query row at once and does the whole backward in one pass over the keys (dK and dV of each key block are
final after it; dQ stays in registers), instead of a dQ tile plus a dK/dV tile per key block. With GQA a
key block's dK and dV sum over the group's heads, whose dQs could not all stay in registers, so those
sequences keep the two passes. Like packing, the choice depends on a sequence's own lengths only.

Tiny sequences are packed: a sequence with 0 < max(q_len, kv_len) <= pack_block goes into a packed tile
(pack_block × pack_block) of slot size S = 8, 16, 32, ... (the smallest power of two >= 8 holding both of
its lengths); a tile holds pack_block // S sequences of the same S, each at rows and keys
[slot·S, slot·S + S) of the tile (block-diagonal mask). The class S depends on the sequence's own lengths
only, so a sequence's arithmetic is the same in any slot, alone or in a batch: its products sum in the
same MMA K steps wherever it sits (see `PACK_ALIGN`), and its row sums by chunks
(`jfa.softmax.chunked_row_sum`). 32k sequences of length <= 32 become ~11k tiles of 64 (each program
doing every head of its tile in a software-pipelined loop) rather than 32k mostly-empty ones, and one
program does the whole backward of a packed tile.

Everything is vectorised numpy over sequences and blocks (B = 70,000 sequences take milliseconds); no
grid axis ever exceeds 65,535 because the kernels are persistent over a 1-D grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import triton
import triton.language as tl

from jfa.block_info import kv_block_range_np, q_block_range_np

STATIC, DYNAMIC, GRID = 0, 1, 2
# The shortest run of a sequence's blocks whose tiles the TLX kernels deal head-major. Measured on the H200
# (bf16, D 128, jfa.bench rows, 2026-12-03, docs/performance-log.md): head-major runs of 32 blocks (long row,
# 16 heads) took 0.97x the device time of heads adjacent in the forward and 0.96x in the forward+backward, runs
# of 256 (skew row's long sequence) 0.96x and 0.97x; runs of 4-8 (GEM-like, 4 heads) made the forward 1.06x
# slower. There a sequence's heads fit in one wave of programs either way, and its last, partly filled block
# (a cheaper tile: one consumer idles) recurs every L tiles instead of H together, which the static zigzag
# dealing balances worse (`zigzag_assignment`'s makespan with that tile 0.5-0.8x the cost: +0.5-1.6%).
HEAD_MAJOR_MIN_RUN = 16
SCHEDULES = {"static": STATIC, "dynamic": DYNAMIC, "grid": GRID}
# Packed slots start at multiples of this, so no slot straddles the MMA's 16-key K step (bf16/fp16): a row's
# products anywhere within one K step sum to the same bits, split over two steps they do not
# (scripts/mma_position_probe.py on the H200, 2026-12-05, Triton tl.dot on wgmma, 100 draws a case: lengths 2-16
# at 20 offsets inside a step all bitwise equal; 6 cases spanning two steps equal in no draw). Slots of 8 pack
# the tiny bench row's sequences of <= 8 rows eight to a 64-row tile instead of four (12,282 -> 11,258 tiles).
PACK_ALIGN = 8
PACK_SHIFT = PACK_ALIGN.bit_length() - 1


@dataclass(frozen=True)
class TileTable:
    """Sorted entries (sequence, block start) of one kernel; tiles = entries × heads."""

    entries: np.ndarray  # int32 [n, 2]
    work: np.ndarray  # int64 [n]: blocks of the other dimension each tile visits (per head)
    heads: int

    @property
    def n_entries(self) -> int:
        return int(self.entries.shape[0])

    @property
    def n_tiles(self) -> int:
        return self.n_entries * self.heads

    @cached_property
    def run_rows(self) -> np.ndarray:
        """int32 [n, 4]: each entry with the first entry and the length of its run, the rows `tile_at` reads
        with RUNS."""
        seq = self.entries[:, 0]
        firsts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])  # [0] with length 0 for an empty table
        lengths = np.diff(np.r_[firsts, seq.size])
        first, length = np.repeat(firsts, lengths), np.repeat(lengths, lengths)
        alone = length < HEAD_MAJOR_MIN_RUN
        first[alone], length[alone] = np.flatnonzero(alone), 1
        runs = np.stack([first, length], axis=1)
        return np.ascontiguousarray(np.concatenate([self.entries, runs], axis=1), dtype=np.int32)

    def tile(self, t: int, runs: bool = False) -> tuple[int, int, int]:
        """(sequence, block start, head) of tile t, as `tile_at` decodes it (RUNS = runs)."""
        entry, head = divmod(t, self.heads)
        if runs:
            first, length = (int(x) for x in self.run_rows[entry, 2:])
            head, offset = divmod(t - first * self.heads, length)
            entry = first + offset
        return int(self.entries[entry, 0]), int(self.entries[entry, 1]), head


@triton.jit
def tile_at(tiles, t, n_heads, RUNS: tl.constexpr):
    """(sequence, block start, head) of tile t of a table of n_heads heads (`TileTable.tile` is the host twin).

    RUNS: `tiles` holds `TileTable.run_rows` (4 ints a row) and the tiles of a run go head-major; otherwise it
    holds the entries (2 ints a row) and the heads of an entry are adjacent. t // n_heads is an entry of t's
    run either way, since the run from entry s of length L owns tiles [s·H, (s + L)·H)."""
    entry = t // n_heads
    head = t - entry * n_heads
    if RUNS:
        first = tl.load(tiles + 4 * entry + 2)
        length = tl.load(tiles + 4 * entry + 3)
        offset = t - first * n_heads
        head = offset // length
        entry = first + offset - head * length
        seq = tl.load(tiles + 4 * entry)
        start = tl.load(tiles + 4 * entry + 1)
    else:
        seq = tl.load(tiles + 2 * entry)
        start = tl.load(tiles + 2 * entry + 1)
    return seq, start, head


@dataclass(frozen=True)
class PackTable:
    """Packed tiles: slot s of group g holds sequence seqs[g, s] (-1: empty); slot size 1 << shift[g]."""

    seqs: np.ndarray  # int32 [n_groups, block // PACK_ALIGN]
    shift: np.ndarray  # int32 [n_groups]
    block: int

    @property
    def n_groups(self) -> int:
        return int(self.shift.shape[0])

    @property
    def n_tiles(self) -> int:
        """One tile per group: its program loops over the heads (a software-pipelined inner loop)."""
        return self.n_groups

    def row_seqs(self) -> np.ndarray:
        """int32 [n_groups, block // PACK_ALIGN]: entry e of group g is the sequence holding the tile's rows
        [e·PACK_ALIGN, (e + 1)·PACK_ALIGN) (-1: none). What the packed forward reads: a row's sequence is then
        one load that waits for no other (not the slot size first, then the slot's entry)."""
        entry = np.arange(self.seqs.shape[1])
        slot = entry[None, :] >> (self.shift[:, None] - PACK_SHIFT)
        return np.ascontiguousarray(np.take_along_axis(self.seqs, slot, axis=1))


def _as_int64(x) -> np.ndarray:
    if hasattr(x, "numpy"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def split_packable(q_lens, kv_lens, pack_block: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the sequences for ordinary tiles and of those packed (0 < max length <= pack_block).

    Sequences with no query and no key rows appear in neither: they have nothing to compute or write.
    """
    q_lens, kv_lens = _as_int64(q_lens), _as_int64(kv_lens)
    longest = np.maximum(q_lens, kv_lens)
    packed = (longest > 0) & (longest <= pack_block) if pack_block > 0 else np.zeros_like(longest, bool)
    main = (longest > 0) & ~packed
    return np.flatnonzero(main), np.flatnonzero(packed)


def _blocks(seqs: np.ndarray, lens: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, block start) for every block of every listed sequence, in sequence order."""
    counts = (lens[seqs] + block - 1) // block
    seq_rep = np.repeat(seqs, counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    starts = (np.arange(seq_rep.size, dtype=np.int64) - first) * block
    return seq_rep, starts


def _sorted_table(seq_rep, starts, work, heads: int) -> TileTable:
    order = np.argsort(-work, kind="stable")
    entries = np.stack([seq_rep[order], starts[order]], axis=1).astype(np.int32)
    return TileTable(entries=np.ascontiguousarray(entries), work=work[order], heads=heads)


def _empty_table(heads: int) -> TileTable:
    """The table of a kernel that is off (no blocks to size its tiles with)."""
    return TileTable(entries=np.zeros((0, 2), dtype=np.int32), work=np.zeros(0, dtype=np.int64), heads=heads)


def query_tiles(q_lens, kv_lens, seqs, block_m: int, block_n: int, window: int | None, causal: bool,
                heads: int) -> TileTable:
    """Tiles over query blocks (forward, dQ), sorted by the number of key blocks visited."""
    q_lens, kv_lens, seqs = _as_int64(q_lens), _as_int64(kv_lens), _as_int64(seqs)
    seq_rep, m0 = _blocks(seqs, q_lens, block_m)
    q_len, kv_len = q_lens[seq_rep], kv_lens[seq_rep]
    lo, _, _, hi = kv_block_range_np(m0, np.minimum(m0 + block_m, q_len), q_len, kv_len, window, block_n, causal)
    return _sorted_table(seq_rep, m0, (hi - lo) // block_n, heads)


def key_tiles(q_lens, kv_lens, seqs, block_n: int, block_m: int, window: int | None, causal: bool,
              heads: int, group: int = 1) -> TileTable:
    """Tiles over key blocks (dK/dV), sorted by the number of query blocks (times group heads) that see them."""
    q_lens, kv_lens, seqs = _as_int64(q_lens), _as_int64(kv_lens), _as_int64(seqs)
    seq_rep, n0 = _blocks(seqs, kv_lens, block_n)
    q_len, kv_len = q_lens[seq_rep], kv_lens[seq_rep]
    lo, _, _, hi = q_block_range_np(n0, np.minimum(n0 + block_n, kv_len), q_len, kv_len, window, block_m, causal)
    return _sorted_table(seq_rep, n0, (hi - lo) // block_m * group, heads)


def slot_shift(q_lens, kv_lens) -> np.ndarray:
    """log2 of the packed slot size of each sequence: the smallest power of two >= PACK_ALIGN >= both lengths."""
    longest = np.maximum(np.maximum(_as_int64(q_lens), _as_int64(kv_lens)), PACK_ALIGN)
    shift = np.ceil(np.log2(longest.astype(np.float64))).astype(np.int64)
    shift += (np.left_shift(1, shift) < longest)  # guard against log2 rounding
    return shift


def pack_tiles(q_lens, kv_lens, seqs, block: int) -> PackTable:
    """Groups the listed (packable) sequences into block × block tiles of equal slot size."""
    q_lens, kv_lens, seqs = _as_int64(q_lens), _as_int64(kv_lens), _as_int64(seqs)
    slots = block // PACK_ALIGN
    shifts = slot_shift(q_lens[seqs], kv_lens[seqs])
    groups, group_shift = [], []
    # Largest slots first (their tiles carry the most work); within a class, sequence order.
    for shift in np.unique(shifts)[::-1]:
        members = seqs[shifts == shift]
        per_tile = block >> int(shift)
        n_groups = -(-members.size // per_tile)
        table = np.full((n_groups, slots), -1, dtype=np.int64)
        padded = np.full(n_groups * per_tile, -1, dtype=np.int64)
        padded[: members.size] = members
        table[:, :per_tile] = padded.reshape(n_groups, per_tile)
        groups.append(table)
        group_shift.append(np.full(n_groups, shift, dtype=np.int64))
    if groups:
        seq_table = np.concatenate(groups).astype(np.int32)
        shift_table = np.concatenate(group_shift).astype(np.int32)
    else:
        seq_table = np.zeros((0, slots), dtype=np.int32)
        shift_table = np.zeros(0, dtype=np.int32)
    return PackTable(seqs=np.ascontiguousarray(seq_table), shift=shift_table, block=block)


def profile_class(q_lens, kv_lens, pack_block: int) -> int:
    """A coarse length profile of the batch, the autotuning key: 0 empty or packed only, 1 short
    (longest <= 1024), 2 long."""
    q_lens, kv_lens = _as_int64(q_lens), _as_int64(kv_lens)
    longest = int(np.maximum(q_lens, kv_lens).max()) if q_lens.size else 0
    if longest <= pack_block:
        return 0
    return 1 if longest <= 1024 else 2


@dataclass(frozen=True)
class Schedule:
    """Every tile table one call needs. Forward and backward may pack up to different sizes (their kernels
    have different register budgets); each pass's split depends only on a sequence's own lengths."""

    fwd: TileTable
    dq: TileTable
    dkv: TileTable
    short_bwd: TileTable
    packed_fwd: PackTable
    packed_bwd: PackTable
    profile: int
    # What a backend derives from these tables (its own dealing, device copies), kept as long as the schedule is.
    derived: dict = field(default_factory=dict, compare=False, repr=False)


def split_short_queries(q_lens, seqs, short_block: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The listed sequences split into (two-pass, short-query): short when 1 <= q_len <= short_block and
    group == 1 (short_block 0: none). Sequences without queries stay two-pass: their keys' zero dK and dV are
    written by key tiles."""
    q_lens, seqs = _as_int64(q_lens), _as_int64(seqs)
    if short_block <= 0 or group != 1:
        return seqs, seqs[:0]
    short = (q_lens[seqs] >= 1) & (q_lens[seqs] <= short_block)
    return seqs[~short], seqs[short]


def build_schedule(q_lens, kv_lens, *, q_heads: int, kv_heads: int, window: int | None, causal: bool,
                   fwd_blocks: tuple[int, int], dq_blocks: tuple[int, int], dkv_blocks: tuple[int, int],
                   short_bwd_blocks: tuple[int, int], pack_fwd: int, pack_bwd: int) -> Schedule:
    """Tile tables of all kernels. *_blocks are (query block, key block) sizes of each kernel (the short-query
    backward's query block is the longest query sequence it takes, (0, 0): none); pack_* the packed tile
    sizes of the forward and backward (0: no packing)."""
    q_lens, kv_lens = _as_int64(q_lens), _as_int64(kv_lens)
    main_fwd, packed_fwd = split_packable(q_lens, kv_lens, pack_fwd)
    main_bwd, packed_bwd = split_packable(q_lens, kv_lens, pack_bwd)
    group = q_heads // kv_heads
    main_bwd, short_bwd = split_short_queries(q_lens, main_bwd, short_bwd_blocks[0], group)
    return Schedule(
        fwd=query_tiles(q_lens, kv_lens, main_fwd, fwd_blocks[0], fwd_blocks[1], window, causal, q_heads),
        dq=query_tiles(q_lens, kv_lens, main_bwd, dq_blocks[0], dq_blocks[1], window, causal, q_heads),
        dkv=key_tiles(q_lens, kv_lens, main_bwd, dkv_blocks[1], dkv_blocks[0], window, causal, kv_heads, group),
        short_bwd=query_tiles(q_lens, kv_lens, short_bwd, short_bwd_blocks[0], short_bwd_blocks[1], window, causal,
                              q_heads) if short_bwd_blocks[0] else _empty_table(q_heads),
        packed_fwd=pack_tiles(q_lens, kv_lens, packed_fwd, pack_fwd),
        packed_bwd=pack_tiles(q_lens, kv_lens, packed_bwd, pack_bwd),
        profile=profile_class(q_lens, kv_lens, max(pack_fwd, pack_bwd)),
    )


# ---------------------------------------------------------------------------------------------------------
# Host references of the kernels' dealing (used by tests and for load-balance analysis).


def zigzag_tile(round_index, pid, n_programs):
    """Tile index program `pid` takes in round `round_index` under STATIC scheduling."""
    offset = np.where(np.asarray(round_index) % 2 == 0, pid, n_programs - 1 - np.asarray(pid))
    return np.asarray(round_index) * n_programs + offset


def zigzag_assignment(n_tiles: int, n_programs: int) -> list[np.ndarray]:
    """The tiles each program processes under STATIC scheduling, in its order."""
    rounds = -(-n_tiles // n_programs) if n_programs else 0
    out = []
    for pid in range(n_programs):
        tiles = zigzag_tile(np.arange(rounds), pid, n_programs)
        out.append(tiles[tiles < n_tiles])
    return out


def dynamic_assignment(work: np.ndarray, n_programs: int) -> list[np.ndarray]:
    """Tiles per program under DYNAMIC scheduling if every tile takes `work` time (greedy LPT simulation)."""
    import heapq

    work = np.asarray(work, dtype=np.float64)
    n = work.size
    out: list[list[int]] = [[] for _ in range(n_programs)]
    heap = []
    for pid in range(min(n_programs, n)):
        out[pid].append(pid)
        heapq.heappush(heap, (work[pid], pid))
    for t in range(n_programs, n):
        finish, pid = heapq.heappop(heap)
        out[pid].append(t)
        heapq.heappush(heap, (finish + work[t], pid))
    return [np.asarray(x, dtype=np.int64) for x in out]


def makespan(assignment: list[np.ndarray], work: np.ndarray) -> float:
    """The largest total work of one program."""
    work = np.asarray(work, dtype=np.float64)
    return max((float(work[a].sum()) for a in assignment), default=0.0)


# ---------------------------------------------------------------------------------------------------------
# Host-made lists of tiles per program (the TLX short-query pass walks them instead of dealing on the device).


@dataclass(frozen=True)
class ProgramLists:
    """A table's tiles as persistent programs walk them from a host-made list: program p takes rows
    [starts[p], starts[p + 1]) of `rows` in order; row i is (tile, dest), tile an index of the table's
    heads-adjacent tiles (`TileTable.tile`), dest the sequence at whose dq rows the program stores the dq it
    has accumulated when tile i ends a *segment* (-1 otherwise: it keeps accumulating). `sources`: per head,
    the sequences whose dq rows hold a segment of that head, in list order (-1 padding), the partials a
    reduction over sequences sums; None when every tile is a segment of its own (dest = its sequence)."""

    rows: np.ndarray  # int32 [n_tiles, 2]
    starts: np.ndarray  # int32 [n_programs + 1]
    sources: np.ndarray | None  # int32 [heads, max segments of a head]


def program_lists(table: TileTable, n_programs: int, accumulate: bool) -> ProgramLists:
    """The tiles of `table` dealt to `n_programs` persistent programs.

    accumulate=False: the static zigzag dealing, every tile its own segment (dq stored after each).
    accumulate=True (broadcast_q's dq, a sum over the sequences that share the query rows): the tiles
    head-major (head 0's, then head 1's, ...; within a head the table's heaviest, lightest, second heaviest,
    ...) cut into n_programs contiguous chunks whose largest cost (a tile's key blocks + 1) is the least
    possible, each chunk ending a segment wherever its head changes and at its end. A program then sums its
    sequences' dq in registers and stores one partial per segment (about n_programs + heads in all) where it
    stored one per tile, and the reduction over sequences reads those alone. The dealing is static, so the
    sums and their order are the same on every run of the same lengths and programs: dq stays deterministic."""
    heads, n_tiles = table.heads, table.n_tiles
    seqs = table.entries[:, 0].astype(np.int64)
    if not accumulate:
        dealt = zigzag_assignment(n_tiles, n_programs)
        order = np.concatenate([np.zeros(0, np.int64), *dealt])
        starts = np.r_[0, np.cumsum([a.size for a in dealt], dtype=np.int64)]
        rows = np.stack([order, seqs[order // heads]], axis=1)
        return ProgramLists(np.ascontiguousarray(rows, dtype=np.int32), starts.astype(np.int32), None)
    # Within a head the entries go heaviest, lightest, second heaviest, ...: every chunk then holds a mix of
    # heavy and light tiles, so a tile's fixed costs beyond its key blocks (its setup and the Q load it waits
    # for) weigh about the same in every chunk, as the zigzag dealing's equal tile counts make them.
    n = table.n_entries
    mixed = np.stack([np.arange(n), n - 1 - np.arange(n)], axis=1).ravel()[:n]
    entry = np.tile(mixed.astype(np.int64), heads)
    head = np.repeat(np.arange(heads, dtype=np.int64), table.n_entries)
    order = entry * heads + head
    starts = _balanced_cuts(table.work[entry] + 1, n_programs)
    chunk_end = np.zeros(n_tiles, dtype=bool)
    chunk_end[starts[1:][starts[1:] > 0] - 1] = True
    segment_end = chunk_end | np.r_[head[1:] != head[:-1], True]
    segment_start = np.r_[True, segment_end[:-1]] if n_tiles else segment_end
    first_seq = seqs[entry][segment_start]
    dest = np.full(n_tiles, -1, dtype=np.int64)
    dest[segment_end] = first_seq
    segment_heads = head[segment_end]
    per_head = np.bincount(segment_heads, minlength=heads)
    sources = np.full((heads, int(per_head.max(initial=0))), -1, dtype=np.int64)
    rank = np.arange(segment_heads.size) - np.repeat(np.cumsum(per_head) - per_head, per_head)
    sources[segment_heads, rank] = first_seq
    rows = np.stack([order, dest], axis=1)
    return ProgramLists(np.ascontiguousarray(rows, dtype=np.int32), starts.astype(np.int32),
                        np.ascontiguousarray(sources, dtype=np.int32))


def _balanced_cuts(cost: np.ndarray, n_parts: int) -> np.ndarray:
    """starts [n_parts + 1] of the split of `cost` (int64, > 0) into n_parts contiguous chunks whose largest total
    is the least possible (the linear partition problem: a binary search on that total, each bound checked by
    filling chunks greedily up to it); trailing chunks may be empty."""
    ends = np.cumsum(cost)
    total = int(ends[-1]) if ends.size else 0

    def greedy(cap: int) -> list[int] | None:
        cuts, start = [0], 0
        while start < ends.size and len(cuts) <= n_parts:
            start = int(np.searchsorted(ends, (ends[start - 1] if start else 0) + cap, side="right"))
            cuts.append(start)
        return cuts if start >= ends.size else None

    lo = max(-(-total // max(n_parts, 1)), int(cost.max(initial=0)))  # no chunk can hold less than this
    hi = lo + int(cost.max(initial=0))  # greedy filling to the mean plus one tile always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    cuts = greedy(lo) or [0]
    return np.asarray(cuts + [ends.size] * (n_parts + 1 - len(cuts)), dtype=np.int64)
