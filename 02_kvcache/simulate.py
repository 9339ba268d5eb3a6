"""Drive a KVCacheManager with a workload, as a continuous-batching engine would, and
measure the prefix cache: hit rate, prefill tokens saved, evictions, orphans.

No model runs: a request's prefill "computes" its uncached tokens in one step, then it
decodes one token per step until its output is done. What is measured is exactly what the
cache manager decides — which is all a hit rate depends on. The loop is deliberately a
minimal FCFS scheduler (chapter 03 builds the real one): admit from the waiting queue
while blocks and `max_running` allow; on a decode step that does not fit, preempt the
most recently admitted request (recompute: free its blocks, back to the FRONT of the
waiting queue, as vLLM does).
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from kvcache.block_pool import EVICTION_POLICIES
from kvcache.interfaces import SimpleRequest
from kvcache.kv_cache_manager import KVCacheManager
from kvcache.workloads import Workload


@dataclass(frozen=True)
class SimConfig:
    num_blocks: int
    block_size: int = 16
    max_running: int = 16            # concurrent requests (vLLM's max_num_seqs)
    eviction_policy: str = "lru"
    free_order: str = "reverse"
    enable_caching: bool = True
    orphan_sample_every: int = 0     # steps between count_orphans() samples (0 = never; it is O(cached blocks))

    def __post_init__(self):
        if self.num_blocks <= 0 or self.block_size <= 0 or self.max_running <= 0:
            raise ValueError(f"num_blocks, block_size and max_running must be positive: {self}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if self.free_order not in ("reverse", "forward"):
            raise ValueError(f"free_order must be 'reverse' or 'forward', got {self.free_order!r}")


@dataclass
class SimResult:
    workload: str
    config: dict
    requests: int
    admissions: int                  # > requests when preempted requests were re-admitted
    query_tokens: int                # prompt tokens looked up, over all admissions (vLLM's PrefixCacheStats)
    hit_tokens: int                  # of which found cached
    first_query_tokens: int          # the same over first admissions only: the workload's own sharing,
    first_hit_tokens: int            # without re-admitted (preempted) requests re-hitting their own blocks
    prefill_computed_tokens: int     # tokens actually computed by prefills, recomputation included
    preemptions: int
    evictions: int
    chain_reorders: int
    mean_orphan_fraction: float      # orphans / cached blocks, averaged over samples
    steps: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def first_admission_hit_rate(self) -> float:
        return self.first_hit_tokens / self.first_query_tokens if self.first_query_tokens else 0.0

    def as_row(self) -> dict:
        row = asdict(self)
        row.update(row.pop("config"))
        row["hit_rate"] = self.hit_rate
        row["first_admission_hit_rate"] = self.first_admission_hit_rate
        return row


@dataclass
class _Running:
    req: SimpleRequest
    conv: int
    turn: int
    prompt_len: int
    output: list[int]

    @property
    def done(self) -> bool:
        return self.req.num_tokens - self.prompt_len == len(self.output) and self.req.num_computed_tokens == self.req.num_tokens


def simulate(workload: Workload, config: SimConfig) -> SimResult:
    m = KVCacheManager(config.num_blocks, config.block_size, enable_caching=config.enable_caching,
                       eviction_policy=config.eviction_policy, free_order=config.free_order)
    convs = workload.conversations

    def make(conv: int, turn: int) -> _Running:
        t = convs[conv][turn]
        return _Running(SimpleRequest(f"c{conv}t{turn}", t.prompt), conv, turn, len(t.prompt), t.output)

    waiting: deque[_Running] = deque(make(c, 0) for c in range(len(convs)))
    running: list[_Running] = []
    admissions = preemptions = steps = first_queries = first_hits = prefill_computed = 0
    admitted_before: set[str] = set()
    orphan_fractions: list[float] = []

    def preempt(victim: _Running) -> None:
        nonlocal preemptions
        m.free(victim.req)                               # hashes kept: it will come back
        victim.req.num_computed_tokens = 0
        waiting.appendleft(victim)
        preemptions += 1

    while waiting or running:
        # 1. Admit (prefill) from the front of the waiting queue while it fits.
        while waiting and len(running) < config.max_running:
            r = waiting[0]
            hit, n = m.get_computed_blocks(r.req)
            if m.allocate_slots(r.req, r.req.num_tokens - n, n, hit) is None:
                break
            if r.req.request_id not in admitted_before:
                admitted_before.add(r.req.request_id)
                first_queries += r.req.num_tokens
                first_hits += n
            prefill_computed += r.req.num_tokens - n
            r.req.num_computed_tokens = r.req.num_tokens    # the prefill ran: its full blocks may be hit
            m.cache_blocks(r.req, r.req.num_computed_tokens)
            running.append(waiting.popleft())
            admissions += 1
        if not running:
            raise RuntimeError(f"{workload.name}: the first waiting request cannot fit in {config.num_blocks} blocks")
        steps += 1
        # 2. One decode step for every running request (oldest first). When a step does not
        #    fit, preempt from the back (newest first) — possibly the request itself.
        i = 0
        while i < len(running):
            r = running[i]
            if r.req.num_tokens - r.prompt_len < len(r.output):
                r.req.append_output_token_ids(r.output[r.req.num_tokens - r.prompt_len])
            preempted_itself = False
            while r.req.num_computed_tokens < r.req.num_tokens and m.allocate_slots(r.req, 1) is None:
                victim = running.pop()
                preempt(victim)
                if victim is r:
                    preempted_itself = True
                    break
            if preempted_itself:
                break
            r.req.num_computed_tokens = r.req.num_tokens
            m.cache_blocks(r.req, r.req.num_computed_tokens)
            i += 1
        # 3. Retire finished requests; a conversation's next turn joins the back of the queue.
        for r in [r for r in running if r.done]:
            running.remove(r)
            m.free(r.req)
            m.free_block_hashes(r.req)
            if r.turn + 1 < len(convs[r.conv]):
                waiting.append(make(r.conv, r.turn + 1))
        if config.orphan_sample_every and steps % config.orphan_sample_every == 0:
            cached = sum(len(d) for d in m.block_pool.cached_block_hash_to_block.values())
            if cached:
                orphan_fractions.append(m.block_pool.count_orphans() / cached)

    stats = m.stats
    return SimResult(workload.name, asdict(config), workload.num_requests, admissions, stats.queries, stats.hits,
                     first_queries, first_hits, prefill_computed, preemptions, stats.evictions, m.block_pool.num_chain_reorders,
                     sum(orphan_fractions) / len(orphan_fractions) if orphan_fractions else 0.0, steps)
