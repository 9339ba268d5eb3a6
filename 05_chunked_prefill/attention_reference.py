"""Unified paged attention over a mixed batch — the PyTorch oracle.

One op for every step of a continuous-batching engine: each request i brings
`query_len[i] >= 1` new tokens whose K/V are already written to the cache (by
`paged_attention.reshape_and_cache`) and attends to all `seq_len[i]` tokens of its KV:
the `context_len[i] = seq_len[i] - query_len[i]` earlier ones (prefix-cache hits,
earlier chunks, earlier decode steps) and, causally, the new ones. Prefill is context 0,
decode is query 1, a chunk of a long prompt is both > 0 — same op, same metadata.

Mirrors vLLM's `unified_attention` (vllm/attention/ops/triton_unified_attention.py),
used by the Triton backend (vllm/v1/attention/backends/triton_attn.py), and the
varlen FlashAttention call in flash_attn.py (cu_seqlens_q, seqused_k, block_table).

Causal mask with an offset: query token j of request i sits at absolute position
`context_len[i] + j`, so it may see KV positions 0 .. context_len[i] + j.
"""
from __future__ import annotations

import torch


INDEX_DTYPES = (torch.int32, torch.int64)


def check_unified_attention_args(
    query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
    *, max_query_len: int | None = None, max_seq_len: int | None = None, check_values: bool = True,
) -> None:
    """Clear errors instead of silent wrong answers (shared by every backend).

    Shape, dtype and device checks read only tensor metadata. The rest reads the index
    tensors' values (a device sync on GPU, illegal inside CUDA-graph capture), so an
    engine that builds the metadata itself passes check_values=False on its hot path.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache/value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, cache {key_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA/MQA")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise TypeError(f"dtype mismatch: query {query.dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype}")
    if not query.dtype.is_floating_point:
        raise TypeError(f"query must be floating point, got {query.dtype}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 (or int64), got {t.dtype}")
    devices = {t.device for t in (query, key_cache, value_cache, query_start_loc, seq_lens, block_tables)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [num_seqs], got {tuple(seq_lens.shape)}")
    n = seq_lens.shape[0]
    if query_start_loc.shape != (n + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {n + 1}], got {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != n:
        raise ValueError(f"block_tables must be [num_seqs={n}, max_blocks], got {tuple(block_tables.shape)}")
    if n == 0 and query.shape[0]:
        raise ValueError(f"{query.shape[0]} query tokens but no sequences")
    if not check_values or n == 0:
        return
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != query.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to num_tokens={query.shape[0]}, got {query_start_loc.tolist()}")
    query_lens = query_start_loc[1:] - query_start_loc[:-1]                 # [num_seqs]
    if int(query_lens.min()) < 1:
        raise ValueError(f"every request needs query_len >= 1 (query_start_loc must be strictly increasing), got {query_start_loc.tolist()}")
    if bool((seq_lens < query_lens).any()):
        raise ValueError(f"seq_lens {seq_lens.tolist()} shorter than query lens {query_lens.tolist()}: seq_len counts the new tokens too")
    # An upper bound is fine (it only sizes tiles/buffers); a smaller value would cut work.
    if max_query_len is not None and max_query_len < int(query_lens.max()):
        raise ValueError(f"max_query_len={max_query_len} but a request has {int(query_lens.max())} new tokens")
    if max_seq_len is not None and max_seq_len < int(seq_lens.max()):
        raise ValueError(f"max_seq_len={max_seq_len} but a request has seq_len {int(seq_lens.max())}")
    block_size = key_cache.shape[1]
    if int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"seq_len {int(seq_lens.max())} needs more than the {block_tables.shape[1]} blocks of {block_size} in block_tables")
    # Only the blocks a request uses must be real; the row padding after them may hold anything.
    num_blocks_used = (seq_lens.long() + block_size - 1) // block_size     # [num_seqs]
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < num_blocks_used[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= key_cache.shape[0]):
        raise IndexError(f"block_tables reference blocks in [{int(ids.min())}, {int(ids.max())}] but the cache has {key_cache.shape[0]} blocks")


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_blocks, B, kvh, d] + one request's block ids -> its first seq_len rows [seq_len, kvh, d]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table_row[:num_blocks].long()]               # [num_blocks, B, kvh, d]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]             # [seq_len, kvh, d]


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,         # [num_seqs] int32 (context + query)
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # accepted for a uniform backend signature; only validated here
    max_seq_len: int | None = None,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """The clear per-request loop: gather, mask, softmax in fp32, weighted sum."""
    check_unified_attention_args(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                                 max_query_len=max_query_len, max_seq_len=max_seq_len, check_values=check_values)
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]          # query heads per KV head (GQA)
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    ### BEGIN SOLUTION
    for i, seq_len in enumerate(lens):
        q = query[starts[i]:starts[i + 1]].float()                            # [q_len, h, d]
        q_len = q.shape[0]
        k = gather_kv(key_cache, block_tables[i], seq_len).float()            # [seq_len, kvh, d]
        v = gather_kv(value_cache, block_tables[i], seq_len).float()
        k = k.repeat_interleave(group, dim=1)                                 # [seq_len, h, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale                   # [h, q_len, seq_len]
        context_len = seq_len - q_len
        q_pos = context_len + torch.arange(q_len, device=q.device)            # absolute positions
        k_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)                                 # [h, q_len, seq_len]
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    ### END SOLUTION
    return out
