"""KVCacheManager: the scheduler's one interface to KV memory.

Mirrors vLLM v1's `vllm/v1/core/kv_cache_manager.py` (get_computed_blocks, allocate_slots,
cache_blocks, free, free_block_hashes, reset_prefix_cache, make_prefix_cache_stats, usage) on
top of `BlockPool` (`block_pool.py`). vLLM v0's copy-on-write and CPU swap tier, which v1
dropped but the thesis [Kwon 2025, §3.4.4-3.4.5] teaches, are `BlockSpaceManager` (block_space_manager.py),
a subclass of this one.

A request's life, as the scheduler drives it:

    blocks, n = get_computed_blocks(req)                 # cached prefix (full blocks, no refs taken)
    allocate_slots(req, num_new_tokens, n, blocks)       # touch the hits, pop fresh blocks
    ... the model runner writes the K/V of those tokens (the forward pass) ...
    cache_blocks(req, req.num_computed_tokens)           # NOW their full blocks may be hit
    ... each step: allocate_slots(req, 1), forward, cache_blocks(...)   # decode
    free(req)                                            # finished / aborted / preempted: blocks -> free queue
    free_block_hashes(req)                               # finished for good (not on preemption)

Why a block is cached only AFTER its K/V is computed (vLLM caches at allocation time, for the
tokens about to be computed): between allocation and the forward pass a lot can happen. The
scheduler may preempt a request it has already scheduled in the same step (to make room for a
higher-priority one), a KV connector's load may fail, the forward pass may fail for one
request. If its blocks were registered at allocation, they go back to the free queue still
carrying their hashes, and the next request with that prefix attends to K/V nobody wrote —
silently wrong text. Registering what the model runner has actually written makes that
impossible by construction; the price is that a request arriving while another computes its
prefix cannot hit those blocks in that step: `num_pending_tokens` tells the scheduler, which
lets it wait one step and hit them instead of computing the same K/V twice.

The manager only moves block ids. The model runner moves bytes: K/V writes through the slot
mapping (chapter 01) and, with a BlockSpaceManager, the copy/swap pairs it returns.
"""
from __future__ import annotations

from kvcache.block import KVCacheBlock
from kvcache.block_pool import BlockPool
from kvcache.hashing import BlockHash, HashFn, append_block_hashes, get_hash_fn
from kvcache.interfaces import KVCacheBlocks, KVCacheRequest, RequestTooLargeError
from kvcache.stats import PrefixCacheStats
from paged_attention import cdiv


_NO_NEW_BLOCKS = KVCacheBlocks([])     # shared, never mutated: allocate_slots' "nothing new" answer


