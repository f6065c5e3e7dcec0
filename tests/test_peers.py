"""The FlexAttention adapter's block mask, built from the offsets, against the visibility rule pair by pair."""

from __future__ import annotations

import pytest
import torch

from fixtures import case_from_id, make_inputs
from jfa.mask import visible_torch
from jfa.peers import FLEX_BLOCK, jagged_block_tables
from verify.context import problem_of

pytest.importorskip("torch.nn.attention.flex_attention")


def dense_visibility(problem) -> torch.Tensor:
    """[Tq, Tk] bool: query row r sees key row c (same sequence and visible under the contract's rule)."""
    q_seq = torch.repeat_interleave(torch.arange(problem.batch), problem.q_lens)
    kv_seq = torch.repeat_interleave(torch.arange(problem.batch), problem.kv_lens)
    i = torch.arange(problem.out_rows) - problem.out_offsets_host[q_seq]
    j = torch.arange(problem.kv_rows) - problem.kv_offsets_host[kv_seq]
    same = q_seq[:, None] == kv_seq[None, :]
    return same & visible_torch(i[:, None], j[None, :], problem.q_lens[q_seq][:, None],
                                problem.kv_lens[q_seq][:, None], problem.window, problem.causal)


def block_table(num: torch.Tensor, index: torch.Tensor, kv_blocks: int) -> torch.Tensor:
    """[q_blocks, kv_blocks] bool from BlockMask's (count, packed indices) layout; no block listed twice."""
    num, index = num[0, 0], index[0, 0]
    table = torch.zeros(num.shape[0], kv_blocks, dtype=torch.long)
    for row, (count, indices) in enumerate(zip(num.tolist(), index, strict=True)):
        table[row].index_add_(0, indices[:count].long(), torch.ones(count, dtype=torch.long))
    assert table.max() <= 1 if table.numel() else True, "a key block listed twice in one row block"
    return table.bool()


@pytest.mark.parametrize("case_id", ["uniform:0", "empty_middle:1", "many_tiny:0", "causal_q_ne_kv:0", "window:1",
                                     "window_causal:0", "broadcast_q:1", "block_edges:0", "independent_qkv:1",
                                     # long sequences, so that whole blocks are visible (full blocks)
                                     "spec:q=5.700.0.300.520,kv=9.700.40.0.260,d=32",
                                     "spec:q=5.700.0.300.520,kv=9.700.40.0.260,d=32,causal",
                                     "spec:q=5.700.0.300.520,kv=9.700.40.0.260,d=32,w=200"])
def test_block_mask_covers_every_visible_pair_and_full_blocks_are_full(case_id):
    problem = problem_of(make_inputs(case_from_id(case_id), torch.device("cpu")))
    kv_num, kv_index, full_num, full_index = jagged_block_tables(problem, torch.device("cpu"))
    visible = dense_visibility(problem)
    q_blocks, kv_blocks = -(-problem.out_rows // FLEX_BLOCK), -(-problem.kv_rows // FLEX_BLOCK)
    padded = torch.zeros(q_blocks * FLEX_BLOCK, kv_blocks * FLEX_BLOCK, dtype=torch.bool)
    padded[:problem.out_rows, :problem.kv_rows] = visible
    tiles = padded.view(q_blocks, FLEX_BLOCK, kv_blocks, FLEX_BLOCK)
    any_visible, all_visible = tiles.any(3).any(1), tiles.all(3).all(1)

    partial = block_table(kv_num, kv_index, kv_blocks)
    full = block_table(full_num, full_index, kv_blocks)
    assert not (partial & full).any(), "a block both partial and full"
    assert not (any_visible & ~(partial | full)).any(), "a block with visible pairs is missing"
    assert not (full & ~all_visible).any(), "a full block has pairs the rule hides (mask_mod would be skipped)"
    assert torch.equal(full, all_visible), "a block every pair of which is visible is not marked full"
    assert full.any() or problem.out_rows < 512, "long sequences without a full block: the test proves nothing"
