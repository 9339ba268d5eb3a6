"""PagedAttention in plain PyTorch, one request at a time — the oracle every backend is
checked against (backend "reference").

The ladder, each rung checked against the one before:

1. `dense_attention`: attention over K/V stored contiguously. No paging at all; this is
   what "correct" means.
2. `paged_decode_attention`: the clear per-request loop. For each request, turn its
   block table into the slot of every history token (`gather_request_kv`), gather those
   rows, run (1).
3. `torch_ops.paged_decode_attention` (backend "torch"): the same maths for the whole
   batch in a few tensor ops; then the Triton, CUDA (and CPU) kernels.
4. `paged_prefill_attention`: causal attention over a ragged batch of prompts that also
   writes their K/V into the cache (so that later decode steps find it).

Conventions (shared with every other backend):
* caches are `[num_blocks, block_size, num_kv_heads, head_dim]` (vLLM's flash layout);
  an 8-bit cache (`kv_quant=`) stores rows quantized (kv_quant.py) and they are dequantized
  to the query's dtype as they are read;
* GQA/MQA: query head `h` reads KV head `h // (num_heads // num_kv_heads)`;
* softmax runs in fp32 whatever the input dtype; the output has the query's dtype;
* a request with seq_len 0 (a padding row) gets an all-zero output and reads nothing;
* any view of any input is fine (these loops index tensors, never raw storage).
"""
from __future__ import annotations

import torch

from paged_attention.block_table import slot_mapping_for_request
from paged_attention.checks import check_cache_write_args, check_decode_args, check_prefill_args
from paged_attention.kv_quant import KVQuant, quantize_rows, read_rows


def dense_attention(
    query: torch.Tensor,   # [q_len, num_heads, head_dim]
    key: torch.Tensor,     # [kv_len, num_kv_heads, head_dim]
    value: torch.Tensor,   # [kv_len, num_kv_heads, head_dim]
    scale: float,
    causal: bool = True,
) -> torch.Tensor:         # [q_len, num_heads, head_dim]
    """softmax(q k^T * scale) v over contiguous K/V; the queries are the LAST q_len positions.

    With causal=True query i sits at position kv_len - q_len + i and sees keys 0..that
    position (prefill: q_len == kv_len; decode: q_len == 1 sees everything).
    """
    q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    if kv_len == 0:
        return torch.zeros_like(query)
    ### BEGIN SOLUTION
    # GQA without copying K/V: view the query heads as [num_kv_heads, group] so that all
    # `group` query heads of one KV head meet that KV head in one einsum.
    q = query.float().reshape(q_len, num_kv_heads, group, head_dim)               # [q, kvh, g, d]
    scores = torch.einsum("qkgd,lkd->kgql", q, key.float()) * scale             # [kvh, g, q, kv_len]
    if causal:
        q_pos = kv_len - q_len + torch.arange(q_len, device=query.device)        # [q]
        k_pos = torch.arange(kv_len, device=query.device)                        # [kv_len]
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)                                        # [kvh, g, q, kv_len]
    out = torch.einsum("kgql,lkd->qkgd", probs, value.float())                   # [q, kvh, g, d]
    ### END SOLUTION
    return out.reshape(q_len, num_heads, head_dim).to(query.dtype)


def dense_decode_attention(
    query: torch.Tensor,          # [num_seqs, num_heads, head_dim]
    keys: list[torch.Tensor],     # per request: [seq_len_i, num_kv_heads, head_dim], contiguous
    values: list[torch.Tensor],   # per request: [seq_len_i, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:                # [num_seqs, num_heads, head_dim]
    """Rung 1 for a decode batch: each request's history stored contiguously, no blocks."""
    out = torch.empty_like(query)
    for i, (k, v) in enumerate(zip(keys, values)):
        out[i] = dense_attention(query[i:i + 1], k, v, scale, causal=False)[0]
    return out


def gather_request_kv(
    cache: torch.Tensor,            # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_num_blocks] int: one request's physical blocks, padded
    seq_len: int,
) -> torch.Tensor:                  # [seq_len, num_kv_heads, head_dim], contiguous
    """One request's first seq_len K (or V) rows, in logical order: slot by slot through
    its block table (the read side of `slot_mapping_for_request`)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    slots = slot_mapping_for_request(block_table_row[:num_blocks].tolist(), 0, seq_len, block_size)
    flat = cache.reshape(-1, *cache.shape[2:])              # [num_slots, kvh, d]: a slot is a row
    return flat[torch.tensor(slots, dtype=torch.long, device=cache.device)]


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim] (written in place)
    value_cache: torch.Tensor,   # (written in place)
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
    check_values: bool = True,
    *,
    kv_quant: KVQuant | None = None,   # an 8-bit cache: each row quantized as written (kv_quant.py)
) -> None:
    """The cache write, one token at a time: slot -> (block slot // B, row slot % B)."""
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values, kv_quant)
    block_size = key_cache.shape[1]
    ### BEGIN SOLUTION
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:                                          # -1: a padding token, write nothing
            k, v = key[t], value[t]                            # [kvh, d]
            if kv_quant is not None:
                k, v = quantize_rows(k, kv_quant, "k"), quantize_rows(v, kv_quant, "v")
            key_cache[slot // block_size, slot % block_size] = k
            value_cache[slot // block_size, slot % block_size] = v
    ### END SOLUTION


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]: one new token per request
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32: tokens of KV (history + the new token)
    scale: float,
    check_values: bool = True,
    *,
    max_seq_len: int | None = None,   # accepted for one signature across backends; only validated
    kv_quant: KVQuant | None = None,  # an 8-bit cache: rows dequantized as read (kv_quant.py)
) -> torch.Tensor:               # [num_seqs, num_heads, head_dim]
    """Rung 2: one request at a time, one history token at a time — nothing clever."""
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, check_values, max_seq_len, kv_quant)
    out = torch.empty_like(query)
    head_dim = query.shape[-1]
    ### BEGIN SOLUTION
    for i, seq_len in enumerate(seq_lens.tolist()):
        k = gather_request_kv(key_cache, block_tables[i], seq_len)            # [seq_len, kvh, d (+ 4)]
        v = gather_request_kv(value_cache, block_tables[i], seq_len)
        k = read_rows(k, kv_quant, "k", head_dim, query.dtype)                 # [seq_len, kvh, d]
        v = read_rows(v, kv_quant, "v", head_dim, query.dtype)
        out[i] = dense_attention(query[i:i + 1], k, v, scale, causal=False)[0]
    ### END SOLUTION
    return out


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]: all prompts back to back
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = don't cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cu_seqlens of the prompts
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # accepted for one signature across backends; only validated
    kv_quant: KVQuant | None = None,    # an 8-bit cache: the write quantizes (the attention uses fresh K/V)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Prompt phase: cache each prompt's K/V (for the decode steps to come) and run causal
    attention over the prompt itself, one request at a time.

    The attention uses the fresh K/V, not a read-back from the cache: the prompt's keys are
    right here, and vLLM's prefill path does the same (flash_attn_varlen_func on k, v).
    Prompts that continue an already-cached context are chapter 05's unified attention.
    """
    check_prefill_args(query, key, value, key_cache, value_cache, slot_mapping, query_start_loc, check_values,
                       max_query_len, kv_quant)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=False,   # checked just above
                      kv_quant=kv_quant)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for s, e in zip(starts[:-1], starts[1:]):
        out[s:e] = dense_attention(query[s:e], key[s:e], value[s:e], scale, causal=True)
    return out
