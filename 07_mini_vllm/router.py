"""Which data-parallel replica gets a request: round-robin, least loaded, or the longest cached prefix.

Data parallelism serves more traffic with more copies of the whole engine; each replica has its own
scheduler and its own prefix cache. A prefix cached on replica A is worth nothing to a request sent
to replica B — so where requests go decides the prefix hit rate. Round-robin spreads a tenant's
requests (same system prompt) over every replica, and each replica computes and caches that prompt;
a cache-aware router sends them where the prompt already is.

    RoundRobinRouter     replica i mod N                                   (a plain load balancer)
    LeastLoadedRouter    fewest unfinished requests                        (vLLM's DP load balancing:
                         vllm/v1/engine/core_client.py, DPLBAsyncMPClient picks by waiting/running counts)
    CacheAwareRouter     longest cached prefix among the replicas that are not overloaded, else least
                         loaded (SGLang's router: its approximate radix tree per worker and balance
                         thresholds; llm-d's precise prefix-cache scorer: the replicas' real KV blocks)

The cache-aware router looks at two things per replica, both as chains of chapter 02's block hashes
(the same hash the replica's own prefix cache is keyed by): the replica's prefix cache itself (which
blocks are computed and not yet evicted — what chapter 06's metadata server knows for a shared pool)
and the prefixes it routed there recently. The second matters in a burst: ten requests of one tenant
arriving in the same millisecond would otherwise all see an empty cache and scatter.
"""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

from kvcache.hashing import hash_request_tokens


class Router:
    """select(prompt_token_ids, replicas) -> replica index; replicas are LLMEngines."""

    def select(self, prompt_token_ids: list[int], replicas: list) -> int:
        raise NotImplementedError


class ReplicaView:
    """A replica whose engine core runs in another process (the server's `--data-parallel-size`):
    the router sees its load as the front end counts it (requests routed there and not finished),
    and nothing of its KV pool — the cache-aware router then matches against what it routed there
    (SGLang's router likewise keeps its own approximate tree per worker rather than asking them)."""

    def __init__(self, index: int):
        self.index = index
        self.num_unfinished = 0


def replica_load(engine) -> int:
    """Unfinished requests of one replica (waiting + running): the load the balancers compare."""
    if isinstance(engine, ReplicaView):
        return engine.num_unfinished
    return engine.engine_core.scheduler.get_num_unfinished_requests()


def replica_has_block(engine, block_hash) -> bool:
    """Is this block (by chain hash) computed in the replica's prefix cache? Unknown for a ReplicaView."""
    if isinstance(engine, ReplicaView):
        return False
    return engine.engine_core.kv_cache_manager.block_pool.get_cached_block(block_hash) is not None


class RoundRobinRouter(Router):
    def __init__(self):
        self.next = 0

    def select(self, prompt_token_ids, replicas):
        index, self.next = self.next % len(replicas), self.next + 1
        return index


class LeastLoadedRouter(Router):
    def select(self, prompt_token_ids, replicas):
        loads = [replica_load(r) for r in replicas]
        return loads.index(min(loads))                     # ties: the lowest index


class CacheAwareRouter(Router):
    """Longest prefix (cached or recently routed) among replicas within `balance_abs_threshold`
    requests of the least loaded one; no prefix anywhere -> least loaded.

    balance_abs_threshold: how much more loaded than the emptiest replica a replica may be and still
    win on its cache (SGLang: balance_abs_threshold). Unbounded affinity would send a popular tenant's
    whole traffic to one replica while the others idle.
    remembered_blocks: how many routed block hashes are remembered per replica (oldest forgotten first),
    about what its KV cache can hold — beyond that the replica has evicted them anyway."""

    def __init__(self, block_size: int, hash_fn, balance_abs_threshold: int = 4, remembered_blocks: int = 4096):
        self.block_size, self.hash_fn = block_size, hash_fn
        self.balance_abs_threshold = balance_abs_threshold
        self.remembered_blocks = remembered_blocks
        self.routed: list[OrderedDict] = []                  # per replica: block hash value -> None (LRU order)
        self.last_match_blocks = 0                           # of the last decision (tests, the benchmark)

    def prefix_blocks(self, hashes, engine, routed: OrderedDict) -> int:
        """Leading blocks of the prompt this replica has: cached in its KV pool or routed there."""
        n = 0
        for h in hashes:
            if h.hash_value not in routed and not replica_has_block(engine, h):
                break
            n += 1
        return n

    def select(self, prompt_token_ids, replicas):
        while len(self.routed) < len(replicas):
            self.routed.append(OrderedDict())
        # Full blocks only; the same chain the replicas' prefix caches are keyed by.
        hashes = hash_request_tokens(self.block_size, SimpleNamespace(all_token_ids=list(prompt_token_ids)),
                                     self.hash_fn)
        loads = [replica_load(r) for r in replicas]
        eligible = [i for i, load in enumerate(loads) if load <= min(loads) + self.balance_abs_threshold]
        matches = {i: self.prefix_blocks(hashes, replicas[i], self.routed[i]) for i in eligible}
        best = max(eligible, key=lambda i: (matches[i], -loads[i], -i))
        if matches[best] == 0:
            best = min(eligible, key=lambda i: (loads[i], i))  # nobody has it: least loaded
        self.last_match_blocks = matches[best]
        routed = self.routed[best]
        for h in hashes:
            routed[h.hash_value] = None
            routed.move_to_end(h.hash_value)
        while len(routed) > self.remembered_blocks:
            routed.popitem(last=False)
        return best
