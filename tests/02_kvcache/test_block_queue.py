"""FreeKVCacheBlockQueue: exact orders, O(1) removal from the middle, clear errors."""
import pytest

from kvcache import FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue):
    return [b.block_id for b in queue.get_all_free_blocks()]


def make(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_initial_order_is_block_id_order():
    _, q = make(5)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5


def test_popleft_append_remove_from_the_middle():
    blocks, q = make(6)
    assert q.popleft() is blocks[0]
    q.remove(blocks[3])                       # the prefix-hit case: out of the middle
    assert ids(q) == [1, 2, 4, 5] and len(q) == 4
    q.append(blocks[0])
    q.append(blocks[3])
    assert ids(q) == [1, 2, 4, 5, 0, 3]
    q.remove(blocks[1])                       # the head
    q.remove(blocks[3])                       # the tail
    assert ids(q) == [2, 4, 5, 0]
    q.appendleft(blocks[3])
    assert ids(q) == [3, 2, 4, 5, 0] and len(q) == 5
    # Links of a dequeued block are cleared: the block itself knows it is not queued.
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None


def test_drain_and_refill():
    blocks, q = make(3)
    popped = [q.popleft() for _ in range(3)]
    assert popped == blocks and len(q) == 0 and ids(q) == []
    with pytest.raises(ValueError, match="empty"):
        q.popleft()
    for b in reversed(blocks):
        q.append(b)
    assert ids(q) == [2, 1, 0]


def test_errors_do_not_corrupt_the_queue():
    blocks, q = make(3)
    q.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    assert ids(q) == [0, 2] and len(q) == 2


def test_block_decr_ref_below_zero_raises():
    b = KVCacheBlock(7)
    b.incr_ref()
    b.decr_ref()
    with pytest.raises(ValueError, match="block 7 freed twice"):
        b.decr_ref()
    assert b.ref_cnt == 0
