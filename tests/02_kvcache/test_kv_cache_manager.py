"""KVCacheManager's contract (shared with chapter 03): exact block ids, orders and counts,
in the style of vLLM's tests/v1/core/test_prefix_caching.py."""
import pytest

from kvcache import KVCacheBlocks, KVCacheManager, RequestTooLargeError, SimpleRequest

B = 4


def req(rid, tokens, **kw):
    return SimpleRequest(rid, list(tokens), **kw)


def queue_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def schedule_prefill(m, r):
    """What a scheduler does for a waiting request: look up, then allocate the rest."""
    hit, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, n, hit)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
        m.cache_blocks(r, r.num_computed_tokens)   # ... the forward pass writes the K/V: now cache it
    return hit, n, new


def snapshot(m):
    return (queue_ids(m), [b.ref_cnt for b in m.block_pool.blocks],
            {h: sorted(d) for h, d in m.block_pool.cached_block_hash_to_block.items()},
            {r: [b.block_id for b in bl] for r, bl in m.req_to_blocks.items()}, dict(m.num_cached_block))


def test_prefill_hit_shares_full_blocks_and_caches_the_rest():
    m = KVCacheManager(10, B)
    a = req("a", range(10))                      # blocks [0..3] [4..7] [8 9]
    hit, n, new = schedule_prefill(m, a)
    assert (hit.get_block_ids(), n, new.get_block_ids()) == ([], 0, [0, 1, 2])
    assert m.num_cached_block["a"] == 2          # the partial third block is not cached
    b = req("b", list(range(8)) + [50, 51, 52])
    hit, n, new = schedule_prefill(m, b)
    assert (hit.get_block_ids(), n, new.get_block_ids()) == ([0, 1], 8, [3])
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in m.block_pool.blocks[:4]] == [2, 2, 1, 1]
    assert queue_ids(m) == [4, 5, 6, 7, 8, 9]
    m.check_invariants()


def test_get_computed_blocks_takes_no_references():
    m = KVCacheManager(6, B)
    a = req("a", range(9))
    schedule_prefill(m, a)
    m.free(a)
    before = snapshot(m)
    hit, n = m.get_computed_blocks(req("b", range(9)))
    assert (hit.get_block_ids(), n) == ([0, 1], 8)
    assert snapshot(m) == before


def test_never_hits_the_whole_prompt():
    """At least one token must be computed: its logits are what the step samples from."""
    m = KVCacheManager(8, B)
    schedule_prefill(m, req("a", range(8)))      # two full blocks, both cached
    hit, n = m.get_computed_blocks(req("b", range(8)))
    assert (hit.get_block_ids(), n) == ([0], 4)
    hit, n = m.get_computed_blocks(req("c", range(9)))
    assert (hit.get_block_ids(), n) == ([0, 1], 8)


def test_recomputed_last_block_becomes_a_duplicate_of_the_cached_one():
    m = KVCacheManager(8, B)
    schedule_prefill(m, req("a", range(8)))
    b = req("b", range(8))
    hit, n, new = schedule_prefill(m, b)
    assert (hit.get_block_ids(), new.get_block_ids()) == ([0], [2])
    h1 = m.req_to_block_hashes["b"][1].hash_value
    assert sorted(m.block_pool.cached_block_hash_to_block[h1]) == [1, 2]   # append-only tables: both kept
    m.check_invariants()


def test_lookup_is_skipped_when_disabled_or_already_computed():
    m = KVCacheManager(8, B, enable_caching=False)
    a = req("a", range(9))
    schedule_prefill(m, a)
    m.free(a)
    assert m.get_computed_blocks(req("b", range(9))) == (KVCacheBlocks([]), 0)
    assert m.req_to_block_hashes == {} and m.block_pool.cached_block_hash_to_block == {}
    assert m.stats.requests == 0
    m.check_invariants()
    m2 = KVCacheManager(8, B)
    schedule_prefill(m2, req("a", range(9)))
    assert m2.get_computed_blocks(req("c", range(9), num_computed_tokens=1)) == (KVCacheBlocks([]), 0)


def test_a_request_that_must_compute_everything_reads_no_hit_but_fills_the_cache():
    """skip_reading_prefix_cache (a request that wants its prompt's logprobs): no hit for it, but the
    blocks it computes are cached, and a plain request then hits them."""
    m = KVCacheManager(8, B)
    schedule_prefill(m, req("a", range(9)))
    full = req("b", range(9), skip_reading_prefix_cache=True)
    hit, n, _ = schedule_prefill(m, full)
    assert (hit, n) == (KVCacheBlocks([]), 0)
    m.free(full)
    assert m.get_computed_blocks(req("c", range(9)))[1] == 8
    m.check_invariants()


