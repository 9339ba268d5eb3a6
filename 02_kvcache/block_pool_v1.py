"""BlockPool, rung 1 of the ladder: allocate and free, nothing else.

This is all PagedAttention itself needs [Kwon 2025, §3.4.2]: fixed-size blocks handed out
from a free list, so a request's KV grows one block at a time with no reservation and
no external fragmentation. What it lacks: when a request finishes, its K/V is thrown
away, so the next request with the same system prompt computes it all again (rung 2).

The engine's CPU swap tier uses this rung: swapped-out blocks are private to one request
and never shared or looked up by content, so a plain free list is exactly right.
"""
from __future__ import annotations


class BlockPoolV1:
    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # A stack (LIFO: the block freed last is reused first, still warm in any cache).
        # Reversed so the first allocation hands out ids 0, 1, 2, ...
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._allocated = [False] * num_blocks

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self.free_block_ids):
            raise ValueError(f"out of blocks: asked for {num_blocks}, {len(self.free_block_ids)} of {self.num_blocks} free")
        ### BEGIN SOLUTION
        ids = [self.free_block_ids.pop() for _ in range(num_blocks)]
        for i in ids:
            self._allocated[i] = True
        return ids
        ### END SOLUTION

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool. Unknown ids and double frees raise before anything changes."""
        seen = set()
        for i in block_ids:
            if not (isinstance(i, int) and 0 <= i < self.num_blocks):
                raise ValueError(f"block id {i!r} is not in this pool [0, {self.num_blocks})")
            if not self._allocated[i] or i in seen:
                raise ValueError(f"block {i} freed twice (it is not allocated)")
            seen.add(i)
        ### BEGIN SOLUTION
        for i in block_ids:
            self._allocated[i] = False
            self.free_block_ids.append(i)
        ### END SOLUTION
