"""The Orca baselines' allocator: a binary buddy allocator (exact splits and merges, and
invariants under random use) and the three reservation rules."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import RequestTooLargeError
from scheduler import Request
from scheduler.reservation import BuddyAllocator, ReservationKVCacheManager, next_power_of_2


def test_next_power_of_2():
    assert [next_power_of_2(n) for n in (1, 2, 3, 4, 5, 25, 32, 33)] == [1, 2, 4, 4, 8, 32, 32, 64]


def test_buddy_splits_and_merges_exactly():
    b = BuddyAllocator(16)
    assert b.free_lists == {4: {0}}
    assert b.allocate(3) == 0                  # rounded to 4: 16 -> 8 + [4] + 4
    assert b.free_lists == {4: set(), 3: {8}, 2: {4}}
    assert b.allocate(1) == 4                  # 4 -> 2 + 1 + [1]
    assert b.allocate(8) == 8
    assert b.allocate(4) is None and b.num_free_units == 3 and b.largest_free_chunk() == 2   # external fragmentation
    b.free(4)                                  # 4 + 5 -> [4,6) + [6,8) -> [4,8); [0,4) is still held
    assert b.free_lists[2] == {4} and b.largest_free_chunk() == 4
    b.free(0)                                  # [0,4) + [4,8) -> [0,8); its buddy [8,16) is held
    assert b.free_lists[3] == {0}
    b.free(8)
    assert b.free_lists[4] == {0} and b.num_free_units == 16
    with pytest.raises(ValueError, match="not allocated"):
        b.free(8)
    b.check_invariants()


def test_buddy_over_a_non_power_of_two_range():
    b = BuddyAllocator(12)
    assert b.free_lists == {3: {0}, 2: {8}}
    assert b.allocate(8) == 0 and b.allocate(4) == 8 and b.allocate(1) is None
    b.free(8)
    b.free(0)
    assert b.free_lists[3] == {0} and b.free_lists[2] == {8}   # never merged past the end
    b.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 100), st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_buddy_random_use_keeps_chunks_aligned_and_disjoint(n, ops):
    b = BuddyAllocator(n)
    initial = {o: set(s) for o, s in b.free_lists.items() if s}
    held = []
    for alloc, size in ops:
        if alloc or not held:
            start = b.allocate(size)
            if start is not None:
                assert start % next_power_of_2(size) == 0
                held.append(start)
        else:
            b.free(held.pop(size % len(held)))
        b.check_invariants()
    for start in held:
        b.free(start)
    assert {o: s for o, s in b.free_lists.items() if s} == initial     # everything merged back


def test_reservation_sizes_per_mode():
    r = Request("a", list(range(10)), max_tokens=25)
    sizes = {mode: ReservationKVCacheManager(64, 4, mode, max_model_len=100).reservation_tokens(r)
             for mode in ("max", "pow2", "oracle")}
    assert sizes == {"max": 100, "pow2": 10 + 32, "oracle": 10 + 25}
    with pytest.raises(ValueError, match="reservation mode"):
        ReservationKVCacheManager(64, 4, "lifo", 100)


def test_reservation_is_taken_at_admission_and_only_touched_afterwards():
    kv = ReservationKVCacheManager(16, 4, "oracle", max_model_len=64)
    r = Request("a", list(range(6)), max_tokens=6)           # 12 tokens -> 3 blocks -> a chunk of 4
    assert kv.allocate_slots(r, 6).get_block_ids() == [0, 1]
    assert kv.num_free_blocks == 12 and kv.usage == pytest.approx(0.25)
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 2).get_block_ids() == [] and kv.get_block_ids("a") == [0, 1]
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1).get_block_ids() == [2]
    with pytest.raises(ValueError, match="reserved only 3"):
        kv.allocate_slots(r, 8)
    kv.free(r)
    assert kv.num_free_blocks == 16
    with pytest.raises(ValueError, match="holds no reservation"):
        kv.free(r)
    kv.check_invariants()


def test_reservation_that_can_never_fit_raises_and_one_that_cannot_fit_now_waits():
    kv = ReservationKVCacheManager(12, 4, "max", max_model_len=64)     # 16 blocks per request, largest chunk 8
    with pytest.raises(RequestTooLargeError, match="largest contiguous region"):
        kv.allocate_slots(Request("a", [1, 2], max_tokens=2), 2)
    kv = ReservationKVCacheManager(12, 4, "max", max_model_len=32)     # 8 blocks per request
    a, b = Request("a", [1], max_tokens=1), Request("b", [2], max_tokens=1)
    assert kv.allocate_slots(a, 1) is not None
    assert kv.allocate_slots(b, 1) is None and "b" not in kv.regions  # 4 blocks free, not 8
