"""Our model's logits for whole prompts, run as one ragged prefill through a paged cache: the
model-level oracle comparisons of chapters 09 and 10 (imported by name)."""
from __future__ import annotations

import random

import torch

from mini_vllm.config import ModelConfig
from mini_vllm.model_inputs import prepare_inputs


@torch.inference_mode()
def paged_logits(model, config: ModelConfig, prompts: list[list[int]], block_size: int = 4) -> torch.Tensor:
    """Every token's fp32 logits [T, vocab] of `prompts` run as ONE ragged prefill through a paged
    cache (shuffled blocks, NaN in every slot nobody wrote). The LoRA mapping is the caller's."""
    needed = [-(-len(p) // block_size) for p in prompts]
    kv_caches = config.kv_cache_spec(block_size).allocate_per_layer(sum(needed) + 2, "cpu")
    for k, v in kv_caches:           # junk: NaN, or in an 8-bit cache bytes that read as huge numbers
        for cache in (k, v):
            cache.view(torch.uint8).fill_(0x7F) if cache.element_size() == 1 else cache.fill_(float("nan"))
    free = list(range(sum(needed) + 2))
    random.Random(0).shuffle(free)
    blocks = [[free.pop() for _ in range(n)] for n in needed]
    inputs = prepare_inputs(prompts, [0] * len(prompts), blocks, block_size)
    hidden = model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn_metadata)
    return model.compute_logits(hidden)
