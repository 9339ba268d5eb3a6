"""One physical KV block's metadata, and the free queue that orders free blocks for eviction.

Mirrors `KVCacheBlock` and `FreeKVCacheBlockQueue` in vLLM's `vllm/v1/core/kv_cache_utils.py`.

Why a hand-written doubly linked list instead of `collections.deque` or an `OrderedDict`:
a prefix-cache hit must pull a block out of the MIDDLE of the free queue (it is no longer
an eviction candidate), and that has to be O(1). A deque removes from the middle in O(n).
An OrderedDict would work, but the links live inside the block objects here, so the queue
allocates nothing per operation and a block knows by itself whether it is queued.

The queue uses two sentinel blocks (fake head and tail, id -1) so that every real block
always has both neighbours: append/remove/popleft have no empty-list or end-of-list branches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kvcache.hashing import BlockHash


@dataclass(eq=False)  # identity semantics: two blocks are never "equal" unless they are the same block
class KVCacheBlock:
    block_id: int
    # How many block tables (requests) point at this block. 0 <=> the block is in the free queue.
    ref_cnt: int = 0
    # Set when the block is full and registered in the prefix cache; None otherwise.
    block_hash: BlockHash | None = None
    # Links of the free queue (None while the block is held, i.e. ref_cnt > 0).
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def incr_ref(self) -> None:
        self.ref_cnt += 1

    def decr_ref(self) -> None:
        if self.ref_cnt <= 0:
            raise ValueError(f"block {self.block_id} freed twice: its ref_cnt is already {self.ref_cnt}")
        self.ref_cnt -= 1

    def reset_hash(self) -> None:
        self.block_hash = None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else hex(self.block_hash.hash_value & 0xFFFF)
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order: head = least recently freed = evicted first.

    Holds every block with ref_cnt == 0, cached (has a hash, still reusable by a prefix hit)
    or not. Allocation pops the head; freeing appends at the tail; a prefix hit removes the
    block from wherever it is. All O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        """Link `blocks` in their order between the two sentinels. With no blocks the sentinels
        point at each other: an empty queue is usable (append works from the first block on)."""
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        ### BEGIN SOLUTION
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev
        ### END SOLUTION

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (the eviction victim); its links are cleared, as by
        `remove`. ValueError ("no free blocks: the free queue is empty") when nothing is free."""
        ### BEGIN SOLUTION
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail:
            raise ValueError("no free blocks: the free queue is empty")
        self.remove(block)
        return block
        ### END SOLUTION

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is in the queue. O(1): this is the point of the list.
        Clears the block's two links (a block not in the queue has both None) and counts it out.
        ValueError ("block N is not in the free queue") for a block that is not queued, with the
        queue unchanged."""
        ### BEGIN SOLUTION
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        ### END SOLUTION

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail: the most recently freed block is evicted last. ValueError
        ("block N is already in the free queue") if it is queued already, with the queue unchanged."""
        ### BEGIN SOLUTION
        self._insert_between(block, self.fake_free_list_tail.prev_free_block, self.fake_free_list_tail)
        ### END SOLUTION

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the head, to be reused first (chain-aware eviction sends blocks
        that no lookup can reach any more here). vLLM's LRU policy never needs this."""
        self._insert_between(block, self.fake_free_list_head, self.fake_free_list_head.next_free_block)

    def _insert_between(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = nxt
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (eviction order). O(n): for tests, pictures and invariant checks."""
        return list(self)