def test_stats_count_tokens_and_intervals_reset():
    m = KVCacheManager(10, B)
    schedule_prefill(m, req("a", range(10)))             # query 10, hit 0
    schedule_prefill(m, req("b", range(9)))              # query 9, hit 8
    s = m.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (2, 19, 8) and s.hit_rate == pytest.approx(8 / 19)
    schedule_prefill(m, req("c", list(range(4)) + [99] * 5))   # query 9, hit 4
    s = m.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 9, 4)
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == (3, 28, 12)


def test_decode_allocates_a_block_every_block_size_tokens_and_caches_as_blocks_fill():
    m = KVCacheManager(8, B)
    r = req("r", range(7))
    schedule_prefill(m, r)
    assert m.get_block_ids("r") == [0, 1] and m.num_cached_block["r"] == 1
    new_ids = []
    for t in range(100, 106):                   # sample a token, then compute it next step
        r.append_output_token_ids(t)
        new = m.allocate_slots(r, 1)
        new_ids.append(new.get_block_ids())
        r.num_computed_tokens += 1
        m.cache_blocks(r, r.num_computed_tokens)
    # tokens 8..13: a new block when token 9 (index 8) and token 13 (index 12) arrive
    assert new_ids == [[], [2], [], [], [], [3]]
    assert m.num_cached_block["r"] == 3 and len(m.req_to_block_hashes["r"]) == 3
    m.check_invariants()


def test_allocate_returns_none_without_any_state_change():
    m = KVCacheManager(4, B)
    a = req("a", range(12))
    schedule_prefill(m, a)
    before = snapshot(m)
    assert m.allocate_slots(req("b", range(100, 109)), 9) is None
    assert snapshot(m) == before


def test_fit_check_counts_touched_free_blocks_as_taken():
    m = KVCacheManager(5, B)
    a = req("a", range(9))
    schedule_prefill(m, a)                      # blocks 0, 1 cached; 2 partial
    m.free(a)
    assert queue_ids(m) == [3, 4, 2, 1, 0]
    schedule_prefill(m, req("c", [77] * 3))     # holds block 3
    b = req("b", list(range(8)) + [60] * 12)    # 20 tokens: hits 0, 1 and needs 3 more blocks
    hit, n = m.get_computed_blocks(b)
    assert (hit.get_block_ids(), n) == ([0, 1], 8)
    # 4 blocks are free, but 2 of them are the hits themselves: only 2 are left for 3 new.
    before = snapshot(m)
    assert m.allocate_slots(b, 12, 8, hit) is None
    assert snapshot(m) == before
    m.check_invariants()


def test_allocate_with_a_hit_pops_after_touching():
    m = KVCacheManager(5, B)
    a = req("a", range(9))
    schedule_prefill(m, a)
    m.free(a)                                   # queue [3, 4, 2, 1, 0]
    b = req("b", list(range(8)) + [60] * 12)
    hit, n, new = schedule_prefill(m, b)
    assert (hit.get_block_ids(), new.get_block_ids()) == ([0, 1], [3, 4, 2])
    assert m.get_block_ids("b") == [0, 1, 3, 4, 2] and queue_ids(m) == []
    m.check_invariants()


def test_lookahead_slots_are_allocated_but_never_cached():
    m = KVCacheManager(8, B)
    r = req("r", range(8))
    new = m.allocate_slots(r, 8, num_lookahead_tokens=5)     # 13 slots -> 4 blocks
    assert new.get_block_ids() == [0, 1, 2, 3]
    r.num_computed_tokens = 8
    m.cache_blocks(r, 8)
    assert m.num_cached_block["r"] == 2
    # Next step: 1 verified token + 3 drafts scheduled and computed; only verified tokens
    # (num_tokens) are cached, whatever the caller says was computed.
    r.append_output_token_ids(8)
    new = m.allocate_slots(r, 4)
    m.cache_blocks(r, 12)
    assert new.get_block_ids() == [] and m.num_cached_block["r"] == 2
    m.check_invariants()


