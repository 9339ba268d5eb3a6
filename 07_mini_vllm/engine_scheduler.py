"""The engine's scheduler: chapter 03's core, with what chapters 04, 05 and 06 add to it.

Each later chapter adds its mechanism by overriding chapter 03's hooks (`_num_new_tokens`,
`_on_scheduled`, `_build_output`, `_try_admit`, ...) and calling `super()`; a class that lists
them composes them, and Python's method resolution order chains the overrides, leftmost first:

    KVConnectorScheduler (06: K/V from other machines)
      -> SpecDecodeScheduler (04: speculative tokens ride along in Δ)
        -> ChunkedPrefillScheduler (05: Δ cut into chunks)
          -> Scheduler (03: two counters, a budget, preemption, the prefix cache)

and chapter 07's own layers, async scheduling's placeholders (`async_scheduler.py`), parallel
sampling's fork (`parallel_sampling.ForkingScheduler`, copy-on-write on chapter 02's
BlockSpaceManager) and beam search on it (`beam_search_scheduler.py`), go on top of whichever of
these the config picks — so that, e.g., a decoding request's Δ is chapter 05's chunk (here: its one token) plus chapter
04's drafts, and the output chapter 06 hands its connector already carries those drafts. vLLM has
one `Scheduler` class with all of it inline (`vllm/v1/core/sched/scheduler.py`); the split here is
for reading, one chapter at a time. Speculative tokens cost nothing when there are none, so
chapter 04's layer is always in; chunking and remote K/V are in when the config asks for them.
"""
from __future__ import annotations

from chunked_prefill import ChunkedPrefillConfig, ChunkedPrefillScheduler
from global_prefix_cache.scheduler import KVConnectorBase, KVConnectorScheduler
from kvcache import KVCacheManager
from scheduler import Scheduler, SchedulerConfig
from spec_decode.scheduler import SpecDecodeScheduler

from mini_vllm.async_scheduler import AsyncScheduler
from mini_vllm.beam_search_scheduler import BeamSearchScheduler


class ChunkedSpecDecodeScheduler(SpecDecodeScheduler, ChunkedPrefillScheduler):
    """Chapters 03 + 05 + 04."""


class KVConnectorSpecDecodeScheduler(KVConnectorScheduler, SpecDecodeScheduler):
    """Chapters 03 + 04 + 06."""


class KVConnectorChunkedSpecDecodeScheduler(KVConnectorScheduler, ChunkedSpecDecodeScheduler):
    """Chapters 03 + 05 + 04 + 06."""


class EngineScheduler(BeamSearchScheduler, ChunkedSpecDecodeScheduler):
    """Chapters 03 + 05 + 04, parallel sampling and beam search."""


class EngineSchedulerNoChunking(BeamSearchScheduler, SpecDecodeScheduler):
    """Chapters 03 + 04, parallel sampling and beam search."""


class AsyncEngineScheduler(AsyncScheduler, EngineScheduler):
    """Chapters 03 + 05 + 04 with placeholders for the tokens in flight (async scheduling)."""


class AsyncEngineSchedulerNoChunking(AsyncScheduler, EngineSchedulerNoChunking):
    """Chapters 03 + 04 with placeholders for the tokens in flight (async scheduling)."""


def make_scheduler(config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                   connector: KVConnectorBase | None = None, async_scheduling: bool = False) -> SpecDecodeScheduler:
    """Chunking when `config` is chapter 05's config, remote K/V when there is a connector
    (the engine refuses n > 1 and beam search with a connector, so those compositions need no fork layer),
    placeholders for in-flight tokens with async scheduling (which the engine config refuses with a connector)."""
    chunked = isinstance(config, ChunkedPrefillConfig)
    if async_scheduling:
        if connector is not None:
            raise ValueError("async scheduling does not compose with a KV connector")
        cls = AsyncEngineScheduler if chunked else AsyncEngineSchedulerNoChunking
        return cls(config, kv_cache_manager)
    if connector is None:
        cls = EngineScheduler if chunked else EngineSchedulerNoChunking
        return cls(config, kv_cache_manager)
    cls = KVConnectorChunkedSpecDecodeScheduler if chunked else KVConnectorSpecDecodeScheduler
    return cls(config, kv_cache_manager, connector=connector)


__all__ = ["make_scheduler", "AsyncEngineScheduler", "AsyncEngineSchedulerNoChunking", "ChunkedSpecDecodeScheduler",
           "KVConnectorSpecDecodeScheduler", "KVConnectorChunkedSpecDecodeScheduler", "EngineScheduler", "EngineSchedulerNoChunking", "Scheduler"]
