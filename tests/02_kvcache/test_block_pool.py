"""BlockPool (rung 3): exact allocation/eviction order, touch, free, collision defence."""
import pytest

from kvcache import BlockPool, hash_block_tokens


def queue_ids(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def chain(*token_blocks, hash_fn=hash):
    out, parent = [], None
    for toks in token_blocks:
        h = hash_block_tokens(parent, toks, hash_fn=hash_fn)
        out.append(h)
        parent = h.hash_value
    return out


def test_get_new_blocks_pops_the_head_and_sets_ref():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2] and all(b.ref_cnt == 1 for b in blocks)
    assert queue_ids(pool) == [3, 4] and pool.get_usage() == pytest.approx(0.6)
    with pytest.raises(ValueError, match="cannot get 3 free blocks: only 2 of 5"):
        pool.get_new_blocks(3)
    assert queue_ids(pool) == [3, 4]          # the failed call changed nothing
    pool.check_invariants()


def test_cached_block_survives_free_and_is_evicted_only_when_popped():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    hashes = chain((1, 2), (3, 4))
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [2, 3, 1, 0]
    assert pool.get_cached_block(hashes[0]) is blocks[0]      # free AND still a hit
    pool.touch([blocks[0]])                                  # hit: out of the middle of the queue
    assert queue_ids(pool) == [2, 3, 1] and blocks[0].ref_cnt == 1
    new = pool.get_new_blocks(3)                             # pops 2, 3, then 1 -> evicts hashes[1]
    assert [b.block_id for b in new] == [2, 3, 1]
    assert pool.get_cached_block(hashes[1]) is None and blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[0]) is blocks[0] and pool.num_evictions == 1
    pool.check_invariants()


def test_touch_of_a_held_block_only_counts():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2 and queue_ids(pool) == [1, 2]
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and queue_ids(pool) == [1, 2]
    pool.free_blocks([b])
    assert queue_ids(pool) == [1, 2, 0]


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="block 0 freed twice"):
        pool.free_blocks([b, a, a])
    assert a.ref_cnt == 1 and b.ref_cnt == 1 and queue_ids(pool) == [2, 3]
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="block 0 freed twice"):
        pool.free_blocks([a])
    other = BlockPool(4).get_new_blocks(1)
    with pytest.raises(ValueError, match="does not belong"):
        pool.free_blocks(other)
    pool.check_invariants()


def test_duplicate_hashes_are_kept_and_evicted_one_by_one():
    pool = BlockPool(4)
    (h,) = chain((7, 7))
    x, y = pool.get_new_blocks(2)
    pool.cache_full_blocks([x], [h], 0, 1)
    pool.cache_full_blocks([y], [h], 0, 1)      # same content computed twice: both kept
    assert list(pool.cached_block_hash_to_block[h.hash_value]) == [0, 1]
    pool.free_blocks([x, y])
    pool.get_new_blocks(3)                      # pops 2, 3, then block 0
    assert list(pool.cached_block_hash_to_block[h.hash_value]) == [1]
    assert pool.get_cached_block(h) is y
    pool.check_invariants()


def test_collision_defence_verifies_tokens():
    def weak(obj):                              # a terrible hash: every block collides
        return 42
    pool_plain, pool_checked = BlockPool(4), BlockPool(4, verify_tokens=True)
    (stored,) = chain((1, 2, 3), hash_fn=weak)
    (other,) = chain((4, 5, 6), hash_fn=weak)
    assert stored.hash_value == other.hash_value and stored.token_ids != other.token_ids
    for pool in (pool_plain, pool_checked):
        (b,) = pool.get_new_blocks(1)
        pool.cache_full_blocks([b], [stored], 0, 1)
    # Without the check, a different block's tokens "hit": a silently wrong answer.
    assert pool_plain.get_cached_block(other) is not None
    assert pool_checked.get_cached_block(other) is None and pool_checked.num_collisions == 1
    assert pool_checked.get_cached_block(stored) is not None


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    (h,) = chain((1,))
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert pool.reset_prefix_cache() is False and pool.get_cached_block(h) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and blocks[0].block_hash is None
    pool.check_invariants()


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        BlockPool(0)
    with pytest.raises(ValueError, match="eviction_policy"):
        BlockPool(4, eviction_policy="mru")
    pool = BlockPool(2)
    b = pool.get_new_blocks(1)
    (h,) = chain((1,))
    pool.cache_full_blocks(b, [h], 0, 1)
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_blocks(b, [h], 0, 1)
