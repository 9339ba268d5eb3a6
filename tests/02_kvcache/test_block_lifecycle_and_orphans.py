"""A cached block's life, and the orphans a chain can leave behind, as exact tests: the hard
questions about the prefix cache of [vLLM 2.0 part 2, §6.3.3] (the `test_q<n>_` prefixes).

Q1 block lifecycle FREE -> ACTIVE -> CACHED -> EVICTED with exact free-queue order;
Q2 orphaned blocks (a parent evicted while a child stays cached), vLLM's tail-first free
   order and the chain-aware policy that prevent them, compared by hit rate;
Q3 why matching must start from the front (which is what makes an orphan unreachable).
(Q4, the cache's layout under tensor parallelism, changes nothing in the block manager.)
"""
import pytest
import torch

from kvcache import KVCacheManager, SimpleRequest

SYS = list(range(1000, 1032))               # a 32-token system prompt (2 blocks of 16)


def queue_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def state(m, block_id):
    b = m.block_pool.blocks[block_id]
    if b.ref_cnt > 0:
        return "ACTIVE"
    return "CACHED" if b.block_hash is not None else "FREE"


def prefill(m, r):
    hit, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, n, hit)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    m.cache_blocks(r, r.num_computed_tokens)           # the forward pass wrote the K/V
    return hit.get_block_ids(), new.get_block_ids()


def test_q1_block_lifecycle_timeline():
    """The timeline of [vLLM 2.0 part 2, §6.3.3 Q1] (10 blocks of 16 tokens), with vLLM's tail-first free order."""
    m = KVCacheManager(num_blocks=10, block_size=16)
    assert queue_ids(m) == list(range(10)) and state(m, 0) == "FREE"
    a = SimpleRequest("A", SYS + [1] * 10)             # 42 tokens: 2 full blocks + 10
    assert prefill(m, a) == ([], [0, 1, 2])
    assert queue_ids(m) == [3, 4, 5, 6, 7, 8, 9]
    assert [state(m, i) for i in (0, 1, 2)] == ["ACTIVE"] * 3
    assert m.num_cached_block["A"] == 2                # block 2 is partial: not cached

    b = SimpleRequest("B", SYS + [2] * 10)             # same system prompt
    assert prefill(m, b) == ([0, 1], [3])
    assert [m.block_pool.blocks[i].ref_cnt for i in (0, 1, 3)] == [2, 2, 1]

    m.free(a)                                          # 2 -> queue; 1, 0 still held by B
    assert queue_ids(m) == [4, 5, 6, 7, 8, 9, 2]
    m.free(b)                                          # tail first: 3, then 1, then 0
    assert queue_ids(m) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert [state(m, i) for i in (0, 1, 2, 3)] == ["CACHED", "CACHED", "FREE", "FREE"]

    c = SimpleRequest("C", list(range(5000, 5080)))    # 5 blocks, no hit: pops the 5 oldest
    assert prefill(m, c) == ([], [4, 5, 6, 7, 8])
    assert m.stats.evictions == 0
    sys_hashes = m.req_to_block_hashes["A"]
    d = SimpleRequest("D", list(range(6000, 6064)))    # 4 blocks: 9, 2, 3, then CACHED block 1 is evicted
    assert prefill(m, d) == ([], [9, 2, 3, 1])
    assert m.stats.evictions == 1 and state(m, 1) == "ACTIVE"
    assert m.block_pool.get_cached_block(sys_hashes[1]) is None       # EVICTED: now holds D's K/V
    assert queue_ids(m) == [0] and state(m, 0) == "CACHED"
    e = SimpleRequest("E", SYS + [3] * 10)             # block 0 survived: still a 16-token hit
    assert m.get_computed_blocks(e)[1] == 16
    m.check_invariants()


def orphan_scenario(free_order, policy):
    """Request A caches a 3-block chain; then X needs 3 blocks from a 6-block pool."""
    m = KVCacheManager(num_blocks=6, block_size=4, free_order=free_order, eviction_policy=policy)
    a = SimpleRequest("A", list(range(13)))            # blocks 0, 1, 2 full (cached), 3 partial
    prefill(m, a)
    m.free(a)
    x_blocks = prefill(m, SimpleRequest("X", list(range(100, 109))))[1]
    return m, x_blocks


def test_q2_head_first_free_orphans_the_chain():
    m, x_blocks = orphan_scenario("forward", "lru")    # the order of [vLLM 2.0 part 2, §6.3.3]: queue [4, 5, 0, 1, 2, 3]
    assert x_blocks == [4, 5, 0]                       # the chain's HEAD is evicted first
    assert m.block_pool.count_orphans() == 2           # blocks 1 and 2: cached, unreachable
    hashes = m.req_to_block_hashes["A"]
    assert m.block_pool.get_cached_block(hashes[1]) is m.block_pool.blocks[1]
    assert m.get_computed_blocks(SimpleRequest("A2", list(range(13))))[1] == 0
    m.check_invariants()


def test_q2_chain_aware_eviction_takes_the_tail_first():
    m, x_blocks = orphan_scenario("forward", "chain_aware")
    assert x_blocks == [4, 5, 2]                       # subtree of block 0 hoisted leaf-first: 2, 1, 0
    assert m.block_pool.count_orphans() == 0 and m.block_pool.num_chain_reorders == 1
    assert queue_ids(m) == [1, 0, 3]
    assert m.get_computed_blocks(SimpleRequest("A2", list(range(13))))[1] == 8
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "chain_aware"])
def test_q2_vllm_tail_first_free_needs_no_chain_awareness(policy):
    m, x_blocks = orphan_scenario("reverse", policy)   # queue [4, 5, 3, 2, 1, 0]
    assert x_blocks == [4, 5, 3]                       # the partial block goes first, no eviction at all
    assert m.block_pool.count_orphans() == 0 and m.block_pool.num_chain_reorders == 0
    assert m.get_computed_blocks(SimpleRequest("A2", list(range(13))))[1] == 12


def test_q2_hit_rate_ranking_on_the_scenario():
    hits = {(o, p): orphan_scenario(o, p)[0].get_computed_blocks(SimpleRequest("A2", list(range(13))))[1]
            for o in ("forward", "reverse") for p in ("lru", "chain_aware")}
    assert hits == {("forward", "lru"): 0, ("forward", "chain_aware"): 8,
                    ("reverse", "lru"): 12, ("reverse", "chain_aware"): 12}


def test_q3_matching_stops_at_the_first_miss():
    m, _ = orphan_scenario("forward", "lru")           # block 0 evicted; blocks 1 and 2 still cached
    r = SimpleRequest("A2", list(range(13)))
    hashes = m.req_to_block_hashes["A"]
    found = [m.block_pool.get_cached_block(h) is not None for h in hashes]
    assert found == [False, True, True]
    assert m.get_computed_blocks(r)[1] == 0            # later hits are worthless without block 0


def test_q3_why_a_block_is_useless_without_the_blocks_before_it():
    """Block 1's K/V are exactly right, but the query at position 8 attends to positions
    0..8: without block 0's K/V (positions 0..3) the attention output is a different number."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, generator=g)                 # the query at position 8, head_dim 8
    k, v = torch.randn(9, 8, generator=g), torch.randn(9, 8, generator=g)

    def attend(keys, values):
        return torch.softmax(q @ keys.T / 8 ** 0.5, dim=-1) @ values

    full = attend(k, v)
    skip_block0 = attend(k[4:], v[4:])                 # "start matching at block 1"
    assert not torch.allclose(full, skip_block0, atol=1e-3)
