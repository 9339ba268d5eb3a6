"""prepare_inputs: exact layouts, and a property test against a per-token loop.

(The attention metadata itself is chapter 01's build_attention_metadata, tested there; these
tests check what prepare_inputs adds — input_ids, positions, logits_indices — and the composition.)"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.model_inputs import prepare_inputs


def test_mixed_step_exact():
    """A prefill of 5, a decode at position 6, and a chunk of 3 after 4 cached tokens; block size 4."""
    inputs = prepare_inputs(new_token_ids=[[10, 11, 12, 13, 14], [20], [30, 31, 32]],
                            num_computed_tokens=[0, 6, 4],
                            block_ids=[[7, 2], [5, 9], [3, 8]], block_size=4)
    md = inputs.attn_metadata
    assert inputs.input_ids.tolist() == [10, 11, 12, 13, 14, 20, 30, 31, 32]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 6, 4, 5, 6]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert md.slot_mapping.tolist() == [28, 29, 30, 31, 8, 38, 32, 33, 34]
    assert md.block_tables.tolist() == [[7, 2], [5, 9], [3, 8]]
    assert md.seq_lens.tolist() == [5, 7, 7]
    assert md.query_start_loc.tolist() == [0, 5, 6, 9]
    assert (md.max_query_len, md.max_seq_len) == (5, 7)
    assert inputs.logits_indices.tolist() == [4, 5, 8]
    assert md.block_tables.dtype == md.seq_lens.dtype == md.query_start_loc.dtype == torch.int32
    assert md.slot_mapping.dtype == inputs.positions.dtype == inputs.input_ids.dtype == torch.int64


def test_block_table_rows_padded_with_zero():
    md = prepare_inputs([[1], [2] * 9], [0, 0], [[4], [6, 1, 3]], block_size=4).attn_metadata
    assert md.block_tables.tolist() == [[4, 0, 0], [6, 1, 3]]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 16]))
def test_matches_per_token_loop(data, block_size):
    num_reqs = data.draw(st.integers(1, 6))
    computed = data.draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs))
    new = data.draw(st.lists(st.integers(1, 12), min_size=num_reqs, max_size=num_reqs))
    pool = list(range(6 * (52 + 2)))                                   # enough blocks for the largest draw
    random.Random(data.draw(st.integers(0, 2**16))).shuffle(pool)
    block_ids, used = [], 0
    for c, n in zip(computed, new):
        k = -(-(c + n) // block_size) + data.draw(st.integers(0, 2))     # sometimes more blocks than needed
        block_ids.append(list(pool[used:used + k]))
        used += k
    tokens = [[data.draw(st.integers(0, 500)) for _ in range(n)] for n in new]
    inputs = prepare_inputs(tokens, computed, block_ids, block_size)
    md = inputs.attn_metadata
    exp_pos, exp_slots, exp_last = [], [], []
    for c, n, blocks in zip(computed, new, block_ids):
        for pos in range(c, c + n):
            exp_pos.append(pos)
            exp_slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        exp_last.append(len(exp_pos) - 1)
    assert inputs.input_ids.tolist() == [t for ts in tokens for t in ts]
    assert inputs.positions.tolist() == exp_pos
    assert inputs.logits_indices.tolist() == exp_last
    assert md.slot_mapping.tolist() == exp_slots
    assert len(set(exp_slots)) == len(exp_slots)                          # no two tokens share a slot
    assert md.seq_lens.tolist() == [c + n for c, n in zip(computed, new)]


def test_bad_input():
    with pytest.raises(ValueError, match="request 1 needs 9 slots but holds 2 blocks of 4"):
        prepare_inputs([[1, 2, 3], [4] * 4], [0, 5], [[0], [1, 2]], block_size=4)
    with pytest.raises(ValueError, match=r"num_new_tokens >= 1 for each, got \[1, 0\]"):
        prepare_inputs([[1], []], [0, 3], [[0], [1]], block_size=4)
    with pytest.raises(ValueError, match="one entry per request"):
        prepare_inputs([[1], [1]], [0], [[0], [1]], block_size=4)


def test_append_tokens_is_append_token_for_each_row():
    """A decode step's vectorized write (one token into each of several rows, in any order)
    leaves the batch exactly as one append_token per row does; a full row refuses, changing nothing."""
    import numpy as np

    from mini_vllm.input_batch import CachedRequestState, InputBatch
    from mini_vllm.sampling_params import SamplingParams

    def batch():
        b = InputBatch(4, 8, 2)
        for i, prompt in enumerate([[1, 2], [3], [4, 5, 6], [7] * 7]):
            b.add_request(CachedRequestState(f"r{i}", prompt, SamplingParams(), None, [i], len(prompt)))
        return b

    one, many = batch(), batch()
    for row, token in [(2, 30), (0, 10), (1, 20)]:
        one.append_token(row, token)
    many.append_tokens(np.array([2, 0, 1]), np.array([30, 10, 20], dtype=np.int32))
    assert (one.token_ids == many.token_ids).all() and (one.num_tokens == many.num_tokens).all()
    many.append_tokens(np.array([3]), np.array([40], dtype=np.int32))      # row 3 reaches max_model_len
    before = many.token_ids.copy(), many.num_tokens.copy()
    with pytest.raises(IndexError, match="max_model_len"):
        many.append_tokens(np.array([0, 3]), np.array([11, 41], dtype=np.int32))
    assert (many.token_ids == before[0]).all() and (many.num_tokens == before[1]).all()
