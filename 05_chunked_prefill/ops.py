"""Backend dispatch: the one unified-attention entry point the engine calls.

The engine (chapter 07) calls this on every layer of every step; its config picks the
backend: "torch" (vectorized, the CPU default), "triton" (one kernel launch; CUDA, or
the Triton interpreter on a CPU), or "reference" (the per-request loop, the oracle).
All three take the same arguments and return the same [num_tokens, num_heads, head_dim].
"""
from __future__ import annotations

import torch

from chunked_prefill import attention_reference, attention_vectorized

BACKENDS = ("reference", "torch", "triton")


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cu_seqlens of the new tokens
    seq_lens: torch.Tensor,         # [num_seqs] int32: context + new tokens
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    scale: float,
    *,
    backend: str = "torch",
    max_query_len: int | None = None,   # upper bounds the caller knows (AttentionMetadata has them);
    max_seq_len: int | None = None,     # they let the Triton path pick tiles without a device sync
    check_values: bool = True,          # False: skip every check that reads tensor values (no sync)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Attention of every new token over its request's paged KV, causal with the context offset.

    The new tokens' K/V must already be in the cache (`paged_attention.reshape_and_cache`
    runs first), so request i reads all seq_lens[i] rows through block_tables[i].
    """
    kwargs = dict(max_query_len=max_query_len, max_seq_len=max_seq_len)
    args = (query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, check_values)
    if backend == "torch":
        return attention_vectorized.unified_attention(*args, **kwargs)
    if backend == "triton":
        from chunked_prefill import triton_ops     # imported lazily: triton is optional for the CPU path
        return triton_ops.unified_attention(*args, **kwargs)
    if backend == "reference":
        return attention_reference.unified_attention(*args, **kwargs)
    raise ValueError(f"unknown unified_attention backend {backend!r}; choose one of {BACKENDS}")
