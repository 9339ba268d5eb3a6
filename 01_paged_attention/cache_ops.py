"""Writing new K/V into the paged cache: the one op every attention path starts with.

Mirrors vLLM's `reshape_and_cache_flash` (csrc/cache_kernels.cu, called from
vllm/v1/attention/backends/flash_attn.py): each new token's key and value rows are
scattered to the flat slot the block manager gave it, `slot = block_id * block_size +
offset`. A slot of -1 means "don't write" (padding tokens, as in vLLM).

This is the vectorized PyTorch write (backend "torch"); `reference.reshape_and_cache` is
the per-token loop it is checked against.
"""
from __future__ import annotations

import torch

from paged_attention.checks import check_cache_write_args

__all__ = ["check_cache_write_args", "reshape_and_cache"]


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim] (any strides)
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place, any strides)
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip (any view: indexing reads the view)
    check_values: bool = True,
) -> None:
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values)
    block_size = key_cache.shape[1]
    ### BEGIN SOLUTION
    keep = slot_mapping >= 0                                   # [num_tokens] bool
    slots = slot_mapping[keep].long()                          # [n]
    # slot -> (physical block, row in the block); a 2-D index writes through any cache strides.
    blocks, rows = slots // block_size, slots % block_size     # [n], [n]
    key_cache[blocks, rows] = key[keep]
    value_cache[blocks, rows] = value[keep]
    ### END SOLUTION
