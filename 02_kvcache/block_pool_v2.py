"""BlockPool, rung 2 of the ladder: + reference counts and a hash table of cached blocks.

A finished request's full blocks now keep their K/V and stay findable by their chained
hash (`kvcache.hashing`), so a later request with the same prefix shares them: ref_cnt
counts the block tables pointing at a block, and it returns to the free list only at 0.

The flaw this rung is built to show: a cached block whose ref_cnt drops to 0 is parked
in the table FOREVER. Nothing ever decides it is no longer worth keeping, so a stream of
distinct prompts fills the pool with dead cache and allocation fails although nothing is
in use (tests/02_kvcache/test_block_pool_ladder.py). Rung 3 (`block_pool.py`) keeps
parked blocks in an LRU free queue instead, where allocation can evict them.
"""
from __future__ import annotations

from kvcache.block import KVCacheBlock
from kvcache.hashing import BlockHash


class BlockPoolV2:
    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))   # stack, ids 0.. first
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash.hash_value)

    def touch(self, block: KVCacheBlock) -> None:
        """A prefix hit: one more block table points at `block`."""
        block.incr_ref()

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self.free_block_ids):
            raise ValueError(f"out of blocks: asked for {num_blocks}, {len(self.free_block_ids)} free, "
                             f"{self.num_cached_unreferenced()} parked in the cache with ref_cnt 0 (rung 2 never evicts)")
        ### BEGIN SOLUTION
        blocks = [self.blocks[self.free_block_ids.pop()] for _ in range(num_blocks)]
        for block in blocks:
            block.incr_ref()
        return blocks
        ### END SOLUTION

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """`block` is full and computed: make it findable by its hash."""
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already cached")
        if block_hash.hash_value in self.cached_block_hash_to_block:
            return   # an identical block is cached already; this one stays private
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash.hash_value] = block

    def free(self, blocks: list[KVCacheBlock]) -> None:
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block.block_id] = counts.get(block.block_id, 0) + 1
            if counts[block.block_id] > block.ref_cnt:
                raise ValueError(f"block {block.block_id} freed twice (ref_cnt {block.ref_cnt})")
        ### BEGIN SOLUTION
        for block in blocks:
            block.decr_ref()
            if block.ref_cnt == 0 and block.block_hash is None:
                self.free_block_ids.append(block.block_id)
            # ref_cnt == 0 with a hash: parked in the table, never to be reclaimed (the flaw).
        ### END SOLUTION

    def num_cached_unreferenced(self) -> int:
        return sum(b.ref_cnt == 0 for b in self.cached_block_hash_to_block.values())
