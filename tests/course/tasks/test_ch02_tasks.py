"""Chapter 02's hidden edge cases (tests/course/tasks/conftest.py): rules the public tests do not
reach, each stated in the function's docstring."""
import pytest

from kvcache import FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue):
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_an_empty_queue_links_its_sentinels_and_takes_blocks():
    """A queue made from no blocks is empty but usable: the sentinels point at each other, so
    append, popleft and remove work from the first block on."""
    q = FreeKVCacheBlockQueue([])
    assert len(q) == 0 and ids(q) == []
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head
    with pytest.raises(ValueError, match="empty"):
        q.popleft()
    a, b = KVCacheBlock(0), KVCacheBlock(1)
    q.append(a)
    q.append(b)
    assert ids(q) == [0, 1] and len(q) == 2
    q.remove(a)
    assert q.popleft() is b and len(q) == 0 and ids(q) == []
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail


def test_one_block_queue_and_links_cleared_on_every_way_out():
    """popleft and remove both clear the links of the block they take out (a dequeued block
    knows it is not queued), and the head/tail links stay consistent with one block."""
    only = KVCacheBlock(5)
    q = FreeKVCacheBlockQueue([only])
    assert only.prev_free_block is q.fake_free_list_head and only.next_free_block is q.fake_free_list_tail
    assert q.popleft() is only
    assert only.prev_free_block is None and only.next_free_block is None
    q.append(only)
    q.remove(only)
    assert only.prev_free_block is None and only.next_free_block is None and len(q) == 0
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(only)
    assert len(q) == 0


def test_a_long_queue_keeps_order_through_mixed_operations():
    """Against a plain list: any sequence of popleft / append / remove gives the same order and
    length (the list does in O(n) what the queue does in O(1))."""
    import random
    rng = random.Random(3)
    blocks = [KVCacheBlock(i) for i in range(40)]
    q, model = FreeKVCacheBlockQueue(blocks), list(blocks)
    for _ in range(400):
        op = rng.random()
        if op < 0.35 and model:
            assert q.popleft() is model.pop(0)
        elif op < 0.7 and model:
            b = rng.choice(model)
            q.remove(b)
            model.remove(b)
        else:
            free = [b for b in blocks if b not in model]
            if free:
                b = rng.choice(free)
                q.append(b)
                model.append(b)
        assert len(q) == len(model)
    assert ids(q) == [b.block_id for b in model]


def test_chain_aware_pool_evicts_a_head_first_freed_chain_from_its_tail():
    """BlockPool(eviction_policy="chain_aware") on its own: a cached chain A -> B -> C freed head
    first sits in the queue as A, B, C. Taking a block must not evict A (B and C would become
    orphans: no lookup reaches a block past a miss): the chain below A moves to the head, leaf
    first, so C goes, then B, then A; each hoist is counted once per trip through the queue.
    Plain LRU, the same frees, evicts A first."""
    from kvcache import BlockPool, hash_block_tokens

    def chained(n):
        out, parent = [], None
        for i in range(n):
            h = hash_block_tokens(parent, (10 * i, 10 * i + 1))
            out.append(h)
            parent = h.hash_value
        return out

    def queue_ids(pool):
        return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]

    hashes = chained(3)
    evicted = {}
    for policy in ("lru", "chain_aware"):
        pool = BlockPool(3, eviction_policy=policy)
        a, b, c = pool.get_new_blocks(3)
        pool.cache_full_blocks([a, b, c], hashes, 0, 3)
        pool.free_blocks([a, b, c])                                # head first: A, B, C in the queue
        assert queue_ids(pool) == [0, 1, 2]
        evicted[policy] = [pool.get_new_blocks(1)[0].block_id for _ in range(3)]
        pool.check_invariants()
        if policy == "chain_aware":
            assert pool.num_chain_reorders >= 1
            assert pool.get_cached_block(hashes[0]) is None        # A went last: nothing is left cached
    assert evicted == {"lru": [0, 1, 2], "chain_aware": [2, 1, 0]}
