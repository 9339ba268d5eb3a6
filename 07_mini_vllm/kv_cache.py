"""The paged KV cache tensors the models read and write: one (key_cache, value_cache) per layer.

Layout [num_blocks, block_size, num_kv_heads, head_dim] — chapter 01's, which is vLLM's
FlashAttention layout (vllm/v1/attention/backends/flash_attn.py: `get_kv_cache_shape`), so a
token's K for all heads is one contiguous row and `slot = block_id * block_size + offset`
addresses it. vLLM allocates these in `GPUModelRunner.initialize_kv_cache` once it knows how
many blocks fit in memory (`kv_cache_bytes_per_block` is the divisor of that computation).
"""
from __future__ import annotations

import torch

from mini_vllm.config import ModelConfig


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes one block costs across all layers, K and V: 2 * layers * block_size * kv_heads * head_dim * itemsize."""
    itemsize = torch.empty((), dtype=dtype or config.dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * itemsize


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero-filled caches, one (key_cache, value_cache) per layer, in the model's dtype by default."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
    shape = kv_cache_shape(config, num_blocks, block_size)
    dtype = dtype or config.dtype
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)]
