"""The host tile scheduler (jfa.tile_scheduler): tables, sorting, zigzag and dynamic dealing, packing."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from jfa import tile_scheduler as ts
from jfa.block_info import kv_block_range_np, q_block_range_np


def random_lengths(rng, batch, longest, empty=0.2):
    lens = rng.integers(1, longest + 1, batch)
    lens[rng.random(batch) < empty] = 0
    return lens


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mask", [(None, False), (None, True), (13, False), (5, True)])
def test_query_and_key_tiles(seed, mask):
    window, causal = mask
    rng = np.random.default_rng(seed)
    q_lens = random_lengths(rng, 40, 300)
    kv_lens = random_lengths(rng, 40, 300)
    main, packed = ts.split_packable(q_lens, kv_lens, 32)
    heads = 3

    table = ts.query_tiles(q_lens, kv_lens, main, 64, 32, window, causal, heads)
    want = {(int(b), m) for b in main for m in range(0, int(q_lens[b]), 64)}
    got = [(int(s), int(m)) for s, m in table.entries]
    assert sorted(got) == sorted(want) and len(got) == len(want)
    assert np.all(np.diff(table.work) <= 0), "sorted by work, descending"
    for (s, m0), work in zip(got, table.work, strict=True):
        lo, _, _, hi = kv_block_range_np(m0, min(m0 + 64, int(q_lens[s])), q_lens[s], kv_lens[s], window, 32, causal)
        assert work == (hi - lo) // 32
    assert table.n_tiles == len(want) * heads
    s, m0, head = table.tile(table.n_tiles - 1)
    assert (s, m0) == got[-1] and head == heads - 1

    keys = ts.key_tiles(q_lens, kv_lens, main, 128, 16, window, causal, heads=1, group=3)
    want = {(int(b), n) for b in main for n in range(0, int(kv_lens[b]), 128)}
    got = [(int(s), int(n)) for s, n in keys.entries]
    assert sorted(got) == sorted(want)
    assert np.all(np.diff(keys.work) <= 0)
    for (s, n0), work in zip(got, keys.work, strict=True):
        lo, _, _, hi = q_block_range_np(n0, min(n0 + 128, int(kv_lens[s])), q_lens[s], kv_lens[s], window, 16, causal)
        assert work == (hi - lo) // 16 * 3


def _table_with_runs(rng, heads):
    """A query table over random lengths with sequences of many blocks (runs of at least HEAD_MAJOR_MIN_RUN)
    beside short ones, with no mask or a window (whose blocks away from the edges see equally many keys; a
    causal mask alone gives every block of a sequence its own work, so no runs)."""
    q_lens = random_lengths(rng, 30, 200)
    q_lens[rng.choice(30, 4, replace=False)] = rng.integers(30 * 16, 40 * 16, 4)  # 30-40 blocks of 16
    window, causal = [(None, False), (24, False), (24, True)][rng.integers(3)]
    return ts.query_tiles(q_lens, q_lens, np.flatnonzero(q_lens), 16, 16, window, causal, heads)


@pytest.mark.parametrize("seed", range(6))
def test_runs_deal_every_tile_once_head_major(seed):
    rng = np.random.default_rng(seed)
    heads = int(rng.integers(1, 5))
    table = _table_with_runs(rng, heads)
    rows = table.run_rows
    np.testing.assert_array_equal(rows[:, :2], table.entries)
    first, length = rows[:, 2], rows[:, 3]
    entry = np.arange(table.n_entries)
    assert ((first <= entry) & (entry < first + length)).all()
    seq = table.entries[:, 0]
    # A run is one sequence's adjacent entries, whole (maximal) and long enough; every other entry is alone.
    assert all((seq[f:f + n] == seq[f]).all() for f, n in zip(first, length, strict=True))
    long_runs = length > 1
    assert (length[long_runs] >= ts.HEAD_MAJOR_MIN_RUN).all()
    stretches = [len(list(group)) for _, group in itertools.groupby(seq.tolist())]
    want_long = np.concatenate([[n >= ts.HEAD_MAJOR_MIN_RUN] * n for n in stretches])
    np.testing.assert_array_equal(long_runs, want_long)
    assert long_runs.any() and (~long_runs).any(), "the table has both kinds of entry"

    dealt = [table.tile(t, runs=True) for t in range(table.n_tiles)]
    want = {(int(s), int(b), h) for s, b in table.entries for h in range(heads)}
    assert sorted(dealt) == sorted(want), "every (entry, head) exactly once"
    for f, n in {(int(f), int(n)) for f, n in zip(first, length, strict=True)}:
        block = dealt[f * heads:(f + n) * heads]  # a run's tiles: head-major, its entries in table order
        assert [h for _, _, h in block] == [h for h in range(heads) for _ in range(n)]
        assert [(s, b) for s, b, _ in block] == [tuple(map(int, e)) for e in table.entries[f:f + n]] * heads


def test_runs_of_one_entry_keep_heads_adjacent():
    table = ts.query_tiles([100, 300, 50], [100, 300, 50], np.arange(3), 32, 32, None, False, heads=3)
    assert (table.run_rows[:, 3] == 1).all()
    assert [table.tile(t, runs=True) for t in range(table.n_tiles)] == [table.tile(t) for t in range(table.n_tiles)]
    assert ts._empty_table(3).run_rows.shape == (0, 4)


def test_split_packable():
    q = np.array([0, 0, 5, 40, 16, 0, 33])
    kv = np.array([0, 3, 0, 2, 32, 64, 1])
    main, packed = ts.split_packable(q, kv, 32)
    assert list(packed) == [1, 2, 4]
    assert list(main) == [3, 5, 6]  # sequence 0 has nothing to compute or write
    main, packed = ts.split_packable(q, kv, 0)
    assert packed.size == 0 and list(main) == [1, 2, 3, 4, 5, 6]


def test_short_query_split():
    """Short-query backward tiles: sequences with 1 <= q_len <= the block, only without GQA; one tile per
    sequence (block start 0) and head, sorted by the key blocks visited; the rest keep dq and dkv tiles."""
    q = np.array([0, 5, 40, 128, 129, 300, 0, 64])
    kv = np.array([50, 200, 40, 1000, 50, 7, 0, 0])
    main, packed = ts.split_packable(q, kv, 32)
    assert list(main) == [0, 1, 2, 3, 4, 5, 7]
    two_pass, short = ts.split_short_queries(q, main, 128, group=1)
    assert list(short) == [1, 2, 3, 7] and list(two_pass) == [0, 4, 5]
    two_pass, short = ts.split_short_queries(q, main, 128, group=2)
    assert short.size == 0 and list(two_pass) == list(main)

    sched = ts.build_schedule(q, kv, q_heads=3, kv_heads=3, window=None, causal=False, fwd_blocks=(64, 64),
                              dq_blocks=(64, 64), dkv_blocks=(32, 64), short_bwd_blocks=(128, 64), pack_fwd=32,
                              pack_bwd=32)
    assert sorted(sched.short_bwd.entries[:, 0].tolist()) == [1, 2, 3, 7]
    assert (sched.short_bwd.entries[:, 1] == 0).all() and sched.short_bwd.heads == 3
    assert list(sched.short_bwd.work) == [16, 4, 1, 0]  # key blocks of 64: 1000, 200, 40 and 0 keys
    assert sorted(set(sched.dq.entries[:, 0].tolist())) == [4, 5]
    assert sorted(set(sched.dkv.entries[:, 0].tolist())) == [0, 4, 5]  # sequence 0: zero dk, dv of its keys
    gqa = ts.build_schedule(q, kv, q_heads=4, kv_heads=2, window=None, causal=False, fwd_blocks=(64, 64),
                            dq_blocks=(64, 64), dkv_blocks=(32, 64), short_bwd_blocks=(128, 64), pack_fwd=32,
                            pack_bwd=32)
    assert gqa.short_bwd.n_tiles == 0 and sorted(set(gqa.dq.entries[:, 0].tolist())) == [1, 2, 3, 4, 5, 7]
    off = ts.build_schedule(q, kv, q_heads=3, kv_heads=3, window=None, causal=False, fwd_blocks=(64, 64),
                            dq_blocks=(64, 64), dkv_blocks=(32, 64), short_bwd_blocks=(0, 0), pack_fwd=32,
                            pack_bwd=32)  # no short-query config (head dims above 128)
    assert off.short_bwd.n_tiles == 0 and off.short_bwd.entries.shape == (0, 2) and off.short_bwd.heads == 3
    assert sorted(set(off.dq.entries[:, 0].tolist())) == [1, 2, 3, 4, 5, 7]


def test_pack_tiles():
    rng = np.random.default_rng(3)
    q = rng.integers(0, 65, 500)
    kv = rng.integers(0, 65, 500)
    _, packed = ts.split_packable(q, kv, 64)
    table = ts.pack_tiles(q, kv, packed, 64)
    assert table.seqs.shape == (table.n_groups, 64 // ts.PACK_ALIGN)
    members = table.seqs[table.seqs >= 0]
    assert sorted(members.tolist()) == sorted(packed.tolist()), "every packable sequence exactly once"
    for g in range(table.n_groups):
        slot = 1 << int(table.shift[g])
        assert slot % ts.PACK_ALIGN == 0 and slot <= 64
        row = table.seqs[g]
        used = row[: 64 // slot]
        assert (row[64 // slot:] == -1).all(), "no slot beyond the tile"
        for s in used[used >= 0]:
            longest = max(int(q[s]), int(kv[s]))
            assert longest <= slot and (slot == ts.PACK_ALIGN or longest > slot // 2), "the smallest slot class"
    assert table.n_tiles == table.n_groups
    # What the packed forward reads: each PACK_ALIGN rows' own sequence, the slot's entry repeated over its rows.
    rows = table.row_seqs()
    assert rows.shape == table.seqs.shape and rows.dtype == np.int32
    for g in range(table.n_groups):
        slot_rows = 1 << int(table.shift[g])
        for row in range(0, table.block, ts.PACK_ALIGN):
            assert rows[g, row // ts.PACK_ALIGN] == table.seqs[g, row // slot_rows], (g, row)


def test_tiny_sequences_pack_into_few_tiles():
    rng = np.random.default_rng(4)
    lens = rng.integers(1, 33, 32768)
    main, packed = ts.split_packable(lens, lens, 64)
    assert main.size == 0
    table = ts.pack_tiles(lens, lens, packed, 64)
    # Slots of 16 (4 a tile) and 32 (2 a tile): about 32768 · (1/2 · 1/4 + 1/2 · 1/2) ≈ 12.3k tiles.
    assert table.n_groups < 13000


def test_many_sequences_build_quickly():
    """70,000 sequences (more than a 65,535 grid axis): tables are built vectorised in well under a second,
    and tile indices stay 1-D (persistent grids never need a second axis)."""
    rng = np.random.default_rng(5)
    q = rng.integers(0, 200, 70000)
    kv = rng.integers(0, 200, 70000)
    start = time.perf_counter()
    sched = ts.build_schedule(q, kv, q_heads=4, kv_heads=2, window=None, causal=True, fwd_blocks=(128, 64),
                              dq_blocks=(128, 64), dkv_blocks=(32, 128), short_bwd_blocks=(128, 64), pack_fwd=64,
                              pack_bwd=32)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, elapsed
    assert sched.fwd.n_tiles + sched.dkv.n_tiles > 65535
    assert int(sched.fwd.entries[:, 0].max()) < 70000
    n_packed = int((sched.packed_fwd.seqs >= 0).sum())
    main, packed = ts.split_packable(q, kv, 64)
    assert n_packed == packed.size
    assert sched.profile == 1


def test_profile_class():
    assert ts.profile_class([], [], 64) == 0
    assert ts.profile_class([3, 60], [64, 1], 64) == 0
    assert ts.profile_class([3, 600], [64, 1], 64) == 1
    assert ts.profile_class([3, 6], [64, 4096], 64) == 2


@pytest.mark.parametrize("n_tiles,programs", [(1, 4), (7, 3), (132, 132), (1000, 132), (999, 7)])
def test_zigzag_assignment(n_tiles, programs):
    assignment = ts.zigzag_assignment(n_tiles, programs)
    flat = np.concatenate(assignment) if assignment else np.zeros(0)
    assert sorted(flat.tolist()) == list(range(n_tiles)), "every tile exactly once"
    for pid, tiles in enumerate(assignment):
        for r, t in enumerate(tiles):
            expect = r * programs + (pid if r % 2 == 0 else programs - 1 - pid)
            assert t == expect
    # The first round gives the heaviest tiles to distinct programs; the second runs back.
    if n_tiles >= 2 * programs:
        assert [a[0] for a in assignment] == list(range(programs))
        assert [a[1] for a in assignment] == list(range(2 * programs - 1, programs - 1, -1))


def test_zigzag_balances_sorted_work():
    """With work sorted descending, zigzag keeps every program within one tile of the mean (makespan
    <= mean + max), unlike plain round-robin dealing on skewed work."""
    rng = np.random.default_rng(6)
    for _ in range(20):
        work = np.sort(rng.pareto(1.5, rng.integers(50, 3000)) + 1)[::-1]
        programs = int(rng.integers(2, 140))
        zig = ts.makespan(ts.zigzag_assignment(work.size, programs), work)
        assert zig <= work.sum() / programs + work.max() + 1e-9
        dyn = ts.makespan(ts.dynamic_assignment(work, programs), work)
        assert dyn <= work.sum() / programs + work.max() + 1e-9
        flat = np.concatenate(ts.dynamic_assignment(work, programs))
        assert sorted(flat.tolist()) == list(range(work.size))


def test_kernel_dealing_formula():
    """zigzag_tile is the formula the kernels' next_tile computes (round r, program pid)."""
    for programs in (1, 2, 5):
        for pid in range(programs):
            for r in range(6):
                t = ts.zigzag_tile(r, pid, programs)
                assert t // programs == r
                assert t % programs == (pid if r % 2 == 0 else programs - 1 - pid)


