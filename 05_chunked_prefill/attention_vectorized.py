"""Unified paged attention, vectorized for the CPU: the engine's `backend="torch"` path.

The reference loop runs one small attention per request, and a CPU engine calls it on
every layer of every step: 64 decode requests x 30 layers is ~2000 tiny einsums per
token step, dominated by Python and dispatch overhead. This path does the same math in
a few large calls:

1. *Group* requests that can share one SDPA call (`plan_sub_batches`): the same
   query_len (so queries need no padding: a decode batch is one group, a spec-decode
   batch with k drafts is one group, a long prefill chunk is a group of its own), sorted
   by seq_len and cut into sub-batches of at most `kv_rows_per_batch` padded KV rows.
   Sorting keeps the padding to each sub-batch's longest sequence small; the cap keeps
   the gathered K/V cache-sized, so SDPA reads them back from L2/L3 rather than DRAM
   (one padded batch of 64 x 768 rows allocates and streams ~40 MB per cache). The
   Python loop is over sub-batches (~10 for 64 decodes), not requests.
2. *Gather* each sub-batch's K/V through the block table into a padded
   [m, longest seq_len, num_kv_heads, head_dim] tensor (one index_select per cache)
   and zero the rows past each request's seq_len: the row padding of
   block_tables and the unused slots of a last block may hold junk, even NaN, and
   SDPA multiplies masked-out V rows by 0 — which keeps NaN.
3. *One SDPA call* with GQA done by `enable_gqa=True` (K/V keep num_kv_heads; no copy
   per query head) and the causal mask offset by each request's context: query j of
   request i (position seq_len[i] - query_len + j) sees keys 0 .. that position. A
   sub-batch of fresh prompts of one length needs no mask tensor: `is_causal=True`
   lets SDPA's fused kernel skip the masked half.

Numerics: SDPA in the input dtype with fp32 accumulation; matches the fp32 reference
within the per-dtype tolerance table. Same signature as the reference; like it, this
path reads query_start_loc/seq_lens on the host to plan the work (it is the CPU path:
on a GPU the Triton backend needs no host reads).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from chunked_prefill.attention_reference import check_unified_attention_args

# 2048 rows x 3 KV heads x 64 dims x 4 bytes = 1.5 MB per gathered K (and V) for SmolLM2
# fp32: SDPA reads the gathered K/V while they are still in L2/L3. Chosen by
# `python -m benchmarks.bench_unified_attention --sweep-rows` (64 decodes, 2-core EPYC:
# 1536-3072 rows are best; 512 pays per-call overhead, 8192+ spills the caches, one
# padded 64 x 768 batch is ~4x slower).
KV_ROWS_PER_BATCH = 2048


def plan_sub_batches(query_lens: list[int], seq_lens: list[int],
                     kv_rows_per_batch: int = KV_ROWS_PER_BATCH) -> list[list[int]]:
    """Split requests into sub-batches that one SDPA call can serve.

    Every sub-batch shares one query_len and lists request indices in ascending
    seq_len; its padded KV (count x longest seq_len) exceeds kv_rows_per_batch only
    when a single request alone is longer. Groups come in ascending query_len.
    """
    ### BEGIN SOLUTION
    by_query_len: dict[int, list[int]] = defaultdict(list)
    for i, q_len in enumerate(query_lens):
        by_query_len[q_len].append(i)
    batches = []
    for q_len in sorted(by_query_len):
        batch: list[int] = []
        for i in sorted(by_query_len[q_len], key=lambda i: (seq_lens[i], i)):
            if batch and (len(batch) + 1) * seq_lens[i] > kv_rows_per_batch:
                batches.append(batch)
                batch = []
            batch.append(i)
        batches.append(batch)
    ### END SOLUTION
    return batches


def _gather_padded(cache: torch.Tensor, blocks: torch.Tensor, seq_lens: torch.Tensor,
                   shortest: int, longest: int) -> torch.Tensor:
    """[num_blocks, B, kvh, d] x blocks [m, nb] -> [m, longest, kvh, d], zero past each seq_len.

    Rows before `shortest` (the sub-batch's smallest seq_len) are real for every request,
    so only rows shortest..longest are masked: after sorting by length that is few.
    """
    m, nb = blocks.shape
    kv = cache.index_select(0, blocks.reshape(-1)).view(m, nb * cache.shape[1], *cache.shape[2:])[:, :longest]
    pad = torch.arange(shortest, longest, device=kv.device)[None, :] >= seq_lens[:, None]   # [m, longest - shortest]
    kv[:, shortest:].masked_fill_(pad[:, :, None, None], 0)
    return kv


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,         # [num_seqs] int32
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # accepted for a uniform backend signature; only validated
    max_seq_len: int | None = None,
    kv_rows_per_batch: int = KV_ROWS_PER_BATCH,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    check_unified_attention_args(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                                 max_query_len=max_query_len, max_seq_len=max_seq_len, check_values=check_values)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    block_size = key_cache.shape[1]
    device = query.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    starts_t = query_start_loc.to(device=device, dtype=torch.long)
    seq_lens_t = seq_lens.to(dtype=torch.long)
    # Row padding past a request's last block may hold junk ids: any real block will do,
    # its rows get zeroed and masked.
    in_use = torch.arange(block_tables.shape[1], device=device)[None, :] < (seq_lens_t[:, None] + block_size - 1) // block_size
    safe_tables = torch.where(in_use, block_tables, 0).long()           # [num_seqs, max_blocks]
    ### BEGIN SOLUTION
    for batch in plan_sub_batches(query_lens, lens, kv_rows_per_batch):
        q_len = query_lens[batch[0]]
        shortest, longest = lens[batch[0]], lens[batch[-1]]             # sorted ascending
        reqs = torch.tensor(batch, device=device)                       # [m]
        sl = seq_lens_t[reqs]                                           # [m]
        tokens = starts_t[reqs][:, None] + torch.arange(q_len, device=device)   # [m, q_len]
        q = query[tokens].transpose(1, 2)                               # [m, h, q_len, d]
        blocks = safe_tables[reqs, :-(-longest // block_size)]          # [m, blocks of the longest]
        k = _gather_padded(key_cache, blocks, sl, shortest, longest).transpose(1, 2)   # [m, kvh, longest, d]
        v = _gather_padded(value_cache, blocks, sl, shortest, longest).transpose(1, 2)
        if shortest == longest == q_len:
            # Fresh prompts of one length: plain causal, which SDPA's fused kernel runs
            # without a mask tensor, skipping the masked half.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            last_visible = (sl - q_len)[:, None] + torch.arange(q_len, device=device)          # [m, q_len]
            mask = torch.arange(longest, device=device) <= last_visible[:, :, None]            # [m, q_len, longest]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
        out[tokens] = o.transpose(1, 2)                                 # o: [m, h, q_len, d]
    ### END SOLUTION
    return out
