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
