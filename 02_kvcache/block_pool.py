"""BlockPool, rung 3 of the ladder (the one the engine uses): ref counts + prefix cache +
an O(1) LRU free queue. Rungs 1 and 2 are `block_pool_v1.py` and `block_pool_v2.py`.

Mirrors `BlockPool` in vLLM's `vllm/v1/core/block_pool.py` (get_cached_block,
cache_full_blocks, get_new_blocks, _maybe_evict_cached_block, touch, free_blocks,
reset_prefix_cache, get_usage).

The one idea: a block whose ref_cnt drops to 0 is NOT wiped. It goes to the tail of the
free queue still holding its hash and its K/V. Until allocation pops it from the head
(and only then is its hash evicted), a later request with the same prefix can take it
back out of the middle of the queue: a prefix-cache hit. So "free" and "cached" are not
separate pools — every free block is an eviction candidate, in LRU order:

    block state   ref_cnt   in free queue   has hash
    FREE             0          yes            no      (never used, or evicted)
    ACTIVE          >0          no          maybe      (held by >= 1 request)
    CACHED           0          yes            yes     (reusable until popped)
    EVICTED  = a CACHED block popped by get_new_blocks: hash dropped, handed out as ACTIVE
"""
from __future__ import annotations

from typing import Iterable

from kvcache.block import FreeKVCacheBlockQueue, KVCacheBlock
from kvcache.hashing import NONE_HASH, BlockHash

EVICTION_POLICIES = ("lru", "chain_aware")


