"""Backend dispatch: the one unified-attention entry point the engine calls.

The engine (chapter 07) calls this on every layer of every step; its config picks the
backend, in the project's one vocabulary (chapter 01's `paged_attention.ops`):
"reference" (the per-request loop, the oracle), "torch" (vectorized SDPA), "triton" (one
kernel launch; CUDA, or the Triton interpreter on a CPU), "cpu" (the C++/OpenMP kernel of
kernels_cpu/attention.py, which handles the unified varlen case: K/V read in place through the
block table — the engine's CPU default when it builds).
All take the same arguments, in the project's one order

    (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, ...)

and return the same [num_tokens, num_heads, head_dim].

Per-step work: a backend may precompute what depends only on the step's metadata
(`build_attention_plan`, vLLM's per-backend AttentionMetadataBuilder.build) once, store
it in `AttentionMetadata.plan`, and every layer passes it as `plan=`.
"""
from __future__ import annotations

import torch

from chunked_prefill import attention_reference, attention_vectorized
from kernels_cpu import attention as cpu_attention
from paged_attention.checks import check_paged_attention_args, contiguous_index
from paged_attention.kv_quant import KVQuant
from paged_attention.metadata import AttentionMetadata

BACKENDS = ("reference", "torch", "triton", "cpu")
PLANNED_BACKENDS = ("torch",)      # backends whose per-step work build_attention_plan precomputes


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,         # [num_seqs] int32: context + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cu_seqlens of the new tokens
    scale: float,
    *,
    backend: str = "torch",
    max_query_len: int | None = None,   # upper bounds the caller knows (AttentionMetadata has them);
    max_seq_len: int | None = None,     # they let the Triton path pick tiles without a device sync
    check_values: bool = True,          # False: skip every check that reads tensor values (no sync)
    plan: object | None = None,         # build_attention_plan(...) for THIS step's metadata, or None
    kv_quant: KVQuant | None = None,    # an 8-bit cache (paged_attention.kv_quant): every backend reads it
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Attention of every new token over its request's paged KV, causal with the context offset.

    The new tokens' K/V must already be in the cache (`paged_attention.reshape_and_cache`
    runs first), so request i reads all seq_lens[i] rows through block_tables[i].
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown unified_attention backend {backend!r}; choose one of {BACKENDS}")
    if plan is not None and backend not in PLANNED_BACKENDS:
        raise ValueError(f"plan= is the {PLANNED_BACKENDS} backends' per-step precomputation; backend {backend!r} "
                         "takes none (build_attention_plan returns None for it)")
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, check_values)
    kwargs = dict(max_query_len=max_query_len, max_seq_len=max_seq_len)
    if kv_quant is not None:
        kwargs["kv_quant"] = kv_quant
    if backend == "torch":
        return attention_vectorized.unified_attention(*args, **kwargs, plan=plan)
    if backend == "triton":
        from chunked_prefill import triton_ops     # imported lazily: triton is optional for the CPU path
        return triton_ops.unified_attention(*args, **kwargs)
    if backend == "cpu":
        return cpu_unified_attention(*args, **kwargs)
    return attention_reference.unified_attention(*args, **kwargs)


def cpu_unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,         # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # validated only: the kernel plans its own tiles
    max_seq_len: int | None = None,
    kv_quant: KVQuant | None = None,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Backend "cpu": the checks every backend runs, then the C++ kernel (kernels_cpu/attention.py),
    which adds its own layout needs (CPU tensors, head_dim a multiple of 8)."""
    seq_lens, query_start_loc = contiguous_index(seq_lens), contiguous_index(query_start_loc)
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                               check_values=check_values, max_query_len=max_query_len, max_seq_len=max_seq_len,
                               kv_quant=kv_quant)
    return cpu_attention.unified_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                           scale, kv_quant=kv_quant)


def build_attention_plan(attn_metadata: AttentionMetadata, block_size: int, backend: str) -> object | None:
    """What `backend` can precompute once per step from `attn_metadata` (None: nothing).

    Call it once per step, attach the result with
    `dataclasses.replace(attn_metadata, plan=...)`, and pass `plan=attn_metadata.plan` to
    every layer's `unified_attention`. The plan holds the very metadata tensors it was
    built from; a call with other tensors refuses it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown unified_attention backend {backend!r}; choose one of {BACKENDS}")
    if backend != "torch":
        return None
    md = attn_metadata
    return attention_vectorized.build_plan(md.block_tables, md.seq_lens, md.query_start_loc, block_size)
