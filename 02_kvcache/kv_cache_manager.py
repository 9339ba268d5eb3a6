"""KVCacheManager: the scheduler's one interface to KV memory.

Mirrors vLLM v1's `vllm/v1/core/kv_cache_manager.py` (get_computed_blocks, allocate_slots,
free, free_block_hashes, reset_prefix_cache, make_prefix_cache_stats, usage) on top of
`BlockPool` (`block_pool.py`). Two vLLM v0 mechanisms that v1 dropped are added back
because the thesis (§3.4.4-3.4.5) teaches them: copy-on-write block sharing (`fork`,
`append_slots`, v0's `BlockSpaceManager.fork/append_slots`) and a CPU swap tier
(`swap_out`, `swap_in`, v0's `BlockSpaceManager.swap_out/swap_in`).

A request's life, as the scheduler drives it:

    blocks, n = get_computed_blocks(req)                 # cached prefix (full blocks, no refs taken)
    allocate_slots(req, num_new_tokens, n, blocks)       # touch the hits, pop fresh blocks, cache full ones
    ... each step: allocate_slots(req, 1)               # decode: a new block every block_size tokens
    free(req)                                            # finished / aborted / preempted: blocks -> free queue
    free_block_hashes(req)                               # finished for good (not on preemption)

The manager only moves block ids. The model runner moves bytes: K/V writes through the
slot mapping (chapter 01), and the (src, dst) pairs that `append_slots`, `swap_out` and
`swap_in` return, executed with `kvcache.ops.copy_blocks` / `swap_blocks` before the
forward pass of the step, in this order: swap-outs, swap-ins, copies. A step must not
both swap out and swap in (vLLM v0's scheduler rule): the device blocks a swap-out frees
may be handed to a swap-in of the same step, and must be saved before being overwritten.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcache.block import KVCacheBlock
from kvcache.block_pool import BlockPool
from kvcache.block_pool_v1 import BlockPoolV1
from kvcache.hashing import BlockHash, HashFn, append_block_hashes, get_hash_fn
from kvcache.interfaces import KVCacheBlocks, KVCacheRequest, PrefixCacheStats, RequestTooLargeError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _SwappedOut:
    cpu_block_ids: list[int]      # logical block i of the request lives in CPU block cpu_block_ids[i]
    num_computed_tokens: int      # what the copies hold; the request must come back at this point


class KVCacheManager:
    """Args:
        num_blocks: device (GPU) KV blocks.
        block_size: tokens per block.
        enable_caching: prefix caching on/off. Off: no hashing, no hits, freed blocks are plain free.
        eviction_policy: "lru" (vLLM) or "chain_aware" (see `BlockPool`).
        num_cpu_blocks: size of the CPU swap tier (0 = no swapping).
        hash_fn: "builtin" (Python `hash`, fast), "sha256" (stable across processes) or a callable.
        verify_tokens: compare stored tokens on every hit (seed 001's collision defence).
        free_order: "reverse" (vLLM: tail blocks enter the free queue first) or "forward"
            (head first, as in seed 003's timeline) — an ablation only, for the orphan-block
            experiment: forward order puts a chain's parent ahead of its children in the LRU
            queue, so the parent is evicted first and the children become unreachable.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 eviction_policy: str = "lru", num_cpu_blocks: int = 0,
                 hash_fn: str | HashFn = "builtin", verify_tokens: bool = False,
                 free_order: str = "reverse") -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        if free_order not in ("reverse", "forward"):
            raise ValueError(f"free_order must be 'reverse' or 'forward', got {free_order!r}")
        self.free_order = free_order
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_fn)
        self.block_pool = BlockPool(num_blocks, eviction_policy=eviction_policy, verify_tokens=verify_tokens)
        self.cpu_block_pool = BlockPoolV1(num_cpu_blocks) if num_cpu_blocks else None
        # request_id -> its block table (logical block i -> physical block), device-resident requests only.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # request_id -> hashes of its full blocks. Survives free() (a preempted request comes
        # back with the same tokens); dropped by free_block_hashes() when it finishes.
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # request_id -> where its K/V sits in the CPU tier while swapped out.
        self.swapped_out: dict[str, _SwappedOut] = {}
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
        if not self.enable_caching or request.num_computed_tokens > 0:
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
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> KVCacheBlocks | None:
        """Make `request` own blocks for num_computed_tokens + num_new_computed_tokens +
        num_new_tokens + num_lookahead_tokens tokens.

        Args:
            num_new_tokens: tokens to compute this step (scheduled, drafts included).
            num_new_computed_tokens / new_computed_blocks: the prefix hit from
                get_computed_blocks (tokens = blocks * block_size), for a request holding no blocks.
            num_lookahead_tokens: extra slots for speculative drafts (chapter 04); never cached.
            delay_cache_blocks: allocate but do not cache yet — the K/V arrives from elsewhere
                (remote prefill, chapter 06) and must not be hit before it lands.

        Returns the NEWLY allocated blocks, or None — with no state change — if they do not fit
        now. Raises RequestTooLargeError if they can never fit, ValueError on inconsistent input.
        """
        rid = request.request_id
        if rid in self.swapped_out:
            raise ValueError(f"request {rid!r} is swapped out: swap_in() it before allocating")
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

        if self.enable_caching and not delay_cache_blocks:
            # Cache what will be computed after this step, but never lookahead slots or
            # tokens beyond request.num_tokens (unverified drafts).
            self.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        ### END SOLUTION
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_computed_tokens`
        tokens. Called by allocate_slots; called directly once delayed (remote) K/V has landed."""
        rid = request.request_id
        if rid not in self.req_to_blocks:
            raise ValueError(f"cache_blocks: request {rid!r} holds no blocks")
        if not self.enable_caching:
            return
        num_full_blocks = min(num_computed_tokens, request.num_tokens) // self.block_size
        num_cached_blocks = self.num_cached_block[rid]
        if num_full_blocks <= num_cached_blocks:
            return
        if num_full_blocks > len(self.req_to_blocks[rid]):
            raise ValueError(f"cache_blocks: {num_computed_tokens} tokens need {num_full_blocks} blocks, "
                             f"request {rid!r} holds {len(self.req_to_blocks[rid])}")
        self.block_pool.cache_full_blocks(self.req_to_blocks[rid], self._block_hashes(request),
                                          num_cached_blocks, num_full_blocks)
        self.num_cached_block[rid] = num_full_blocks

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

    # ---- copy-on-write ------------------------------------------------------------------

    def fork(self, parent: KVCacheRequest, child: KVCacheRequest) -> KVCacheBlocks:
        """The child shares the parent's computed K/V (parallel sampling, beam search):
        its block table is the parent's blocks covering parent.num_computed_tokens, each
        ref_cnt + 1. Nothing is copied until one of them writes into a shared block.
        Fork between steps (after the parent's computed tokens are up to date)."""
        prid, crid = parent.request_id, child.request_id
        if prid not in self.req_to_blocks:
            raise ValueError(f"fork: parent {prid!r} holds no device blocks")
        if crid in self.req_to_blocks or crid in self.swapped_out:
            raise ValueError(f"fork: child {crid!r} already holds blocks")
        n = parent.num_computed_tokens
        if child.num_computed_tokens != n or list(child.all_token_ids[:n]) != list(parent.all_token_ids[:n]):
            raise ValueError(f"fork: child {crid!r} must start where parent {prid!r} is: same first {n} tokens, "
                             f"num_computed_tokens={n} (got {child.num_computed_tokens})")
        if self.num_cached_block.get(prid, 0) > n // self.block_size:
            raise ValueError(f"fork: parent {prid!r} has blocks cached beyond its computed tokens; fork between steps")
        ### BEGIN SOLUTION
        shared = self.req_to_blocks[prid][:cdiv(n, self.block_size)]
        self.block_pool.touch(shared)          # all are held already: only ref counts change
        self.req_to_blocks[crid] = list(shared)
        self.num_cached_block[crid] = self.num_cached_block.get(prid, 0)
        if self.enable_caching:
            self.req_to_block_hashes[crid] = list(self.req_to_block_hashes.get(prid, [])[:n // self.block_size])
        ### END SOLUTION
        return KVCacheBlocks(list(shared))

    def append_slots(self, request: KVCacheRequest, num_new_tokens: int,
                     num_lookahead_tokens: int = 0) -> tuple[KVCacheBlocks, list[tuple[int, int]]] | None:
        """allocate_slots for a request that may share blocks (after fork): every shared block
        the new tokens would write into is first replaced by a private fresh block. Returns
        (new blocks, [(src, dst)] to copy with copy_blocks before the step), or None — no state
        change — if it does not fit. Only a partially filled shared block needs its contents
        copied; that is the one pair (thesis §3.4.4: 'only copying one block of data')."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            raise ValueError(f"append_slots: request {rid!r} holds no device blocks")
        B, n = self.block_size, request.num_computed_tokens
        ### BEGIN SOLUTION
        write_range = range(n // B, min(len(blocks), cdiv(n + num_new_tokens, B)))
        shared = [i for i in write_range if blocks[i].ref_cnt > 1]
        num_required_blocks = cdiv(n + num_new_tokens + num_lookahead_tokens, B)
        num_new_blocks = max(0, num_required_blocks - len(blocks))
        if num_required_blocks > self.num_blocks:
            raise RequestTooLargeError(f"request {rid!r} needs {num_required_blocks} blocks, the pool has {self.num_blocks}")
        if num_new_blocks + len(shared) > self.block_pool.get_num_free_blocks():
            return None
        copies = []
        for i, fresh in zip(shared, self.block_pool.get_new_blocks(len(shared))):
            src = blocks[i]
            blocks[i] = fresh
            self.block_pool.free_blocks([src])          # ref_cnt > 1: stays held by the others
            if i * B < n:                               # holds computed K/V: copy it
                copies.append((src.block_id, fresh.block_id))
        new_blocks = self.allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        assert new_blocks is not None, "fit was checked above"
        ### END SOLUTION
        return new_blocks, copies

    # ---- CPU swap tier ------------------------------------------------------------------

    def swap_out(self, request: KVCacheRequest) -> list[tuple[int, int]] | None:
        """Preempt by swapping: move the request's computed K/V to CPU blocks and free its
        device blocks (tail first, as free() does). Returns [(device_block, cpu_block)] for
        swap_blocks, or None — no state change — if the CPU tier is full. The request keeps
        its num_computed_tokens; bring it back with swap_in()."""
        rid = request.request_id
        if self.cpu_block_pool is None:
            raise ValueError("swap_out: this manager has no CPU swap tier (num_cpu_blocks=0)")
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            raise ValueError(f"swap_out: request {rid!r} holds no device blocks")
        num_used = cdiv(request.num_computed_tokens, self.block_size)   # blocks holding computed K/V
        if num_used > self.cpu_block_pool.num_blocks:
            raise RequestTooLargeError(f"swap_out: request {rid!r} needs {num_used} CPU blocks, "
                                       f"the tier has {self.cpu_block_pool.num_blocks}")
        if num_used > self.cpu_block_pool.get_num_free_blocks():
            return None
        ### BEGIN SOLUTION
        cpu_block_ids = self.cpu_block_pool.allocate(num_used)
        mapping = [(blocks[i].block_id, cpu_block_ids[i]) for i in range(num_used)]
        self.free(request)
        self.swapped_out[rid] = _SwappedOut(cpu_block_ids, request.num_computed_tokens)
        ### END SOLUTION
        return mapping

    def swap_in(self, request: KVCacheRequest) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back. Leading full blocks still in the device prefix
        cache are re-used (touched) instead of copied; the rest get fresh device blocks.
        Returns [(cpu_block, device_block)] for swap_blocks, or None — no state change —
        if the device blocks do not fit."""
        rid = request.request_id
        record = self.swapped_out.get(rid)
        if record is None:
            raise ValueError(f"swap_in: request {rid!r} is not swapped out")
        if request.num_computed_tokens != record.num_computed_tokens:
            raise ValueError(f"swap_in: request {rid!r} was swapped out at {record.num_computed_tokens} computed "
                             f"tokens, now says {request.num_computed_tokens}")
        ### BEGIN SOLUTION
        hits: list[KVCacheBlock] = []
        if self.enable_caching:
            num_full = record.num_computed_tokens // self.block_size
            for block_hash in self._block_hashes(request)[:num_full]:
                block = self.block_pool.get_cached_block(block_hash)
                if block is None:
                    break
                hits.append(block)
        num_new_blocks = len(record.cpu_block_ids) - len(hits)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - sum(1 for b in hits if b.ref_cnt == 0):
            return None
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        mapping = [(cpu, blk.block_id) for cpu, blk in zip(record.cpu_block_ids[len(hits):], new_blocks)]
        self.cpu_block_pool.free(record.cpu_block_ids)
        del self.swapped_out[rid]
        self.req_to_blocks[rid] = hits + new_blocks
        self.num_cached_block[rid] = len(hits)
        self.cache_blocks(request, record.num_computed_tokens)   # the copied-back blocks are valid again
        ### END SOLUTION
        return mapping

    # ---- freeing ------------------------------------------------------------------------

    def free(self, request: KVCacheRequest) -> None:
        """Release the request's blocks: on finish, abort, or recompute preemption — exactly
        once per allocation. Tail blocks first: they enter the free queue first and so are
        evicted first, and a shared prefix (freed last) survives longest. Cached blocks keep
        their hash and stay hittable until evicted. A swapped-out request frees its CPU blocks.
        Raises ValueError for a request the manager holds nothing for."""
        rid = request.request_id
        if rid in self.swapped_out:
            self.cpu_block_pool.free(self.swapped_out.pop(rid).cpu_block_ids)
            return
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            raise ValueError(f"free: the manager holds no blocks for request {rid!r} "
                             "(never allocated, or already freed)")
        ### BEGIN SOLUTION
        self.block_pool.free_blocks(reversed(blocks) if self.free_order == "reverse" else blocks)
        del self.req_to_blocks[rid]
        del self.num_cached_block[rid]
        ### END SOLUTION

    def free_block_hashes(self, request: KVCacheRequest) -> None:
        """Forget the request's block hashes: call when it FINISHES (or is aborted), not when
        it is preempted — a preempted request comes back with the same tokens, and its
        hashes save rehashing its whole prompt."""
        self.req_to_block_hashes.pop(request.request_id, None)

    # ---- queries, stats, maintenance ----------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        if request_id in self.swapped_out:
            raise ValueError(f"request {request_id!r} is swapped out: it has no device blocks")
        if request_id not in self.req_to_blocks:
            raise ValueError(f"request {request_id!r} holds no blocks")
        return [b.block_id for b in self.req_to_blocks[request_id]]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_block_pool.get_num_free_blocks() if self.cpu_block_pool else 0

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
        assert not (self.swapped_out.keys() & self.req_to_blocks.keys()), "a request is both swapped and resident"
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
        if self.cpu_block_pool is not None:
            held = [c for rec in self.swapped_out.values() for c in rec.cpu_block_ids]
            assert len(held) == len(set(held)), "a CPU block is held twice"
            assert len(held) + self.cpu_block_pool.get_num_free_blocks() == self.cpu_block_pool.num_blocks, \
                "CPU blocks leaked"
