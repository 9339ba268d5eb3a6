"""Data parallelism behind a router: two in-process replicas of a tiny model.

The cache-aware router must keep a tenant on the replica that holds its system prompt (and so beat
round-robin's prefix hit rate on the same requests), fall back to the least loaded replica when no
replica has the prefix or the one that has it is overloaded, and never change a token: each request's
greedy output is the same whichever replica runs it."""
from __future__ import annotations

import random

import pytest

from mini_vllm.dp_engine import DPEngine
from mini_vllm.router import CacheAwareRouter, LeastLoadedRouter, RoundRobinRouter
from mini_vllm.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_llama(tiny_engine_models):
    return tiny_engine_models["llama"][0]                  # the session's tiny Llama (4 heads, 2 KV heads, 2 layers)


def make_dp(path, router, replicas=2):
    return DPEngine.from_config(replicas, router, model=str(path), max_model_len=256, num_gpu_blocks_override=64,
                                cpu_kernels="off", max_num_seqs=8)


def tenants_workload(tenants=3, users=4, seed=0):
    """(tenant, prompt): a 4-block system prompt per tenant + a 5..20-token question, interleaved."""
    rng = random.Random(seed)
    systems = [[1000 + 100 * t + i for i in range(4 * BLOCK)] for t in range(tenants)]
    reqs = [(t, systems[t] + [rng.randrange(3000, 4000) for _ in range(rng.randrange(5, 21))])
            for t in range(tenants) for _ in range(users)]
    rng.shuffle(reqs)
    return reqs


def run(dp, reqs, per_round=2):
    """Requests arrive `per_round` per lockstep round: ({id: tokens}, {id: cached tokens}, {id: replica})."""
    tokens, cached, placed, pending = {}, {}, {}, list(enumerate(reqs))
    while pending or dp.has_unfinished_requests():
        for i, (_, prompt) in pending[:per_round]:
            placed[f"q{i}"] = dp.add_request(f"q{i}", {"prompt_token_ids": prompt}, PARAMS)
        pending = pending[per_round:]
        for out in dp.step():
            if out.finished:
                tokens[out.request_id], cached[out.request_id] = out.outputs[0].token_ids, out.num_cached_tokens
    return tokens, cached, placed


def test_cache_aware_keeps_tenants_together_and_beats_round_robin(tiny_llama):
    reqs = tenants_workload()
    results = {}
    for name in ("round_robin", "cache_aware"):
        dp = make_dp(tiny_llama, name)
        results[name] = run(dp, reqs)
        assert dp.clock > 0 and not dp.replica_of
        dp.shutdown()
    (rr_tokens, rr_cached, _), (ca_tokens, ca_cached, ca_placed) = results["round_robin"], results["cache_aware"]
    assert ca_tokens == rr_tokens                                         # routing never changes a token
    by_tenant = {}
    for i, (tenant, _) in enumerate(reqs):
        by_tenant.setdefault(tenant, set()).add(ca_placed[f"q{i}"])
    assert all(len(replicas) == 1 for replicas in by_tenant.values()), by_tenant
    assert len({r for s in by_tenant.values() for r in s}) == 2             # and both replicas are used
    # Every request after a tenant's first finds its 4-block system prompt (all but 3 of 12).
    assert sum(ca_cached.values()) == (len(reqs) - 3) * 4 * BLOCK
    assert sum(ca_cached.values()) > sum(rr_cached.values())


class FakeScheduler:
    def __init__(self, load):
        self.load = load

    def get_num_unfinished_requests(self):
        return self.load


class FakeReplica:
    """What the routers read of an LLMEngine: its load and its prefix cache."""

    def __init__(self, load, cached_hashes=()):
        from types import SimpleNamespace
        pool = SimpleNamespace(get_cached_block=lambda h: object() if h.hash_value in cached_hashes else None)
        self.engine_core = SimpleNamespace(scheduler=FakeScheduler(load),
                                           kv_cache_manager=SimpleNamespace(block_pool=pool))


def test_routing_decisions_exact():
    from types import SimpleNamespace

    from kvcache.hashing import get_hash_fn, hash_request_tokens
    hash_fn = get_hash_fn("sha256")
    prompt = list(range(3 * BLOCK + 5))
    chain = [h.hash_value for h in hash_request_tokens(BLOCK, SimpleNamespace(all_token_ids=prompt), hash_fn)]
    assert [RoundRobinRouter().select(prompt, [FakeReplica(0)] * 3) for _ in range(1)] == [0]
    rr = RoundRobinRouter()
    assert [rr.select(prompt, [FakeReplica(0)] * 3) for _ in range(4)] == [0, 1, 2, 0]
    assert LeastLoadedRouter().select(prompt, [FakeReplica(3), FakeReplica(1), FakeReplica(1)]) == 1
    # Replica 2 holds the first two blocks, replica 0 only the first: the longest prefix wins.
    replicas = [FakeReplica(0, chain[:1]), FakeReplica(0), FakeReplica(2, chain[:2])]
    router = CacheAwareRouter(BLOCK, hash_fn, balance_abs_threshold=4)
    assert router.select(prompt, replicas) == 2 and router.last_match_blocks == 2
    # A block hit after a miss is worthless: chain[1] alone is no prefix.
    assert CacheAwareRouter(BLOCK, hash_fn).select(prompt, [FakeReplica(1), FakeReplica(0, chain[1:2])]) == 1
    # Overloaded beyond the threshold: the cache does not win; least loaded among the others.
    replicas = [FakeReplica(9, chain), FakeReplica(2), FakeReplica(1)]
    assert CacheAwareRouter(BLOCK, hash_fn, balance_abs_threshold=4).select(prompt, replicas) == 2
    # No prefix anywhere: least loaded; the prefix is then remembered as routed there (a burst sticks).
    router = CacheAwareRouter(BLOCK, hash_fn)
    first = router.select(prompt, [FakeReplica(2), FakeReplica(1)])
    assert first == 1 and router.last_match_blocks == 0
    assert router.select(prompt, [FakeReplica(1), FakeReplica(2)]) == 1 and router.last_match_blocks == 3


def test_bad_router_and_size_refused(tiny_llama):
    with pytest.raises(ValueError, match="router must be one of"):
        DPEngine.from_config(2, "random", model=str(tiny_llama))
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        DPEngine.from_config(0, model=str(tiny_llama))
