"""One dispatch point for chapter 01's ops: `backend` = "torch" | "triton" | "cuda".

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values, backend)
    paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, backend, ...)
    paged_prefill_attention(query, key, value, key_cache, value_cache, slot_mapping,
                            query_start_loc, scale, backend, ...)

Every backend takes the same tensors and gives the same answer (to the dtype's rounding;
cache writes bit for bit). "torch" is the reference and runs anywhere. "triton" runs on a
GPU, or on CPU tensors under TRITON_INTERPRET=1. "cuda" needs a GPU; for prefill it writes
the cache with the CUDA kernel and runs the attention with the Triton kernel, as vLLM's V0
XFormers backend paired its CUDA paged_attention (decode) with a Triton prefix-prefill kernel.
Backend-specific knobs (num_splits for Triton, version for CUDA) are keyword-only.
"""
from __future__ import annotations

import torch

from paged_attention import cache_ops, reference

BACKENDS = ("torch", "triton", "cuda")


def check_backend(backend: str, device: torch.device) -> None:
    """Fail loudly for a backend this machine (or these tensors) cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda' needs an NVIDIA GPU and a CUDA build of torch; "
                               "use backend='torch' (or 'triton' with TRITON_INTERPRET=1) on CPU")
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' needs tensors on the GPU, got {device}")
    if backend == "triton" and device.type != "cuda":
        from paged_attention.triton_ops import interpreting
        if not interpreting():
            raise RuntimeError(f"backend='triton' on {device} tensors needs TRITON_INTERPRET=1 set before triton "
                               "is imported (the Triton interpreter); on a GPU pass CUDA tensors")


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,   # (written)
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
    check_values: bool = True,
    backend: str = "torch",
) -> None:
    check_backend(backend, key.device)
    if backend == "torch":
        cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values)
    elif backend == "triton":
        from paged_attention import triton_ops
        triton_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values)
    else:
        from paged_attention import cuda_ops
        cuda_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values)


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]: one new token per request
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32: KV tokens per request, the new one included
    scale: float,
    backend: str = "torch",
    *,
    check_values: bool = True,
    max_seq_len: int | None = None,   # AttentionMetadata.max_seq_len (saves a device read)
    num_splits: int | None = None,    # triton: split-KV factor (None = heuristic)
    version: str | None = None,       # cuda: "v1" | "v2" (None = vLLM's rule)
) -> torch.Tensor:                    # [num_seqs, num_heads, head_dim]
    check_backend(backend, query.device)
    if backend == "torch":
        if num_splits is not None or version is not None:
            raise ValueError("num_splits / version select Triton / CUDA kernel variants; the torch backend has none")
        return reference.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, check_values)
    if backend == "triton":
        if version is not None:
            raise ValueError("version= selects the CUDA kernel (v1/v2); for Triton use num_splits=")
        from paged_attention import triton_ops
        return triton_ops.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                 check_values, num_splits=num_splits, max_seq_len=max_seq_len)
    if num_splits is not None:
        raise ValueError("num_splits= selects the Triton split-KV variant; for CUDA use version='v1'|'v2'")
    from paged_attention import cuda_ops
    return cuda_ops.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                           check_values, version=version, max_seq_len=max_seq_len)


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]: the prompts back to back
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,      # (written)
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = don't cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cu_seqlens of the prompts
    scale: float,
    backend: str = "torch",
    *,
    check_values: bool = True,
    max_query_len: int | None = None,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    check_backend(backend, query.device)
    if backend == "torch":
        return reference.paged_prefill_attention(query, key, value, key_cache, value_cache, slot_mapping,
                                                 query_start_loc, scale, check_values)
    from paged_attention import triton_ops
    if backend == "triton":
        return triton_ops.paged_prefill_attention(query, key, value, key_cache, value_cache, slot_mapping,
                                                  query_start_loc, scale, check_values, max_query_len=max_query_len)
    from paged_attention import cuda_ops
    from paged_attention.checks import check_prefill_args
    check_prefill_args(query, key, value, key_cache, value_cache, slot_mapping, query_start_loc, check_values)
    cuda_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=False)
    return triton_ops.prefill_attention(query, key, value, query_start_loc, scale, max_query_len)
