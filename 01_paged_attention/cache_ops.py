"""Writing new K/V into the paged cache: the one op every attention path starts with.

Mirrors vLLM's `reshape_and_cache_flash` (csrc/cache_kernels.cu, called from
vllm/v1/attention/backends/flash_attn.py): each new token's key and value rows are
scattered to the flat slot the block manager gave it, `slot = block_id * block_size +
offset`. A slot of -1 means "don't write" (padding tokens, as in vLLM).
"""
from __future__ import annotations

import torch


def check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values: bool = True) -> None:
    """Clear errors instead of silent wrong answers (shared by every backend).

    Shape/dtype checks cost nothing. The range check reads slot_mapping (a device sync on
    GPU, and illegal inside CUDA-graph capture), so an engine that builds slot_mapping
    itself passes check_values=False on its hot path.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim]; got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key rows {tuple(key.shape[1:])} do not match cache rows {tuple(key_cache.shape[2:])} (num_kv_heads, head_dim)")
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise TypeError(f"dtype mismatch: key {key.dtype} / value {value.dtype} vs cache {key_cache.dtype} / {value_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if check_values and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise IndexError(f"slot_mapping holds slots in [{lo}, {hi}] but the cache has slots [0, {num_slots}) (-1 = skip)")


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
    check_values: bool = True,
) -> None:
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values)
    ### BEGIN SOLUTION
    keep = slot_mapping >= 0                                   # [num_tokens] bool
    slots = slot_mapping[keep].long()                          # [n]
    # View the cache as one flat array of slots; then a slot is just a row index.
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]
    ### END SOLUTION
