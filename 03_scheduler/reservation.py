"""Reservation-based KV allocation: the Orca [Yu 2022] baselines of [Kwon 2025, §3.6.1].

Before PagedAttention, a serving system stored each request's K/V in ONE contiguous region,
so it had to reserve, at admission, room for every token the request might ever have.
The thesis re-implements Orca with a buddy allocator and three reservation rules:

  Orca (Max)     reserve max_model_len tokens (the output length is unknown);
  Orca (Pow2)    reserve prompt + next_power_of_2(output): at most 2x over-reservation;
  Orca (Oracle)  reserve prompt + the exact output length (impossible in practice: an upper bound).

The waste [Kwon 2025, §3.3.1, Fig. 3.2-3.3]: reserved-but-not-yet-used slots, internal
fragmentation (over-reservation, buddy rounding to powers of two) and external
fragmentation (free space split into chunks too small for the next request).

`ReservationKVCacheManager` offers the slice of `kvcache.KVCacheManager`'s interface the
scheduler uses, so the SAME continuous-batching `Scheduler` runs on top of either — the
comparison isolates memory management, exactly the thesis' argument. No prefix caching,
no swapping; a running request never needs more blocks than it reserved, so it is never
preempted (blocks are the allocation unit: one unit = `block_size` token slots).
"""
from __future__ import annotations

from typing import Literal

from kvcache import KVCacheBlock, KVCacheBlocks, RequestTooLargeError
from paged_attention import cdiv

ReservationMode = Literal["max", "pow2", "oracle"]


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class BuddyAllocator:
    """Binary buddy allocator over `num_units` units: a request for n units gets an aligned
    chunk of next_power_of_2(n); freeing merges a chunk with its buddy (start XOR size)
    whenever the buddy is free too. Allocation and free are O(log num_units)."""

    def __init__(self, num_units: int) -> None:
        if num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {num_units}")
        self.num_units = num_units
        self.free_lists: dict[int, set[int]] = {}     # order -> start offsets of free 2**order chunks
        self.allocated: dict[int, int] = {}           # start -> order
        # Carve [0, num_units) into maximal aligned power-of-two chunks (its binary decomposition),
        # so no chunk's buddy can ever be a free chunk outside the range.
        start = 0
        while start < num_units:
            order = (num_units - start).bit_length() - 1
            while start % (1 << order):
                order -= 1
            self.free_lists.setdefault(order, set()).add(start)
            start += 1 << order

    @property
    def num_free_units(self) -> int:
        return sum(len(starts) << order for order, starts in self.free_lists.items())

    def largest_free_chunk(self) -> int:
        return max((1 << o for o, s in self.free_lists.items() if s), default=0)

    def allocate(self, size: int) -> int | None:
        """Start offset of a chunk of next_power_of_2(size) units, or None if none is free."""
        if size < 1:
            raise ValueError(f"allocation size must be >= 1, got {size}")
        want = (size - 1).bit_length()
        ### BEGIN SOLUTION
        order = next((o for o in sorted(self.free_lists) if o >= want and self.free_lists[o]), None)
        if order is None:
            return None
        start = min(self.free_lists[order])        # lowest address first: deterministic
        self.free_lists[order].remove(start)
        while order > want:                        # split: keep the lower half, free the upper buddy
            order -= 1
            self.free_lists.setdefault(order, set()).add(start + (1 << order))
        ### END SOLUTION
        self.allocated[start] = order
        return start

    def free(self, start: int) -> None:
        if start not in self.allocated:
            raise ValueError(f"chunk at {start} is not allocated (double free?)")
        order = self.allocated.pop(start)
        ### BEGIN SOLUTION
        while True:
            buddy = start ^ (1 << order)
            if buddy not in self.free_lists.get(order, ()):
                break
            self.free_lists[order].remove(buddy)   # merge with the free buddy
            start = min(start, buddy)
            order += 1
        ### END SOLUTION
        self.free_lists.setdefault(order, set()).add(start)

    def check_invariants(self) -> None:
        chunks = [(s, 1 << o, "free") for o, starts in self.free_lists.items() for s in starts]
        chunks += [(s, 1 << o, "used") for s, o in self.allocated.items()]
        chunks.sort()
        pos = 0
        for start, size, _ in chunks:
            assert start == pos, f"gap or overlap at unit {pos} (next chunk starts at {start})"
            assert start % size == 0, f"chunk at {start} of size {size} is not aligned"
            pos += size
        assert pos == self.num_units, f"chunks cover {pos} of {self.num_units} units"


