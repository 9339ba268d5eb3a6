"""ParallelConfig: how many ranks, split how, run by which executor — checked against the model at start-up.

Mirrors vLLM's `vllm/config/parallel.py: ParallelConfig` (tensor_parallel_size, pipeline_parallel_size,
distributed_executor_backend, world_size) and the checks of `ModelConfig.verify_with_parallel_config`.
Every impossible split is refused here, before a worker process exists, with the number that does not
divide: a shape error in layer 17 of rank 2 after a minute of loading helps nobody.

    world size = tensor_parallel_size x pipeline_parallel_size     (rank = pp_rank x tp + tp_rank)
    per rank:  H / tp query heads, KVH / tp KV heads (or 1, replicated, when tp > KVH),
               I / tp MLP features, ~L / pp layers, vocab / tp embedding rows (padded)
"""
from __future__ import annotations

import dataclasses

import importlib.util
from dataclasses import dataclass

from kvcache.cache_engine import KVCacheSpec

from mini_vllm.config import ModelConfig

# None: "uni" for one rank, "mp" for more (vLLM's default on one node); "ray": one Ray actor per rank.
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    max_concurrent_batches_override: int | None = None     # EngineConfig.max_concurrent_batches

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        backend = self.distributed_executor_backend
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs the ray package (pip install ray); the "
                             "multiprocess executor ('mp') needs nothing more and covers one node")
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS} or None, got {backend!r}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank in the engine's process, but "
                             f"tensor_parallel_size x pipeline_parallel_size = {self.world_size}: use 'mp'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight at once: one per pipeline stage unless told otherwise (vLLM:
        MultiprocExecutor.max_concurrent_batches = pipeline_parallel_size)."""
        return self.max_concurrent_batches_override or self.pipeline_parallel_size


    @property
    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    def verify_with_model_config(self, model: ModelConfig) -> None:
        """ValueError naming what does not divide (vLLM: ModelConfig.verify_with_parallel_config)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if model.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {model.num_attention_heads} "
                             f"attention heads (each rank holds whole heads): use a divisor of "
                             f"{model.num_attention_heads}")
        kv = model.num_key_value_heads
        if tp > kv and tp % kv or tp <= kv and kv % tp:
            raise ValueError(f"tensor_parallel_size={tp} and the model's {kv} KV heads must divide one another "
                             f"(split the KV heads, or replicate each on tp / {kv} ranks)")
        if model.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={model.intermediate_size}")
        if pp > model.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {model.num_hidden_layers} layers "
                             "(every stage needs at least one)")

    def kv_cache_spec(self, model: ModelConfig, block_size: int) -> KVCacheSpec:
        """One rank's KV cache: its KV heads only, its stage's layers only. The engine sizes the pool
        by the largest rank (the first stage gets the extra layer when pp does not divide L), so the
        same number of blocks — and the same block tables — fit on every rank."""
        spec = model.kv_cache_spec(block_size)
        kv_heads = max(1, model.num_key_value_heads // self.tensor_parallel_size)
        layers = -(-model.num_hidden_layers // self.pipeline_parallel_size)
        return dataclasses.replace(spec, num_layers=layers, num_kv_heads=kv_heads)
