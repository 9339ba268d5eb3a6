"""Writing new K/V into the paged cache: the one op every attention path starts with.

Mirrors vLLM's `reshape_and_cache_flash` (csrc/cache_kernels.cu, called from
vllm/v1/attention/backends/flash_attn.py): each new token's key and value rows are
scattered to the flat slot the block manager gave it, `slot = block_id * block_size +
offset`. A slot of -1 means "don't write" (padding tokens, as in vLLM). An 8-bit cache
(`kv_quant`, kv_quant.py) stores each row quantized, as vLLM's kernel does when given
kv_cache_dtype and k_scale / v_scale.

This is the vectorized PyTorch write (backend "torch"); `reference.reshape_and_cache` is
the per-token loop it is checked against.
"""
from __future__ import annotations

import torch

from paged_attention.checks import check_cache_write_args
from paged_attention.kv_quant import KVQuant, quantize_rows

__all__ = ["check_cache_write_args", "reshape_and_cache"]


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim] (any strides)
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place, any strides)
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip (any view: indexing reads the view)
    check_values: bool = True,
    *,
    kv_quant: KVQuant | None = None,   # an 8-bit cache (kv_quant.py): rows are quantized as written
) -> None:
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values, kv_quant)
    block_size = key_cache.shape[1]
    ### BEGIN SOLUTION
    keep = slot_mapping >= 0                                   # [num_tokens] bool
    slots = slot_mapping[keep].long()                          # [n]
    # slot -> (physical block, row in the block); a 2-D index writes through any cache strides.
    blocks, rows = slots // block_size, slots % block_size     # [n], [n]
    if kv_quant is None:
        key_cache[blocks, rows] = key[keep]
        value_cache[blocks, rows] = value[keep]
    else:
        key_cache[blocks, rows] = quantize_rows(key[keep], kv_quant, "k")        # [n, kvh, head_dim (+ 4)]
        value_cache[blocks, rows] = quantize_rows(value[keep], kv_quant, "v")
    ### END SOLUTION
