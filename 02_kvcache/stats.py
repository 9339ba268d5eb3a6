"""Prefix-cache statistics (vLLM: `vllm/v1/metrics/stats.py: PrefixCacheStats`).

The manager counts every lookup; `KVCacheManager.stats` is the running total and
`make_prefix_cache_stats()` the interval since the previous call (what vLLM logs every few
seconds). Counted per `get_computed_blocks` call, as in vLLM: a request looked up again (after
a preemption, or re-ranked by SRTF) is counted again.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters (vLLM: `vllm/v1/metrics/stats.py: PrefixCacheStats`).

    queries/hits are in TOKENS: a request of n tokens is a query of n, its cached prefix a hit.
    """
    requests: int = 0     # lookups made (get_computed_blocks calls that consulted the cache)
    queries: int = 0      # tokens asked for
    hits: int = 0         # tokens found cached
    evictions: int = 0    # cached blocks whose hash was dropped because the block was reused
    collisions: int = 0   # verified lookups whose hash matched but content did not

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def __sub__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(self.requests - other.requests, self.queries - other.queries,
                                self.hits - other.hits, self.evictions - other.evictions,
                                self.collisions - other.collisions)
