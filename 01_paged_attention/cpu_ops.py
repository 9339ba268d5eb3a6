"""Backend "cpu": chapter 01's ops on the CPU attention kernel (kernels_cpu/attention.py: C++ +
OpenMP + AVX-512 / AVX2, as vLLM's csrc/cpu), the rung beside the reference, Triton and CUDA.

    from paged_attention import cpu_ops
    cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    out = cpu_ops.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    out = cpu_ops.paged_prefill_attention(query, key, value, key_cache, value_cache, slot_mapping,
                                          query_start_loc, scale)                  # [T, H, D]
    cpu_ops.is_available()    # False (with unavailable_reason()) when no compiler / build fails

The same functions and signatures as every backend module here (reference.py, torch_ops.py,
triton_ops.py, cuda_ops.py), the same argument checks (checks.py) before the kernel runs; the
kernel then reads K/V in place through the block table. Why a kernel, how it is built (on first
use, for the best instruction set this CPU runs) and how it is tested: kernels_cpu/README.md.
"""
from __future__ import annotations

import torch

from kernels_cpu import attention as cpu_attention
from paged_attention import cache_ops, checks
from paged_attention.kv_quant import KVQuant


def is_available() -> bool:
    """True when the kernel is (or can be) built here. Builds it on the first call."""
    return cpu_attention.is_available()


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None when it can): no compiler, a failed build."""
    return cpu_attention.unavailable_reason()


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
    check_values: bool = True,
    *,
    kv_quant: KVQuant | None = None,   # an 8-bit cache: rows quantized as written (kv_quant.py)
) -> None:
    """The cache write as one C++ row copy or quantization (bit for bit the torch path's); caches
    whose head_dim axis is strided take the torch path (cache_ops), which handles any layout."""
    checks.check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values, kv_quant)
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        return cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=False,
                                           kv_quant=kv_quant)
    cpu_attention.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_quant=kv_quant)


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]: one new token per request
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32: KV tokens, the new one included (0: a padding row)
    scale: float,
    check_values: bool = True,
    *,
    max_seq_len: int | None = None,
    kv_quant: KVQuant | None = None,
) -> torch.Tensor:               # [num_seqs, num_heads, head_dim]
    seq_lens = checks.contiguous_index(seq_lens)
    checks.check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, check_values, max_seq_len,
                             kv_quant)
    return cpu_attention.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                kv_quant=kv_quant)


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]: the prompts back to back
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,      # (written)
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = don't cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int: cu_seqlens of the prompts
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,
    kv_quant: KVQuant | None = None,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    query_start_loc = checks.contiguous_index(query_start_loc)
    checks.check_prefill_args(query, key, value, key_cache, value_cache, slot_mapping, query_start_loc,
                              check_values, max_query_len, kv_quant)
    return cpu_attention.paged_prefill_attention(query, key, value, key_cache, value_cache, slot_mapping,
                                                 query_start_loc, scale, max_query_len=max_query_len,
                                                 kv_quant=kv_quant)
