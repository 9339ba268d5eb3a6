"""The teaching ladder: v1 (allocate/free) -> v2 (+ hash table, never evicts) -> v3 (+ LRU).
Each rung's own behaviour, and the flaw of v2 that v3 fixes, on the same workload."""
import pytest

from kvcache import BlockPool, BlockPoolV1, BlockPoolV2, SimpleRequest, hash_request_tokens


def test_v1_allocates_low_ids_first_and_reuses_lifo():
    pool = BlockPoolV1(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1, 0])
    assert pool.get_num_free_blocks() == 3
    assert pool.allocate(2) == [0, 1]           # the block freed last comes back first
    with pytest.raises(ValueError, match="out of blocks: asked for 2, 1 of 4 free"):
        pool.allocate(2)


def test_v1_bad_frees_raise_before_changing_anything():
    pool = BlockPoolV1(4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="block 1 freed twice"):
        pool.free([0, 1, 1])
    with pytest.raises(ValueError, match="block 3 freed twice"):
        pool.free([3])
    with pytest.raises(ValueError, match="not in this pool"):
        pool.free([9])
    assert pool.get_num_free_blocks() == 2


def test_v2_shares_a_cached_prefix_by_ref_count():
    pool = BlockPoolV2(6)
    a = SimpleRequest("a", list(range(8)))
    ha = hash_request_tokens(4, a)
    blocks = pool.allocate(2)
    for b, h in zip(blocks, ha):
        pool.cache_block(b, h)
    hit = pool.get_cached_block(ha[0])
    pool.touch(hit)
    assert hit is blocks[0] and hit.ref_cnt == 2
    pool.free(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 0]
    assert pool.get_num_free_blocks() == 4      # block 1 is parked, not free
    assert pool.get_cached_block(ha[1]) is blocks[1]


def run_distinct_prompts(pool_kind, num_requests=6, num_blocks=8, blocks_per_request=3):
    """Each request: look up its prefix, allocate the rest, cache its full blocks, finish."""
    B = 4
    pool = BlockPoolV2(num_blocks) if pool_kind == "v2" else BlockPool(num_blocks)
    for r in range(num_requests):
        req = SimpleRequest(f"r{r}", [1000 * r + t for t in range(B * blocks_per_request)])
        hashes = hash_request_tokens(B, req)
        if pool_kind == "v2":
            blocks = pool.allocate(blocks_per_request)
            for b, h in zip(blocks, hashes):
                pool.cache_block(b, h)
            pool.free(blocks)
        else:
            blocks = pool.get_new_blocks(blocks_per_request)
            pool.cache_full_blocks(blocks, hashes, 0, blocks_per_request)
            pool.free_blocks(reversed(blocks))
    return pool


def test_v2_runs_out_of_memory_with_nothing_in_use_v3_does_not():
    with pytest.raises(ValueError, match=r"out of blocks: asked for 3, 2 free, 6 parked"):
        run_distinct_prompts("v2")
    v3 = run_distinct_prompts("v3")
    assert v3.get_num_free_blocks() == 8 and v3.num_evictions == 18 - 8
    v3.check_invariants()