def _short_table(rng, batch, heads):
    q_lens = rng.integers(1, 129, batch)
    kv_lens = random_lengths(rng, batch, 900)
    return ts.query_tiles(q_lens, kv_lens, np.arange(batch), 128, 64, None, False, heads)


@pytest.mark.parametrize("programs", [1, 5, 132])
def test_program_lists_without_accumulation_are_the_zigzag_dealing(programs):
    """accumulate=False: program p walks `zigzag_assignment`'s tiles in its order, each tile a segment of its
    own whose dq goes to its own sequence; no sources (the reduction takes one partial per sequence)."""
    table = _short_table(np.random.default_rng(programs), 60, 3)
    lists = ts.program_lists(table, programs, accumulate=False)
    assert lists.sources is None
    for p, tiles in enumerate(ts.zigzag_assignment(table.n_tiles, programs)):
        rows = lists.rows[lists.starts[p]:lists.starts[p + 1]]
        assert rows[:, 0].tolist() == tiles.tolist()
        assert rows[:, 1].tolist() == [table.tile(int(t))[0] for t in tiles]
    assert lists.starts[-1] == table.n_tiles


def _linear_partition_optimum(cost, parts):
    """The least largest chunk total of `cost` split into at most `parts` contiguous chunks (dynamic programming)."""
    prefix = np.r_[0, np.cumsum(cost)]
    best = np.full((parts + 1, cost.size + 1), np.inf)
    best[0, 0] = 0
    for k in range(1, parts + 1):
        for i in range(cost.size + 1):
            best[k, i] = min(max(best[k - 1, j], prefix[i] - prefix[j]) for j in range(i + 1))
    return best[parts, cost.size]