class BlockPool:
    """Allocates, frees and caches KV blocks.

    Args:
        num_blocks: physical blocks in the pool (ids 0..num_blocks-1).
        eviction_policy: "lru" (vLLM) or "chain_aware" — LRU that never evicts a block while
            blocks chained after it are still cached (they would become orphans: matching
            stops at the first miss, so no lookup could reach them). See
            `_hoist_descendants_of_head`.
        verify_tokens: the collision defence of [v1 prefix caching]: a hit must also match the stored parent
            hash, token ids and extra keys, not just the hash value. With a 64-bit hash a
            collision is astronomically unlikely; with a weak hash it is a wrong answer.
    """

    def __init__(self, num_blocks: int, eviction_policy: str = "lru", verify_tokens: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction_policy {eviction_policy!r}; choose one of {EVICTION_POLICIES}")
        self.num_blocks = num_blocks
        self.eviction_policy = eviction_policy
        self.verify_tokens = verify_tokens
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # Every block with ref_cnt == 0, head = next to be reused (and evicted).
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash value -> {block_id: block}. More than one block can carry the same hash: two
        # requests that computed the same block before either was cached both keep theirs,
        # because block tables are append-only (a block id handed out is never swapped).
        self.cached_block_hash_to_block: dict[int, dict[int, KVCacheBlock]] = {}
        # parent hash value -> {block_id: cached child}; maintained only for chain_aware.
        self._children: dict[int, dict[int, KVCacheBlock]] = {}
        self.num_evictions = 0        # cached hashes dropped because their block was reused
        self.num_collisions = 0       # lookups whose hash matched but content did not (verify_tokens)
        self.num_chain_reorders = 0   # chain_aware: times a cached subtree was hoisted to the head

    # ---- lookup -------------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block for this hash, or None on a miss. Takes no reference."""
        ### BEGIN SOLUTION
        candidates = self.cached_block_hash_to_block.get(block_hash.hash_value)
        if not candidates:
            return None
        if not self.verify_tokens:
            return next(iter(candidates.values()))
        for block in candidates.values():
            if block.block_hash == block_hash:      # parent hash, tokens and extra keys all equal
                return block
        self.num_collisions += 1                    # same hash value, different content: a miss
        return None
        ### END SOLUTION

    # ---- caching ------------------------------------------------------------------------

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] (now full and about to be
        computed) under block_hashes[i]. Blocks before num_cached_blocks are cached already."""
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(f"cannot cache {num_full_blocks} full blocks: have {len(blocks)} blocks and {len(block_hashes)} hashes")
        ### BEGIN SOLUTION
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                raise ValueError(f"block {block.block_id} is already cached")
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash.hash_value, {})[block.block_id] = block
            if self.eviction_policy == "chain_aware":
                self._children.setdefault(block_hash.parent_hash_value, {})[block.block_id] = block
        ### END SOLUTION

    def _uncache(self, block: KVCacheBlock) -> None:
        """Remove `block` from the hash map (and the children index) and clear its hash."""
        h = block.block_hash
        assert h is not None
        same_hash = self.cached_block_hash_to_block[h.hash_value]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[h.hash_value]
        if self.eviction_policy == "chain_aware":
            siblings = self._children[h.parent_hash_value]
            del siblings[block.block_id]
            if not siblings:
                del self._children[h.parent_hash_value]
        block.reset_hash()

    # ---- allocation ---------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached ones included: all of them can be handed out."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (0..1). Cached-but-free blocks count as free."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue (LRU first), evicting the
        cached hash of each popped block. Each comes back with ref_cnt = 1."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks: only {self.get_num_free_blocks()} of {self.num_blocks} are free")
        ### BEGIN SOLUTION
        new_blocks = []
        for _ in range(num_blocks):
            block = self._pop_victim()
            self._maybe_evict_cached_block(block)
            block.incr_ref()
            new_blocks.append(block)
        return new_blocks
        ### END SOLUTION

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """If `block` is cached, drop its hash: it is about to be overwritten."""
        if block.block_hash is None:
            return False
        self._uncache(block)
        self.num_evictions += 1
        return True

    def _pop_victim(self) -> KVCacheBlock:
        if self.eviction_policy == "chain_aware":
            self._hoist_descendants_of_head()
        return self.free_block_queue.popleft()

    def _hoist_descendants_of_head(self) -> None:
        """chain_aware: never evict a block while blocks chained after it are still cached.

        If the head of the free queue is the last block carrying its hash and cached blocks
        hang below that hash, evicting it would orphan them (no lookup can reach a block
        past a miss). Instead, move its cached subtree to the head in leaf-first order, so
        the chain is evicted from its tail, the way SGLang's radix tree evicts leaves.

        Under vLLM's tail-first free() this never fires — a chain's tail always enters the
        free queue before its head, so plain LRU is already leaf-first (a property test
        checks the two policies then make identical choices). It matters when blocks are
        freed head-first. Each block is hoisted at most once per trip through the queue.
        """
        ### BEGIN SOLUTION
        head = self.free_block_queue.fake_free_list_head.next_free_block
        h = head.block_hash
        if h is None or len(self.cached_block_hash_to_block[h.hash_value]) > 1 or not self._children.get(h.hash_value):
            return
        # Walk the cached subtree below h, listing every block after its parent.
        order, seen, stack = [], {h.hash_value}, [h.hash_value]
        while stack:
            for child in self._children.get(stack.pop(), {}).values():
                if child.ref_cnt > 0:       # cannot happen (a holder of a child holds its parent)
                    continue
                order.append(child)
                if child.block_hash.hash_value not in seen:
                    seen.add(child.block_hash.hash_value)
                    stack.append(child.block_hash.hash_value)
        for block in order:                 # appendleft each in turn: at the head, children precede parents
            self.free_block_queue.remove(block)
            self.free_block_queue.appendleft(block)
        self.num_chain_reorders += 1
        ### END SOLUTION

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: ref_cnt += 1, and a block that was free (ref_cnt 0) leaves the free
        queue — from the middle, in O(1) — so it can no longer be evicted."""
        ### BEGIN SOLUTION
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.incr_ref()
        ### END SOLUTION

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt -= 1 for each block; a block reaching 0 joins the TAIL of the free queue,
        keeping its hash (still a cache hit until evicted). Order matters: the first block
        given is evicted first, so callers pass a request's blocks tail-first.

        Freeing a block more times than it is referenced raises before anything changes."""
        ordered_blocks = list(ordered_blocks)
        counts: dict[int, int] = {}
        for block in ordered_blocks:
            if not (0 <= block.block_id < self.num_blocks and self.blocks[block.block_id] is block):
                raise ValueError(f"{block!r} does not belong to this pool")
            counts[block.block_id] = counts.get(block.block_id, 0) + 1
            if counts[block.block_id] > block.ref_cnt:
                raise ValueError(f"block {block.block_id} freed twice: freed {counts[block.block_id]}x "
                                 f"but its ref_cnt is {block.ref_cnt}")
        ### BEGIN SOLUTION
        for block in ordered_blocks:
            block.decr_ref()
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
        ### END SOLUTION

    # ---- maintenance and checks ---------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update, every cached K/V is stale).
        Only possible when no block is held; returns False (and changes nothing) otherwise."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.reset_hash()
        self.cached_block_hash_to_block.clear()
        self._children.clear()
        return True

    def count_orphans(self) -> int:
        """Cached blocks no lookup can reach: some block of their chain (parent, grandparent,
        ...) is no longer cached, and matching stops at the first miss. O(cached blocks)."""
        children: dict[int, list[int]] = {}
        cached = [b for same in self.cached_block_hash_to_block.values() for b in same.values()]
        for b in cached:
            children.setdefault(b.block_hash.parent_hash_value, []).append(b.block_hash.hash_value)
        reachable, stack = set(), [NONE_HASH]
        while stack:
            for value in children.get(stack.pop(), []):
                if value not in reachable:
                    reachable.add(value)
                    stack.append(value)
        return sum(b.block_hash.hash_value not in reachable for b in cached)

    def check_invariants(self) -> None:
        """O(num_blocks) consistency check; raises AssertionError naming the first violation."""
        queued = self.free_block_queue.get_all_free_blocks()
        assert len(queued) == self.free_block_queue.num_free_blocks, \
            f"free queue holds {len(queued)} blocks but counts {self.free_block_queue.num_free_blocks}"
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued), "a block appears twice in the free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_queue = block.block_id in queued_ids
            assert in_queue == (block.ref_cnt == 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_queue} (free and held at once?)"
            if block.block_hash is not None:
                same = self.cached_block_hash_to_block.get(block.block_hash.hash_value, {})
                assert same.get(block.block_id) is block, f"block {block.block_id} has a hash but is not in the cache map"
        num_cached = 0
        for value, same in self.cached_block_hash_to_block.items():
            assert same, f"empty entry for hash {value:#x}"
            for block_id, block in same.items():
                assert block.block_id == block_id and block.block_hash is not None and block.block_hash.hash_value == value, \
                    f"cache map entry {value:#x} -> block {block_id} disagrees with the block's own hash"
                num_cached += 1
        if self.eviction_policy == "chain_aware":
            assert sum(len(c) for c in self._children.values()) == num_cached, "children index out of sync"
            assert self.count_orphans() == 0, "chain_aware evicted a block whose descendants were cached"