class ReservationKVCacheManager:
    """Orca-style contiguous reservation, behind the KV cache manager interface the scheduler
    calls (get_computed_blocks, allocate_slots, free, free_block_hashes, get_block_ids, ...)."""

    cpu_block_pool = None     # no swap tier

    def __init__(self, num_blocks: int, block_size: int, mode: ReservationMode, max_model_len: int) -> None:
        if mode not in ("max", "pow2", "oracle"):
            raise ValueError(f"reservation mode must be 'max', 'pow2' or 'oracle', got {mode!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.mode = mode
        self.max_model_len = max_model_len
        self.allocator = BuddyAllocator(num_blocks)
        self.max_chunk = self.allocator.largest_free_chunk()   # the biggest region that can ever exist
        self.regions: dict[str, tuple[int, int]] = {}      # request_id -> (first block, reserved blocks)
        self.num_touched: dict[str, int] = {}              # request_id -> blocks handed out so far

    def reservation_tokens(self, request) -> int:
        """Slots reserved at admission. Oracle/Pow2 read the true output length: the simulator
        sets max_tokens to it (ignore_eos), so max_tokens IS the output length."""
        if self.mode == "max":
            return self.max_model_len
        output = request.max_tokens if self.mode == "oracle" else next_power_of_2(request.max_tokens)
        return min(self.max_model_len, request.num_prompt_tokens + output)

    def get_computed_blocks(self, request) -> tuple[KVCacheBlocks, int]:
        return KVCacheBlocks.create_empty(), 0          # no prefix caching

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        rid = request.request_id
        if rid not in self.regions:
            reserved = cdiv(self.reservation_tokens(request), self.block_size)
            if next_power_of_2(reserved) > self.max_chunk:
                raise RequestTooLargeError(f"request {rid!r} reserves {reserved} blocks ({self.mode}), more than the "
                                           f"largest contiguous region ({self.max_chunk} blocks) the allocator can form")
            start = self.allocator.allocate(reserved)
            if start is None:
                return None                               # no contiguous chunk that large is free
            self.regions[rid] = (start, reserved)
            self.num_touched[rid] = 0
        start, reserved = self.regions[rid]
        needed = cdiv(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.block_size)
        if needed > reserved:
            raise ValueError(f"request {rid!r} needs {needed} blocks but reserved only {reserved} "
                             f"({self.mode} reservation)")
        first = self.num_touched[rid]
        self.num_touched[rid] = max(first, needed)
        return KVCacheBlocks([KVCacheBlock(start + i) for i in range(first, self.num_touched[rid])])

    def free(self, request) -> None:
        rid = request.request_id
        if rid not in self.regions:
            raise ValueError(f"free: request {rid!r} holds no reservation")
        start, _ = self.regions.pop(rid)
        del self.num_touched[rid]
        self.allocator.free(start)

    def free_block_hashes(self, request) -> None:
        pass                                              # nothing is hashed

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        pass                                              # no prefix caching

    def num_pending_tokens(self, request, num_computed_tokens: int) -> int:
        return 0

    def get_block_ids(self, request_id: str) -> list[int]:
        start, _ = self.regions[request_id]
        return list(range(start, start + self.num_touched[request_id]))

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_units

    @property
    def usage(self) -> float:
        """Fraction of blocks reserved (held, used or not)."""
        return 1.0 - self.allocator.num_free_units / self.num_blocks

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        assert set(self.regions) == set(self.num_touched)