@pytest.mark.parametrize("seed", range(6))
def test_program_lists_accumulate_per_head_segments(seed):
    """accumulate=True (broadcast_q): every tile once, head-major (head 0's tiles, then head 1's, ...; within a
    head the table's heaviest, lightest, second heaviest, ...), cut into contiguous chunks whose largest cost
    (key blocks + 1 a tile) is the least possible; a segment ends at each head change and at each chunk's end,
    and stores to its first tile's sequence; `sources` lists, per head, exactly those sequences in list order
    (-1 padding). A sequence's rows then hold one segment of a head at most, so no two segments overwrite each
    other."""
    rng = np.random.default_rng(seed)
    heads = int(rng.integers(1, 6))
    table = _short_table(rng, int(rng.integers(1, 30)), heads)
    programs = int(rng.integers(1, 12))
    lists = ts.program_lists(table, programs, accumulate=True)
    n = table.n_entries
    mixed = [n - 1 - i // 2 if i % 2 else i // 2 for i in range(n)]  # heaviest, lightest, second heaviest, ...
    want_order = [e * heads + h for h in range(heads) for e in mixed]
    assert lists.rows[:, 0].tolist() == want_order
    assert lists.starts[0] == 0 and lists.starts[-1] == table.n_tiles and np.all(np.diff(lists.starts) >= 0)
    assert lists.starts.size == programs + 1
    cost = np.asarray([table.work[t // heads] + 1 for t in want_order])
    chunk_costs = [cost[a:b].sum() for a, b in itertools.pairwise(lists.starts)]
    assert max(chunk_costs) == _linear_partition_optimum(cost, programs)
    sources = {h: [] for h in range(heads)}
    for a, b in itertools.pairwise(lists.starts):
        segment_first = None
        for i in range(a, b):
            seq, _, head = table.tile(int(lists.rows[i, 0]))
            segment_first = seq if segment_first is None else segment_first
            ends = i + 1 == b or table.tile(int(lists.rows[i + 1, 0]))[2] != head
            assert lists.rows[i, 1] == (segment_first if ends else -1)
            if ends:
                sources[head].append(segment_first)
                segment_first = None
    for h in range(heads):
        assert len(set(sources[h])) == len(sources[h])
        row = lists.sources[h].tolist()
        assert row[:len(sources[h])] == sources[h] and set(row[len(sources[h]):]) <= {-1}
    assert lists.sources.shape[1] == max(len(s) for s in sources.values())


def test_program_lists_of_an_empty_table():
    table = ts._empty_table(4)
    for accumulate in (False, True):
        lists = ts.program_lists(table, 3, accumulate)
        assert lists.rows.shape == (0, 2) and lists.starts.tolist() == [0, 0, 0, 0]
