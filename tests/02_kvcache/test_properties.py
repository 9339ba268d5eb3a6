"""Property-based tests (hypothesis): random sequences of admit / decode / fork / free
(preempt or finish) / swap out / swap in / reset, checked after EVERY operation:

  * check_invariants(): ref counts >= 0 and equal to block-table references, no block both
    free and held, free queue consistent, cached-hash map consistent with block metadata,
    CPU tier without leaks;
  * a prefix hit never exceeds the tokens given (and never covers the last token);
  * shadow K/V: every token's "K/V" (a value derived from its whole prefix) is written
    through the block table into a real cache, moved by the manager's copy/swap mappings,
    and each request must read back exactly its own history — a wrong hit, a missed
    copy-on-write, a bad swap mapping or a reused live block all show up here;
  * at the end, after freeing everything, every block is free again.

And two statements about eviction policies: under vLLM's tail-first free order, LRU never
leaves an orphan and chain-aware eviction makes exactly the same choices; chain-aware
eviction never leaves an orphan under any free order.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import BlockSpaceManager, RequestTooLargeError, SimpleRequest
from kvcache.cache_engine import CacheEngine, KVCacheSpec

B = 4
PREFIXES = [[1000 + i for i in range(24)], [2000 + i for i in range(24)], [1000 + i for i in range(8)] + [3000 + i for i in range(16)]]

# One op = (kind, prefix, prefix_len, suffix_len, which, finished); each kind reads what it
# needs. Kinds are repeated to weight them: decoding and admitting are what engines do most.
KINDS = ["new"] * 4 + ["step"] * 5 + ["fork", "free", "free", "admit", "admit", "swap_out", "swap_in", "reset"]
op = st.tuples(st.sampled_from(KINDS), st.integers(0, len(PREFIXES) - 1), st.integers(0, 24),
               st.integers(1, 9), st.integers(0, 7), st.booleans())
ops = st.lists(op, min_size=20, max_size=60)


def kv_value(tokens, pos):
    """The 'K/V' of position pos: depends on the whole prefix, like real attention K/V."""
    h = 0
    for t in tokens[:pos + 1]:
        h = (h * 31 + t) % 1_000_003
    return float(h)                                     # exact in float32 (< 2**24)


class Driver:
    """Plays an op list against one manager (+ shadow caches); returns the decision trace."""

    def __init__(self, num_blocks=8, num_cpu_blocks=6, shadow=True, **manager_kw):
        self.m = BlockSpaceManager(num_blocks, B, num_cpu_blocks=num_cpu_blocks, **manager_kw)
        spec = KVCacheSpec(num_layers=1, block_size=B, num_kv_heads=1, head_dim=1, dtype=torch.float32)
        self.eng = CacheEngine(spec, num_blocks, num_cpu_blocks) if shadow else None
        self.running, self.waiting, self.swapped = [], [], []
        self.trace, self.next_token, self.next_id = [], 50_000, 0

    def _new_id(self):
        self.next_id += 1
        return f"r{self.next_id}"

    def _write(self, r, start, end):
        if self.eng is None:
            return
        ids = self.m.get_block_ids(r.request_id)
        for p in range(start, end):
            self.eng.key_caches[0][ids[p // B], p % B, 0, 0] = kv_value(r.all_token_ids, p)

    def check(self):
        self.m.check_invariants()
        if self.eng is None:
            return
        for r in self.running:
            ids = self.m.get_block_ids(r.request_id)
            cache = self.eng.key_caches[0]
            got = [cache[ids[p // B], p % B, 0, 0].item() for p in range(r.num_computed_tokens)]
            assert got == [kv_value(r.all_token_ids, p) for p in range(r.num_computed_tokens)], r.request_id

    def _admit(self, r):
        hit, n = self.m.get_computed_blocks(r)
        assert n <= r.num_tokens - 1 and n == len(hit) * B         # hits never exceed the tokens given
        try:
            new = self.m.allocate_slots(r, r.num_tokens - n, n, hit)
        except RequestTooLargeError:
            self.trace.append(("too_large", r.request_id))
            return True
        self.trace.append(("admit", r.request_id, n, None if new is None else new.get_block_ids()))
        if new is None:
            return False
        r.num_computed_tokens = n
        self._write(r, n, r.num_tokens)                # this step computes the rest of the prompt
        r.num_computed_tokens = r.num_tokens
        self.m.cache_blocks(r, r.num_computed_tokens)   # ... and now its full blocks may be hit
        self.running.append(r)
        return True

    def apply(self, o):
        kind, p, plen, slen, which, finished = o
        if kind == "new":
            suffix = list(range(self.next_token, self.next_token + slen))
            self.next_token += slen
            r = SimpleRequest(self._new_id(), PREFIXES[p][:plen] + suffix)
            if not self._admit(r):
                self.waiting.append(r)
        elif kind == "admit" and self.waiting:
            if self._admit(self.waiting[0]):
                self.waiting.pop(0)
        elif kind == "step" and self.running:
            r = self.running[which % len(self.running)]
            r.append_output_token_ids(self.next_token)
            self.next_token += 1
            try:
                res = self.m.append_slots(r, 1)
            except RequestTooLargeError:               # grew past the whole pool: abort it
                self.trace.append(("abort", r.request_id))
                self.running.remove(r)
                self.m.free(r)
                self.m.free_block_hashes(r)
                return
            self.trace.append(("step", r.request_id, None if res is None else (res[0].get_block_ids(), res[1])))
            if res is None:
                r.all_token_ids.pop()                  # not scheduled this step
                return
            if self.eng is not None:
                self.eng.copy(res[1])                  # copy-on-write before writing the new K/V
            self._write(r, r.num_computed_tokens, r.num_computed_tokens + 1)
            r.num_computed_tokens += 1
            self.m.cache_blocks(r, r.num_computed_tokens)
        elif kind == "fork" and self.running:
            parent = self.running[which % len(self.running)]
            child = SimpleRequest(self._new_id(), list(parent.all_token_ids), num_computed_tokens=parent.num_computed_tokens)
            self.trace.append(("fork", parent.request_id, self.m.fork(parent, child).get_block_ids()))
            self.running.append(child)
        elif kind == "free" and self.running:
            r = self.running.pop(which % len(self.running))
            self.m.free(r)
            self.trace.append(("free", r.request_id, finished))
            if finished:
                self.m.free_block_hashes(r)
            else:                                      # recompute preemption: back to waiting
                r.num_computed_tokens = 0
                self.waiting.append(r)
        elif kind == "swap_out" and self.running:
            r = self.running[which % len(self.running)]
            try:
                mapping = self.m.swap_out(r)
            except RequestTooLargeError:               # bigger than the whole CPU tier
                self.trace.append(("swap_too_large", r.request_id))
                return
            self.trace.append(("swap_out", r.request_id, mapping))
            if mapping is not None:
                assert len(mapping) == -(-r.num_computed_tokens // B)
                if self.eng is not None:
                    self.eng.swap_out(mapping)
                self.running.remove(r)
                self.swapped.append(r)
        elif kind == "swap_in" and self.swapped:
            r = self.swapped[which % len(self.swapped)]
            mapping = self.m.swap_in(r)
            self.trace.append(("swap_in", r.request_id, mapping))
            if mapping is not None:
                if self.eng is not None:
                    self.eng.swap_in(mapping)
                self.m.cache_blocks(r, r.num_computed_tokens)   # the copied-back K/V is there again
                self.swapped.remove(r)
                self.running.append(r)
        elif kind == "reset":
            self.trace.append(("reset", self.m.reset_prefix_cache()))

    def run(self, op_list, check_every_op=True):
        for o in op_list:
            self.apply(o)
            if check_every_op:
                self.check()
        return self.trace

    def drain(self):
        for r in self.running + self.swapped:
            self.m.free(r)
            self.m.free_block_hashes(r)
        self.running, self.swapped = [], []
        self.m.check_invariants()
        assert self.m.num_free_blocks == self.m.num_blocks
        assert all(b.ref_cnt == 0 for b in self.m.block_pool.blocks)
        assert self.m.num_free_cpu_blocks == self.m.cpu_block_pool.num_blocks


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy,free_order,caching", [
    ("lru", "reverse", True), ("chain_aware", "reverse", True), ("lru", "forward", True),
    ("chain_aware", "forward", True), ("lru", "reverse", False)])
@SETTINGS
@given(op_list=ops)
def test_invariants_and_shadow_kv_under_random_ops(policy, free_order, caching, op_list):
    d = Driver(eviction_policy=policy, free_order=free_order, enable_caching=caching)
    d.run(op_list)
    if policy == "chain_aware" or free_order == "reverse":
        assert d.m.block_pool.count_orphans() == 0
    d.drain()


@settings(max_examples=80, deadline=None)
@given(op_list=ops)
def test_tail_first_free_makes_lru_already_chain_aware(op_list):
    """vLLM's tail-first free keeps every chain leaf-first in the LRU queue, so the
    chain-aware policy never has to intervene: identical decisions, zero orphans."""
    lru = Driver(shadow=False, eviction_policy="lru")
    chain = Driver(shadow=False, eviction_policy="chain_aware")
    for o in op_list:
        lru.apply(o)
        chain.apply(o)
        assert lru.m.block_pool.count_orphans() == 0
    assert lru.trace == chain.trace
    assert chain.m.block_pool.num_chain_reorders == 0