class KVCacheManager:
    """Args:
        num_blocks: device (GPU) KV blocks.
        block_size: tokens per block.
        enable_caching: prefix caching on/off. Off: no hashing, no hits, freed blocks are plain free.
        eviction_policy: "lru" (vLLM) or "chain_aware" (see `BlockPool`).
        hash_fn: "sha256" (the default, as in vLLM since CVE-2025-25183: collision resistant and
            identical in every process), "builtin" (Python `hash`: cheaper per block —
            `python -m benchmarks.bench_kvcache` measures both — but its collisions can be
            constructed, so one tenant's prompt could be served another's K/V) or a callable.
        verify_tokens: compare stored tokens on every hit (the collision defence of [v1 prefix caching]).
        free_order: "reverse" (vLLM: tail blocks enter the free queue first) or "forward"
            (head first, as in the timeline of [vLLM 2.0 part 2, §6.3.3]) — an ablation only, for the orphan-block
            experiment: forward order puts a chain's parent ahead of its children in the LRU
            queue, so the parent is evicted first and the children become unreachable.
    """

    cpu_block_pool = None     # no CPU swap tier here (BlockSpaceManager adds one)

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 eviction_policy: str = "lru", hash_fn: str | HashFn = "sha256", verify_tokens: bool = False,
                 free_order: str = "reverse") -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if free_order not in ("reverse", "forward"):
            raise ValueError(f"free_order must be 'reverse' or 'forward', got {free_order!r}")
        self.free_order = free_order
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_fn)
        self.block_pool = BlockPool(num_blocks, eviction_policy=eviction_policy, verify_tokens=verify_tokens)
        # request_id -> its block table (logical block i -> physical block), device-resident requests only.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # request_id -> hashes of its full blocks. Survives free() (a preempted request comes
        # back with the same tokens); dropped by free_block_hashes() when it finishes.
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # Full blocks being computed in the current step, not hittable yet: hash -> request ids.
        self.pending_block_hashes: dict[int, set[str]] = {}
        self._pending_by_request: dict[str, set[int]] = {}
        self._lookups = PrefixCacheStats()
        self._last_stats = PrefixCacheStats()

    # ---- prefix cache lookup ------------------------------------------------------------

    def _block_hashes(self, request: KVCacheRequest) -> list[BlockHash]:
        """The request's full-block hashes, extended incrementally to its current tokens."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        return append_block_hashes(hashes, request, self.block_size, self.hash_fn)

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request, in full blocks, and the tokens it covers.

        Stops at the first miss: block i's K/V is only usable with blocks 0..i-1 present
        (every position attends to all before it), so a hit after a miss is worthless.
        Never covers the whole request: the last token must be computed to get logits.
        Takes no references (allocate_slots does), so calling it changes no block state.
        """
        if (not self.enable_caching or request.num_computed_tokens > 0
                or getattr(request, "skip_reading_prefix_cache", False)):
            return KVCacheBlocks.create_empty(), 0
        ### BEGIN SOLUTION
        block_hashes = self._block_hashes(request)
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks = []
        for block_hash in block_hashes[:max_cache_hit_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        num_computed_tokens = len(computed_blocks) * self.block_size
        ### END SOLUTION
        self._lookups.requests += 1
        self._lookups.queries += request.num_tokens
        self._lookups.hits += num_computed_tokens
        return KVCacheBlocks(computed_blocks), num_computed_tokens

    # ---- allocation ---------------------------------------------------------------------

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Make `request` own blocks for num_computed_tokens + num_new_computed_tokens +
        num_new_tokens + num_lookahead_tokens tokens.

        Args:
            num_new_tokens: tokens to compute this step (scheduled, drafts included), or whose
                K/V a KV connector will load (chapter 06).
            num_new_computed_tokens / new_computed_blocks: the prefix hit from
                get_computed_blocks (tokens = blocks * block_size), for a request holding no blocks.
            num_lookahead_tokens: extra slots for speculative drafts (chapter 04).

        Nothing new is cached here: the new blocks' K/V does not exist yet (`cache_blocks`
        registers them once it does). Returns the NEWLY allocated blocks, or None — with no
        state change — if they do not fit now. Raises RequestTooLargeError if they can never
        fit, ValueError on inconsistent input.
        """
        rid = request.request_id
        if self._fits_in_held_blocks(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                     num_lookahead_tokens):
            return _NO_NEW_BLOCKS      # the common decode step: its slot is in a block it holds
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                             f"num_new_computed_tokens={num_new_computed_tokens}, num_lookahead_tokens={num_lookahead_tokens}")
        computed_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else []
        req_blocks = self.req_to_blocks.get(rid, [])
        if len(req_blocks) * self.block_size < request.num_computed_tokens:
            raise ValueError(f"request {rid!r} says {request.num_computed_tokens} tokens are computed but holds "
                             f"{len(req_blocks)} blocks of {self.block_size}: their K/V would be nowhere")
        if num_new_computed_tokens != len(computed_blocks) * self.block_size:
            raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} must equal the hit blocks "
                             f"({len(computed_blocks)}) x block_size ({self.block_size})")
        if computed_blocks:
            self._check_computed_blocks(request, req_blocks, computed_blocks)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required_blocks = cdiv(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.block_size)
        if num_required_blocks > self.num_blocks:
            raise RequestTooLargeError(
                f"request {rid!r} needs {num_required_blocks} blocks "
                f"({num_computed_tokens + num_new_tokens + num_lookahead_tokens} tokens / {self.block_size}) "
                f"but the pool has only {self.num_blocks}: it can never be scheduled")
        self._check_no_shared_write(request, req_blocks, num_computed_tokens, num_new_tokens)

        ### BEGIN SOLUTION
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(computed_blocks))
        # A hit block with ref_cnt 0 sits in the free queue; touching it takes it out, so it
        # cannot also be counted as a free block to allocate.
        num_evictable_computed_blocks = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_computed_blocks:
            return None

        # Touch first: popping fresh blocks could otherwise evict the very blocks we hit.
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks[rid] = req_blocks + computed_blocks + new_blocks
        self.num_cached_block[rid] = self.num_cached_block.get(rid, 0) + len(computed_blocks)
        ### END SOLUTION
        self._mark_pending(request, num_computed_tokens + num_new_tokens)
        return KVCacheBlocks(new_blocks)

    def _fits_in_held_blocks(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int,
                             new_computed_blocks: KVCacheBlocks | None, num_lookahead_tokens: int) -> bool:
        """The fast path of allocate_slots (most calls: a decode token whose slot is in the last,
        private, partly filled block): nothing to allocate, check or mark. Any other case takes
        the full path, which validates everything."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None or num_new_computed_tokens or new_computed_blocks or num_new_tokens < 0 or num_lookahead_tokens:
            return False
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
        B = self.block_size
        if end > len(blocks) * B or start > len(blocks) * B or blocks[-1].ref_cnt != 1:
            return False
        if self.enable_caching and end // B > self.num_cached_block[request.request_id]:
            return False                # it completes a block: the full path marks it pending
        # Every block it writes into is private (ref 1): only the last one can be written
        # without completing a block, and the full path handles the rest.
        return start // B == len(blocks) - 1 or all(b.ref_cnt == 1 for b in blocks[start // B:])

    def _mark_pending(self, request: KVCacheRequest, num_tokens_after_step: int) -> None:
        """Remember the hashes of full blocks this step will compute (not hittable yet), so that
        a request arriving with the same prefix can wait one step for them instead of computing
        them a second time (`num_pending_tokens`)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        hashes = self._block_hashes(request)[self.num_cached_block[request.request_id]:num_full]
        if not hashes:
            return
        pending = self._pending_by_request.setdefault(request.request_id, set())
        for h in hashes:
            self.pending_block_hashes.setdefault(h.hash_value, set()).add(request.request_id)
            pending.add(h.hash_value)

    def _clear_pending(self, request_id: str, hash_values) -> None:
        mine = self._pending_by_request.get(request_id)
        if mine is None:
            return
        for v in list(hash_values):
            if v in mine:
                mine.discard(v)
                owners = self.pending_block_hashes[v]
                owners.discard(request_id)
                if not owners:
                    del self.pending_block_hashes[v]
        if not mine:
            del self._pending_by_request[request_id]

    def num_pending_tokens(self, request: KVCacheRequest, num_computed_tokens: int) -> int:
        """Tokens after a prefix hit of `num_computed_tokens` that OTHER requests are computing
        in the current step: they will be hittable after it. The scheduler lets the request wait
        one step for them rather than compute the same prefix twice — vLLM lets it hit them in
        the same step instead, which this manager does not allow (see the module docstring)."""
        if not self.enable_caching or not self.pending_block_hashes:
            return 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        i = num_computed_tokens // self.block_size
        while i < min(len(hashes), max_blocks) and \
                self.pending_block_hashes.get(hashes[i].hash_value, set()) - {request.request_id}:
            i += 1
        return i * self.block_size - num_computed_tokens

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_computed_tokens`
        tokens, whose K/V the model runner (or a KV connector) HAS written. The scheduler calls
        it after every step with the request's num_computed_tokens (rejected drafts already
        rolled back), and never before: a block in the prefix cache is a promise that its
        K/V is there for anyone whose prefix hashes to it."""
        rid = request.request_id
        if rid not in self.req_to_blocks:
            raise ValueError(f"cache_blocks: request {rid!r} holds no blocks")
        if not self.enable_caching:
            return
        ### BEGIN SOLUTION
        num_full_blocks = min(num_computed_tokens, request.num_tokens) // self.block_size
        num_cached_blocks = self.num_cached_block[rid]
        if num_full_blocks <= num_cached_blocks:
            return
        if num_full_blocks > len(self.req_to_blocks[rid]):
            raise ValueError(f"cache_blocks: {num_computed_tokens} tokens need {num_full_blocks} blocks, "
                             f"request {rid!r} holds {len(self.req_to_blocks[rid])}")
        block_hashes = self._block_hashes(request)
        self.block_pool.cache_full_blocks(self.req_to_blocks[rid], block_hashes, num_cached_blocks, num_full_blocks)
        self.num_cached_block[rid] = num_full_blocks
        ### END SOLUTION
        self._clear_pending(rid, (h.hash_value for h in block_hashes[num_cached_blocks:num_full_blocks]))

    def _check_computed_blocks(self, request, req_blocks, computed_blocks) -> None:
        """Hits must be exactly what get_computed_blocks just returned for this request: a
        stale hit (evicted and reused in between) would silently attend to someone else's K/V."""
        rid = request.request_id
        if not self.enable_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled")
        if req_blocks or request.num_computed_tokens:
            raise ValueError(f"new_computed_blocks are a cached prefix: request {rid!r} must hold no blocks "
                             f"and have no computed tokens (holds {len(req_blocks)}, computed {request.num_computed_tokens})")
        hashes = self.req_to_block_hashes.get(rid, [])
        for i, block in enumerate(computed_blocks):
            if i >= len(hashes) or block.block_hash != hashes[i]:
                raise ValueError(f"stale prefix hit for request {rid!r}: block {block.block_id} no longer holds "
                                 f"logical block {i} (evicted since get_computed_blocks?). Look up and allocate together.")

    def _check_no_shared_write(self, request, req_blocks, num_computed_tokens, num_new_tokens) -> None:
        first, end = num_computed_tokens // self.block_size, cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        for block in req_blocks[first:end]:
            if block.ref_cnt > 1:
                raise ValueError(f"request {request.request_id!r} would write into block {block.block_id}, shared by "
                                 f"{block.ref_cnt} block tables: use append_slots() (copy-on-write)")

    # ---- freeing ------------------------------------------------------------------------

    def free(self, request: KVCacheRequest) -> None:
        """Release the request's blocks: on finish, abort, or recompute preemption — exactly
        once per allocation. Tail blocks first: they enter the free queue first and so are
        evicted first, and a shared prefix (freed last) survives longest. Cached blocks keep
        their hash and stay hittable until evicted; blocks never cached (their K/V was not
        computed yet, e.g. a request preempted in the step that scheduled it) are plain free.
        Raises ValueError for a request the manager holds nothing for."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            raise ValueError(f"free: the manager holds no blocks for request {rid!r} "
                             "(never allocated, or already freed)")
        ### BEGIN SOLUTION
        self.block_pool.free_blocks(reversed(blocks) if self.free_order == "reverse" else blocks)
        del self.req_to_blocks[rid]
        del self.num_cached_block[rid]
        ### END SOLUTION
        self._clear_pending(rid, list(self._pending_by_request.get(rid, ())))

    def free_block_hashes(self, request: KVCacheRequest) -> None:
        """Forget the request's block hashes: call when it FINISHES (or is aborted), not when
        it is preempted — a preempted request comes back with the same tokens, and its
        hashes save rehashing its whole prompt."""
        self.req_to_block_hashes.pop(request.request_id, None)

    # ---- queries, stats, maintenance ----------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        if request_id not in self.req_to_blocks:
            raise ValueError(f"request {request_id!r} holds no blocks")
        return [b.block_id for b in self.req_to_blocks[request_id]]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_free_cpu_blocks(self) -> int:
        return 0

    @property
    def usage(self) -> float:
        """Fraction of device blocks held by requests (cached-but-free blocks count as free)."""
        return self.block_pool.get_usage()

    @property
    def stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache statistics since construction."""
        return PrefixCacheStats(self._lookups.requests, self._lookups.queries, self._lookups.hits,
                                self.block_pool.num_evictions, self.block_pool.num_collisions)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Statistics since the previous call (vLLM's per-interval logging), then reset the interval."""
        now = self.stats
        interval, self._last_stats = now - self._last_stats, now
        return interval

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (e.g. after a weight update). Only when no request holds
        blocks; returns False and changes nothing otherwise."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Everything the allocator promises, checked in O(num_blocks); raises AssertionError.
        Property tests call it after every operation."""
        self.block_pool.check_invariants()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), \
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs.get(b.block_id, 0)} block-table entries"
        assert self.num_cached_block.keys() == self.req_to_blocks.keys(), "num_cached_block out of sync"
        for rid, blocks in self.req_to_blocks.items():
            n = self.num_cached_block[rid]
            assert n <= len(blocks), f"{rid}: {n} cached blocks > {len(blocks)} held"
            if self.enable_caching:
                hashes = self.req_to_block_hashes.get(rid, [])
                for i in range(n):
                    assert i < len(hashes) and blocks[i].block_hash == hashes[i], \
                        f"{rid}: logical block {i} (block {blocks[i].block_id}) is not cached under the request's hash"
            else:
                assert n == 0 and not self.block_pool.cached_block_hash_to_block, "caching disabled but blocks cached"
        assert self._pending_by_request.keys() <= self.req_to_blocks.keys(), "pending blocks of a request holding none"
