"""Argument checks shared by every backend: a clear exception, never a silent wrong answer.

Two tiers, as in `cache_ops.check_cache_write_args`:
* shapes, dtypes, devices — free (metadata only), always checked;
* values (seq_lens vs. the blocks given, block ids vs. the cache, query_start_loc) — these
  read device tensors (a GPU sync, illegal under CUDA-graph capture), so the engine's hot
  path passes check_values=False once its own bookkeeping is trusted.
"""
from __future__ import annotations

import torch

from paged_attention.cache_ops import check_cache_write_args

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_cache_and_query(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be 3-D [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: query has {head_dim}, the cache {key_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) (GQA/MQA)")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {query.dtype}; expected one of {SUPPORTED_DTYPES}")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise TypeError(f"dtype mismatch: query {query.dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype}")
    if key_cache.device != query.device or value_cache.device != query.device:
        raise ValueError(f"device mismatch: query on {query.device}, caches on {key_cache.device} / {value_cache.device}")


def check_decode_args(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32
    check_values: bool = True,
) -> None:
    _check_cache_and_query(query, key_cache, value_cache)
    num_seqs = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_num_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError(f"block_tables and seq_lens must be int32, got {block_tables.dtype} and {seq_lens.dtype}")
    if block_tables.device != query.device or seq_lens.device != query.device:
        raise ValueError(f"device mismatch: query on {query.device}, block_tables on {block_tables.device}, "
                         f"seq_lens on {seq_lens.device}")
    if check_values and num_seqs:
        check_block_table_values(block_tables, seq_lens, key_cache.shape[0], key_cache.shape[1])


def check_block_table_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """seq_lens fit the blocks given, and every block a request USES exists in the cache.
    (Padding entries past a request's ceil(seq_len / block_size) blocks are never read.)"""
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {lo}")
    capacity = block_tables.shape[1] * block_size
    if hi > capacity:
        raise ValueError(f"seq_len {hi} is longer than the blocks given: block_tables hold {block_tables.shape[1]} "
                         f"blocks of {block_size} = {capacity} tokens per request")
    num_used = (seq_lens.long() + block_size - 1) // block_size                           # [num_seqs]
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < num_used[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise IndexError(f"block_tables reference blocks in [{int(ids.min())}, {int(ids.max())}] "
                         f"but the cache has blocks [0, {num_blocks})")


def check_prefill_args(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,     # [num_tokens]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    check_values: bool = True,
) -> None:
    _check_cache_and_query(query, key_cache, value_cache)
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values)
    if query.shape[0] != key.shape[0]:
        raise ValueError(f"query has {query.shape[0]} tokens but key/value have {key.shape[0]}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got {tuple(query_start_loc.shape)}")
    if query_start_loc.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"query_start_loc must be int32 or int64, got {query_start_loc.dtype}")
    if check_values:
        starts = query_start_loc.tolist()
        if starts[0] != 0 or starts[-1] != query.shape[0]:
            raise ValueError(f"query_start_loc must run from 0 to num_tokens={query.shape[0]}, got {starts}")
        if any(b < a for a, b in zip(starts[:-1], starts[1:])):
            raise ValueError(f"query_start_loc must be non-decreasing, got {starts}")
