"""The engine's scheduler: chapter 03's core, with what chapters 04, 05 and 06 add to it.

Each later chapter adds its mechanism by overriding chapter 03's hooks (`_num_new_tokens`,
`_on_scheduled`, `_build_output`, `_try_admit`, ...) and calling `super()`; the class below lists
them, and Python's method resolution order chains the overrides, leftmost first:

    EngineScheduler
      -> StructuredOutputScheduler (07/08: grammars compiled, advanced, asked for masks; none without)
      -> LoRAScheduler            (07/09: at most max_loras adapters per step; no rule without LoRA)
      -> KVConnectorScheduler     (06: K/V from other machines; chapter 03's when the connector is None)
        -> SpecDecodeScheduler    (04: speculative tokens ride along in Δ; none without drafts)
          -> ChunkedPrefillScheduler  (05: Δ cut into chunks when enable_chunked_prefill)
            -> Scheduler          (03: two counters, a budget, preemption, the prefix cache)

    AsyncScheduler(EngineScheduler)   (async_scheduler.py, chapter 07's one layer: batches in flight)

so that, e.g., a decoding request's Δ is chapter 05's chunk (here: its one token) plus chapter
04's drafts, and the output chapter 06 hands its connector already carries those drafts. vLLM has
one `Scheduler` class with all of it inline (`vllm/v1/core/sched/scheduler.py`) and
`AsyncScheduler(Scheduler)` beside it; the split here is for reading, one chapter at a time. The
engine core talks to the scheduler only through its public methods (vLLM's `SchedulerInterface`):
`add_request`, `schedule`, `get_grammar_bitmask`, `update_from_output`, `update_draft_token_ids`,
`finish_requests`, `has_unfinished_requests`, `get_request_counts`.
"""
from __future__ import annotations

import dataclasses

from chunked_prefill import ChunkedPrefillConfig, ChunkedPrefillScheduler
from global_prefix_cache.scheduler import KVConnectorBase, KVConnectorScheduler
from kvcache import KVCacheManager
from scheduler import SchedulerConfig
from spec_decode.scheduler import SpecDecodeScheduler

from mini_vllm.lora_scheduler import LoRAScheduler
from mini_vllm.structured_output_scheduler import StructuredOutputScheduler


class EngineScheduler(StructuredOutputScheduler, LoRAScheduler, KVConnectorScheduler, SpecDecodeScheduler,
                      ChunkedPrefillScheduler):
    """Chapters 03 + 05 + 04 + 06 (+ 08's grammars, 09's adapters): each layer is the one below it when its
    feature is off."""


def make_scheduler(config: SchedulerConfig, kv_cache_manager: KVCacheManager, connector: KVConnectorBase | None = None,
                   *, async_scheduling: bool = False, max_concurrent_batches: int = 1,
                   pipeline_parallel_size: int = 1, max_loras: int | None = None) -> EngineScheduler:
    """The engine's scheduler; with batches in flight (async scheduling, pipeline micro-batches) or
    pipeline stages that do not sample, chapter 07's AsyncScheduler on top. A chapter 03
    SchedulerConfig is chapter 05's with chunking off. max_loras: adapters per step (None: no LoRA)."""
    if not isinstance(config, ChunkedPrefillConfig):
        config = ChunkedPrefillConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(SchedulerConfig)})
    if max_concurrent_batches == 1 and pipeline_parallel_size == 1:
        scheduler = EngineScheduler(config, kv_cache_manager, connector=connector)
    else:
        from mini_vllm.async_scheduler import AsyncScheduler
        scheduler = AsyncScheduler(config, kv_cache_manager, connector=connector, placeholders=async_scheduling,
                                   max_concurrent_batches=max_concurrent_batches)
    scheduler.max_loras = max_loras
    return scheduler


__all__ = ["EngineScheduler", "make_scheduler"]
