"""BlockSpaceManager: vLLM v0's two block-manager features that v1 dropped — copy-on-write
sharing and a CPU swap tier — on top of chapter 02's v1 `KVCacheManager`.

Mirrors v0's `vllm/core/block_manager.py: BlockSpaceManager` (`fork`, `append_slots`,
`swap_out`, `swap_in`, `CpuGpuBlockAllocator`). The thesis [Kwon 2025] teaches both (§3.4.4 copy-on-write
for parallel sampling and beam search, §3.4.5 swapping vs recomputation); vLLM v1 recomputes
on preemption and shares prompts through the prefix cache instead.

* Copy-on-write: `fork` gives a child the parent's computed blocks (ref_cnt + 1, nothing
  copied); `append_slots` replaces each shared block the new tokens would write into by a
  private one, returning the (src, dst) pairs to copy — only a partly filled block holds K/V
  worth copying.
* Swapping: `swap_out` moves a preempted request's computed K/V to CPU blocks (a rung-1 pool:
  swapped blocks are private, never looked up by content) and frees its device blocks;
  `swap_in` brings it back, reusing leading blocks that are still in the device prefix cache.

The model runner executes the returned pairs with `kvcache.ops.copy_blocks` / `swap_blocks`
(or `CacheEngine.execute`) before the step's forward pass, in this order: swap-outs, swap-ins,
copies. vLLM v0's scheduler never swaps in and out in the same step because its worker ran
swap-in BEFORE swap-out: a device block freed by a swap-out and handed to a swap-in in the
same step would be overwritten before being saved. Running swap-outs first (as this project's
CacheEngine does) makes the mix safe, and the scheduler here still never admits (swaps in)
in a step that preempted.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcache.block import KVCacheBlock
from kvcache.block_pool_v1 import BlockPoolV1
from kvcache.hashing import HashFn
from kvcache.interfaces import KVCacheBlocks, KVCacheRequest, RequestTooLargeError
from kvcache.kv_cache_manager import KVCacheManager
from paged_attention import cdiv


@dataclass
class _SwappedOut:
    cpu_block_ids: list[int]      # logical block i of the request lives in CPU block cpu_block_ids[i]
    num_computed_tokens: int      # what the copies hold; the request must come back at this point


class BlockSpaceManager(KVCacheManager):
    """KVCacheManager + copy-on-write (`fork`, `append_slots`) + a CPU swap tier of
    `num_cpu_blocks` blocks (`swap_out`, `swap_in`; 0 = no swapping). Other args: KVCacheManager's."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 eviction_policy: str = "lru", num_cpu_blocks: int = 0, hash_fn: str | HashFn = "sha256",
                 verify_tokens: bool = False, free_order: str = "reverse") -> None:
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        super().__init__(num_blocks, block_size, enable_caching, eviction_policy, hash_fn, verify_tokens, free_order)
        self.cpu_block_pool = BlockPoolV1(num_cpu_blocks) if num_cpu_blocks else None
        # request_id -> where its K/V sits in the CPU tier while swapped out.
        self.swapped_out: dict[str, _SwappedOut] = {}

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
        copied; that is the one pair ([Kwon 2025, §3.4.4]: 'only copying one block of data')."""
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
        if the device blocks do not fit. The fresh blocks are cached by `cache_blocks` after
        the step, like any other: their bytes arrive with the step's swap-in copy."""
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
        ### END SOLUTION
        return mapping

    # ---- the v1 contract, aware of swapped-out requests ------------------------------------

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        if request.request_id in self.swapped_out:
            raise ValueError(f"request {request.request_id!r} is swapped out: swap_in() it before allocating")
        return super().allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                      num_lookahead_tokens)

    def free(self, request: KVCacheRequest) -> None:
        """KVCacheManager.free; a swapped-out request frees its CPU blocks instead."""
        if request.request_id in self.swapped_out:
            self.cpu_block_pool.free(self.swapped_out.pop(request.request_id).cpu_block_ids)
            return
        super().free(request)

    def get_block_ids(self, request_id: str) -> list[int]:
        if request_id in self.swapped_out:
            raise ValueError(f"request {request_id!r} is swapped out: it has no device blocks")
        return super().get_block_ids(request_id)

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_block_pool.get_num_free_blocks() if self.cpu_block_pool else 0

    def check_invariants(self) -> None:
        super().check_invariants()
        assert not (self.swapped_out.keys() & self.req_to_blocks.keys()), "a request is both swapped and resident"
        if self.cpu_block_pool is not None:
            held = [c for rec in self.swapped_out.values() for c in rec.cpu_block_ids]
            assert len(held) == len(set(held)), "a CPU block is held twice"
            assert len(held) + self.cpu_block_pool.get_num_free_blocks() == self.cpu_block_pool.num_blocks, \
                "CPU blocks leaked"
