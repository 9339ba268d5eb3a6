"""Unified paged attention over a mixed batch — the PyTorch oracle (backend "reference").

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
`context_len[i] + j`, so it may see KV positions 0 .. context_len[i] + j — which is
exactly chapter 01's `dense_attention(causal=True)` ("the queries are the LAST q_len
positions"). So this oracle is chapter 01's pieces, unchanged: gather a request's K/V
through its block table (`gather_request_kv`), run `dense_attention`; and chapter 01's
`check_paged_attention_args` checks the arguments for every backend of this chapter.
"""
from __future__ import annotations

import torch

from paged_attention.checks import check_paged_attention_args
from paged_attention.kv_quant import KVQuant, read_rows
from paged_attention.reference import dense_attention, gather_request_kv

# The reference and torch backends run any float dtype (the kernels: fp32/fp16/bf16).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,         # [num_seqs] int32 (context + query)
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # accepted for a uniform backend signature; only validated here
    max_seq_len: int | None = None,
    kv_quant: KVQuant | None = None,    # an 8-bit cache: rows dequantized as read (paged_attention.kv_quant)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """The clear per-request loop: gather the request's K/V, dense causal attention in fp32."""
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                               check_values=check_values, max_query_len=max_query_len, max_seq_len=max_seq_len,
                               dtypes=FLOAT_DTYPES, kv_quant=kv_quant)
    head_dim = query.shape[-1]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    ### BEGIN SOLUTION
    for i, seq_len in enumerate(lens):
        k = gather_request_kv(key_cache, block_tables[i], seq_len)            # [seq_len, kvh, d (+ 4)]
        v = gather_request_kv(value_cache, block_tables[i], seq_len)
        k = read_rows(k, kv_quant, "k", head_dim, query.dtype)                 # [seq_len, kvh, d]
        v = read_rows(v, kv_quant, "v", head_dim, query.dtype)
        # the new tokens are the last query_len of the seq_len positions: causal, offset by the context
        out[starts[i]:starts[i + 1]] = dense_attention(query[starts[i]:starts[i + 1]], k, v, scale, causal=True)
    ### END SOLUTION
    return out
