"""Contiguous-block grouping [vLLM 2.0 part 2, §7.3.3]: exact cases, invariants under random input,
and that the grouped transfers move exactly the bytes the per-block copies would."""
import ctypes

import pytest
import torch
from hypothesis import given, settings, strategies as st

from global_prefix_cache.grouping import Region, build_transfer_params, group_concurrent_contiguous


def test_the_published_example():
    assert group_concurrent_contiguous([5, 6, 7, 12, 13], [2, 3, 4, 8, 9]) == ([[5, 6, 7], [12, 13]], [[2, 3, 4], [8, 9]])


def test_a_break_on_either_side_splits():
    assert group_concurrent_contiguous([1, 2, 3], [7, 9, 10]) == ([[1], [2, 3]], [[7], [9, 10]])
    assert group_concurrent_contiguous([1, 3, 4], [7, 8, 9]) == ([[1], [3, 4]], [[7], [8, 9]])
    assert group_concurrent_contiguous([4, 3], [1, 2]) == ([[4], [3]], [[1], [2]])     # descending is not a run
    assert group_concurrent_contiguous([], []) == ([], [])


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 source blocks but 2"):
        group_concurrent_contiguous([1, 2, 3], [1, 2])


pairs = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(pairs)
def test_groups_are_maximal_runs_that_cover_the_input(pairs):
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    gs, gd = group_concurrent_contiguous(src, dst)
    assert sum(gs, []) == src and sum(gd, []) == dst                 # nothing lost, order kept
    for a, b in zip(gs, gd):
        assert len(a) == len(b) >= 1
        assert all(y - x == 1 for x, y in zip(a, a[1:])) and all(y - x == 1 for x, y in zip(b, b[1:]))
    for i in range(1, len(gs)):                                      # no two neighbours could merge
        assert not (gs[i][0] == gs[i - 1][-1] + 1 and gd[i][0] == gd[i - 1][-1] + 1)


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(12))), st.integers(1, 12), st.integers(0, 10))
def test_grouped_transfers_equal_per_block_copies(perm, n, seed):
    """Two 'nodes' with 2 K/V tensors each; move n blocks src->dst (scattered) with the grouped
    (addr, addr, len) list and compare with copying block by block."""
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(12, 4, 2, 3, generator=g) for _ in range(2)]
    dst = [torch.zeros(16, 4, 2, 3) for _ in range(2)]
    src_ids, dst_ids = sorted(perm[:n]), perm[:n]
    block_len = src[0][0].nbytes
    s_regions = [Region(t.data_ptr(), block_len, 12) for t in src]
    d_regions = [Region(t.data_ptr(), block_len, 16) for t in dst]
    buffers, peers, lengths = build_transfer_params(s_regions, d_regions, src_ids, dst_ids)
    for b, p, ln in zip(buffers, peers, lengths):
        ctypes.memmove(p, b, ln)
    expected = [torch.zeros(16, 4, 2, 3) for _ in range(2)]
    for e, s in zip(expected, src):
        for a, b in zip(src_ids, dst_ids):
            e[b] = s[a]
    assert all(torch.equal(a, b) for a, b in zip(dst, expected))
    groups = len(group_concurrent_contiguous(src_ids, dst_ids)[0])
    assert len(lengths) == 2 * groups and sum(lengths) == 2 * n * block_len


def test_build_transfer_params_rejects_mismatched_layouts():
    a, b = Region(1000, 64, 8), Region(5000, 32, 8)
    with pytest.raises(ValueError, match="64-byte blocks at the source but 32"):
        build_transfer_params([a], [b], [0], [0])
    with pytest.raises(ValueError, match="1 source K/V tensors but 2"):
        build_transfer_params([a], [a, a], [0], [0])
    with pytest.raises(ValueError, match="destination block id out of range"):
        build_transfer_params([a], [Region(5000, 64, 8)], [0], [8])
