"""Exact tests for block tables, slot mapping and the metadata builder (ids and slots are
integers: every expected value is written out)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from paged_attention import (
    build_attention_metadata,
    compute_slot_mapping,
    make_block_tables,
    slot_mapping_for_request,
)


def test_slot_mapping_for_request_worked_example():
    # block table [7, 23, 4], block size 16: positions 18..20 live in logical block 1 -> physical 23
    assert slot_mapping_for_request([7, 23, 4], 18, 3, 16) == [370, 371, 372]
    # crossing a block boundary: 31 is the last slot of block 23, 32 the first of block 4
    assert slot_mapping_for_request([7, 23, 4], 31, 2, 16) == [23 * 16 + 15, 4 * 16 + 0]
    assert slot_mapping_for_request([7, 23, 4], 0, 0, 16) == []


def test_slot_mapping_for_request_out_of_range():
    with pytest.raises(IndexError, match="need more than the 3 blocks"):
        slot_mapping_for_request([7, 23, 4], 40, 9, 16)   # position 48 has no block
    with pytest.raises(ValueError, match=">= 0"):
        slot_mapping_for_request([7], -1, 1, 16)


def test_make_block_tables_pads_rows():
    table = make_block_tables([[7, 23, 4], [2], []])
    assert table.dtype == torch.int32
    assert table.tolist() == [[7, 23, 4], [2, 0, 0], [0, 0, 0]]
    assert make_block_tables([[5]], max_num_blocks=3, pad_id=-1).tolist() == [[5, -1, -1]]
    assert make_block_tables([]).shape == (0, 0)


def test_make_block_tables_rejects_bad_rows():
    with pytest.raises(ValueError, match="max_num_blocks=1"):
        make_block_tables([[1, 2]], max_num_blocks=1)
    with pytest.raises(ValueError, match="negative block id"):
        make_block_tables([[1, -3]])


def test_batch_metadata_matches_hand_computed_slots():
    # A: prefill 5 tokens into block 0; B: decode its 17th token (position 16) into its
    # second block, 8; C: prefill 3 tokens into block 1. Block size 16.
    md = build_attention_metadata([[0], [3, 8], [1]], num_computed_tokens=[0, 16, 0],
                                  num_new_tokens=[5, 1, 3], block_size=16)
    assert md.slot_mapping.tolist() == [0, 1, 2, 3, 4, 128, 16, 17, 18]
    assert md.slot_mapping.dtype == torch.int64
    assert md.block_tables.tolist() == [[0, 0], [3, 8], [1, 0]]
    assert md.seq_lens.tolist() == [5, 17, 3]
    assert md.query_start_loc.tolist() == [0, 5, 6, 9]
    assert (md.max_query_len, md.max_seq_len) == (5, 17)
    assert md.context_lens.tolist() == [0, 16, 0]
    assert not md.is_pure_decode


def test_build_attention_metadata_rejects_too_few_blocks():
    with pytest.raises(ValueError, match="needs 17 slots but holds 1 blocks of 16"):
        build_attention_metadata([[3]], [16], [1], 16)


def test_compute_slot_mapping_checks_ranges():
    table = make_block_tables([[7, 23], [4]])
    own = torch.tensor([2, 1])
    with pytest.raises(IndexError, match="position 32 of request 0 is past its own 2 blocks of 16"):
        compute_slot_mapping(table, torch.tensor([0, 0]), torch.tensor([0, 32]), 16, num_blocks_per_req=own)
    with pytest.raises(IndexError, match="positions must be >= 0"):
        compute_slot_mapping(table, torch.tensor([0]), torch.tensor([-1]), 16, num_blocks_per_req=own)
    with pytest.raises(IndexError, match="req_indices"):
        compute_slot_mapping(table, torch.tensor([2]), torch.tensor([0]), 16, num_blocks_per_req=own)
    with pytest.raises(ValueError, match="both be \\[num_tokens\\]"):
        compute_slot_mapping(table, torch.tensor([0, 1]), torch.tensor([0]), 16, num_blocks_per_req=own)
    with pytest.raises(ValueError, match="num_blocks_per_req must be \\[num_seqs=2\\]"):
        compute_slot_mapping(table, torch.tensor([0]), torch.tensor([0]), 16, num_blocks_per_req=own[:1])
    with pytest.raises(ValueError, match="rows hold 2 entries"):
        compute_slot_mapping(table, torch.tensor([0]), torch.tensor([0]), 16, num_blocks_per_req=torch.tensor([3, 1]))


def test_position_in_a_requests_padding_column_raises():
    """Request 1 holds ONE block (4); its row is padded with block 0 to the table's width 2.
    Position 16 is inside the padded width (2 x 16) but past its own block: with the old
    width check it got slot 0 * 16 + 0 — a write into block 0, which belongs to nobody here
    and to somebody in an engine. Checked against the request's own blocks, it raises."""
    table = make_block_tables([[7, 23], [4]])                 # [[7, 23], [4, 0]]
    own = torch.tensor([2, 1])
    with pytest.raises(IndexError, match="position 16 of request 1 is past its own 1 blocks of 16"):
        compute_slot_mapping(table, torch.tensor([0, 1]), torch.tensor([20, 16]), 16, num_blocks_per_req=own)
    # Without the counts the check cannot be made: refused rather than done against the padded width.
    with pytest.raises(ValueError, match="needs num_blocks_per_req"):
        compute_slot_mapping(table, torch.tensor([1]), torch.tensor([16]), 16)
    # In range: exact slots; the hot path (check_values=False) needs no counts.
    expected = [23 * 16 + 4, 4 * 16 + 15]
    assert compute_slot_mapping(table, torch.tensor([0, 1]), torch.tensor([20, 15]), 16,
                                num_blocks_per_req=own).tolist() == expected
    assert compute_slot_mapping(table, torch.tensor([0, 1]), torch.tensor([20, 15]), 16,
                                check_values=False).tolist() == expected