def test_blocks_are_cached_only_once_their_kv_is_computed():
    """allocate_slots registers nothing: a block allocated for tokens about to be computed (or
    loaded from a remote prefill) must not be hit before its K/V exists. If the request is
    freed first (preempted in the step that scheduled it), its blocks go back unhashed."""
    m = KVCacheManager(8, B)
    r = req("r", range(9))
    m.allocate_slots(r, 9)
    assert m.num_cached_block["r"] == 0
    assert m.get_computed_blocks(req("x", range(9)))[1] == 0
    r.num_computed_tokens = 9
    m.cache_blocks(r, 9)                                 # the forward pass (or the load) landed
    assert m.num_cached_block["r"] == 2
    assert m.get_computed_blocks(req("y", range(9)))[1] == 8
    s = req("s", range(100, 109))
    m.allocate_slots(s, 9)
    m.free(s)                                            # never computed: never hittable
    assert m.get_computed_blocks(req("z", range(100, 109)))[1] == 0
    assert not m.block_pool.cached_block_hash_to_block.keys() - {h.hash_value for h in m.req_to_block_hashes["r"]}
    m.check_invariants()


def test_free_is_tail_first_and_keeps_hashes():
    m = KVCacheManager(8, B)
    a = req("a", range(10))
    schedule_prefill(m, a)
    m.free(a)
    assert queue_ids(m) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.get_computed_blocks(req("b", range(10)))[1] == 8
    with pytest.raises(ValueError, match="holds no blocks for request 'a'"):
        m.free(a)
    with pytest.raises(ValueError, match="holds no blocks for request 'nope'"):
        m.free(req("nope", [1]))
    m.check_invariants()


def test_preempted_request_keeps_hashes_finished_request_drops_them():
    m = KVCacheManager(8, B)
    r = req("r", range(10))
    schedule_prefill(m, r)
    hashes = list(m.req_to_block_hashes["r"])
    m.free(r)                                   # recompute preemption
    r.num_computed_tokens = 0
    assert m.req_to_block_hashes["r"] == hashes
    hit, n, new = schedule_prefill(m, r)        # it comes back and hits its own blocks
    assert (hit.get_block_ids(), n, new.get_block_ids()) == ([0, 1], 8, [3])   # 2 was queued behind 3
    m.free(r)
    m.free_block_hashes(r)                      # finished
    assert "r" not in m.req_to_block_hashes
    m.free_block_hashes(r)                      # idempotent
    m.check_invariants()


def test_impossible_request_raises_instead_of_returning_none():
    m = KVCacheManager(4, B)
    with pytest.raises(RequestTooLargeError, match="needs 5 blocks .* only 4: it can never be scheduled"):
        m.allocate_slots(req("big", range(17)), 17)
    assert m.num_free_blocks == 4 and m.req_to_blocks == {}


def test_stale_prefix_hit_is_rejected():
    m = KVCacheManager(4, B)
    a = req("a", range(9))
    schedule_prefill(m, a)
    m.free(a)                                   # queue [3, 2, 1, 0], blocks 0, 1 cached
    b = req("b", range(9))
    hit, n = m.get_computed_blocks(b)
    schedule_prefill(m, req("c", [5] * 16))     # evicts 1 and 0 before b allocates
    with pytest.raises(ValueError, match="stale prefix hit for request 'b'"):
        m.allocate_slots(b, 1, n, hit)
    m.check_invariants()


def test_inconsistent_arguments_raise():
    m = KVCacheManager(8, B)
    r = req("r", range(9))
    hit, n = m.get_computed_blocks(r)
    with pytest.raises(ValueError, match="must equal the hit blocks"):
        m.allocate_slots(r, 9, 4, hit)
    with pytest.raises(ValueError, match=">= 0"):
        m.allocate_slots(r, -1)
    with pytest.raises(ValueError, match="K/V would be nowhere"):
        m.allocate_slots(req("x", range(9), num_computed_tokens=4), 5)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0)
    with pytest.raises(ValueError, match="free_order"):
        KVCacheManager(8, 4, free_order="random")
    with pytest.raises(ValueError, match="holds no blocks"):
        m.get_block_ids("r")


def test_usage_free_blocks_and_reset():
    m = KVCacheManager(8, B)
    a = req("a", range(10))
    schedule_prefill(m, a)
    assert m.num_free_blocks == 5 and m.usage == pytest.approx(3 / 8)
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.usage == 0.0 and m.num_free_blocks == 8
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(req("b", range(10)))[1] == 0
    m.check_invariants()


def test_salted_and_lora_requests_do_not_share():
    m = KVCacheManager(12, B)
    schedule_prefill(m, req("a", range(9), cache_salt="alice"))
    assert m.get_computed_blocks(req("b", range(9), cache_salt="bob"))[1] == 0
    assert m.get_computed_blocks(req("c", range(9)))[1] == 0
    assert m.get_computed_blocks(req("d", range(9), cache_salt="alice"))[1] == 8
    assert m.get_computed_blocks(req("e", range(9), cache_salt="alice", lora_int_id=2))[1] == 0