def test_slot_mapping_accepts_views_of_its_inputs():
    """Transposed block tables, strided and offset index tensors: same slots (torch indexing reads views)."""
    table = make_block_tables([[7, 23, 4], [2, 9]])
    req = torch.tensor([9, 0, 9, 1, 9, 1])[1::2]              # [0, 1, 1], storage offset 1, stride 2
    pos = torch.tensor([[40, 0], [3, 0], [17, 0]])[:, 0]       # stride 2
    own = torch.tensor([[3, 2]]).t()[:, 0]                    # a column view
    t_table = table.t().contiguous().t()                       # column-major
    got = compute_slot_mapping(t_table, req, pos, 16, num_blocks_per_req=own)
    assert got.tolist() == [4 * 16 + 8, 2 * 16 + 3, 9 * 16 + 1]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 16, 256]))
def test_vectorized_slot_mapping_equals_per_request_loop(data, block_size):
    """compute_slot_mapping (batched, vLLM v1 style) == the clear per-request loop, and every
    slot decodes back to (its request's block at pos // B, offset pos % B)."""
    num_reqs = data.draw(st.integers(1, 5))
    computed = data.draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs))
    new = data.draw(st.lists(st.integers(0, 20), min_size=num_reqs, max_size=num_reqs))
    ids = list(range(1000))
    data.draw(st.randoms()).shuffle(ids)   # arbitrary, distinct physical ids
    block_ids, k = [], 0
    for c, n in zip(computed, new):
        nb = -(-(c + n) // block_size)
        block_ids.append(ids[k:k + nb])
        k += nb
    md = build_attention_metadata(block_ids, computed, new, block_size)
    expected = [s for b, c, n in zip(block_ids, computed, new) for s in slot_mapping_for_request(b, c, n, block_size)]
    assert md.slot_mapping.tolist() == expected
    t = 0
    for b, c, n in zip(block_ids, computed, new):
        for pos in range(c, c + n):
            slot = expected[t]
            assert (slot // block_size, slot % block_size) == (b[pos // block_size], pos % block_size)
            t += 1
    assert len(set(expected)) == len(expected)   # distinct tokens never share a slot
