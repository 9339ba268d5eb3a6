"""Unified paged attention, vectorized for the CPU: the engine's `backend="torch"` path.

The reference loop runs one small attention per request, and a CPU engine calls it on
every layer of every step: 64 decode requests x 30 layers is ~2000 tiny einsums per
token step, dominated by Python and dispatch overhead. This path does the same math in
a few large calls, in two phases:

`build_plan` — once per STEP (it depends only on query_start_loc, seq_lens, block_tables
and the block size, which every layer shares; vLLM's per-backend
`AttentionMetadataBuilder.build` has the same job):
1. *Group* requests that can share one SDPA call (`plan_sub_batches`): the same
   query_len (so queries need no padding: a decode batch is one group, a spec-decode
   batch with k drafts is one group, a long prefill chunk is a group of its own), sorted
   by seq_len and cut into sub-batches of at most `kv_rows_per_batch` padded KV rows.
   Sorting keeps the padding to each sub-batch's longest sequence small; the cap keeps
   the gathered K/V cache-sized, so SDPA reads them back from L2/L3 rather than DRAM
   (one padded batch of 64 x 768 rows allocates and streams ~40 MB per cache).
2. For each sub-batch, the index tensors and masks: the token rows of its queries, its
   block ids (row padding past a request's blocks replaced by block 0: it may hold junk
   ids), which gathered KV rows lie past each seq_len, and the offset-causal mask.
   Building these is ~20 small ops and host reads per sub-batch: done once per step
   instead of once per layer (30x fewer for SmolLM2).

`unified_attention(..., plan=)` — once per LAYER, only the data movement and the maths:
3. *Gather* each sub-batch's K/V through its block ids into a padded
   [m, longest seq_len, num_kv_heads, head_dim] tensor (one index_select per cache) and
   zero the rows past each request's seq_len: the unused slots of a last block may hold
   junk, even NaN, and SDPA multiplies masked-out V rows by 0 — which keeps NaN.
4. *One SDPA call* with GQA done by `enable_gqa=True` (K/V keep num_kv_heads; no copy
   per query head) and the causal mask offset by each request's context: query j of
   request i (position seq_len[i] - query_len + j) sees keys 0 .. that position. A
   sub-batch of fresh prompts of one length needs no mask tensor: `is_causal=True`
   lets SDPA's fused kernel skip the masked half.

Numerics: SDPA in the input dtype with fp32 accumulation; matches the fp32 reference
within the per-dtype tolerance table. Same signature as the reference; like it, the plan
reads query_start_loc/seq_lens on the host (it is the CPU path: on a GPU the Triton
backend needs no host reads and no plan).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunked_prefill.attention_reference import FLOAT_DTYPES
from paged_attention.checks import check_paged_attention_args
from paged_attention.kv_quant import KVQuant, read_rows

# 2048 rows x 3 KV heads x 64 dims x 4 bytes = 1.5 MB per gathered K (and V) for SmolLM2
# fp32: SDPA reads the gathered K/V while they are still in L2/L3; fewer rows pay more calls,
# more rows spill the caches. Chosen by `python -m benchmarks.bench_unified_attention --sweep-rows`.
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


@dataclass(frozen=True)
class SubBatch:
    """Requests served by one SDPA call; everything but the K/V data."""
    query_len: int                 # every request of the sub-batch brings this many new tokens
    shortest: int                  # smallest seq_len (rows < shortest are real for every request)
    longest: int                   # largest seq_len: the padded KV length
    tokens: torch.Tensor           # [m, query_len] long: rows of query / out
    blocks: torch.Tensor           # [m, ceil(longest / block_size)] long: physical blocks, padding -> 0
    kv_pad: torch.Tensor           # [m, longest - shortest] bool: gathered rows past each seq_len (zeroed)
    mask: torch.Tensor | None      # [m, 1, query_len, longest] bool offset-causal; None: plain causal


@dataclass(frozen=True)
class AttentionPlan:
    """The torch backend's per-step precomputation (AttentionMetadata.plan).

    Keeps the metadata tensors it was built from: a call must pass those same tensors
    (an O(1) identity check), so a plan can never be applied to another step's batch.
    """
    block_tables: torch.Tensor     # [num_seqs, max_blocks]: the tensors the plan was built from
    seq_lens: torch.Tensor         # [num_seqs]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    num_tokens: int
    block_size: int
    kv_rows_per_batch: int
    sub_batches: tuple[SubBatch, ...]

    def check_matches(self, query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
        if query.shape[0] != self.num_tokens or key_cache.shape[1] != self.block_size:
            raise ValueError(f"this attention plan was built for {self.num_tokens} tokens in blocks of "
                             f"{self.block_size}; the call has {query.shape[0]} tokens in blocks of {key_cache.shape[1]}: "
                             "build the plan from this step's metadata (or pass plan=None)")
        if not (block_tables is self.block_tables and seq_lens is self.seq_lens
                and query_start_loc is self.query_start_loc):
            raise ValueError("this attention plan was built from other block_tables / seq_lens / query_start_loc "
                             "tensors than the ones passed: build it from this step's metadata (or pass plan=None)")


def build_plan(
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int
    seq_lens: torch.Tensor,         # [num_seqs] int
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int
    block_size: int,
    kv_rows_per_batch: int = KV_ROWS_PER_BATCH,
) -> AttentionPlan:
    """Everything of a step's attention that does not depend on the layer (see the module
    doc). Reads query_start_loc / seq_lens on the host; no argument checks (the caller's
    `unified_attention` checks the tensors themselves)."""
    device = block_tables.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    sub_batches = []
    ### BEGIN SOLUTION
    starts_t = query_start_loc.to(device=device, dtype=torch.long)                   # [num_seqs + 1]
    seq_lens_t = seq_lens.to(device=device, dtype=torch.long)                        # [num_seqs]
    for batch in plan_sub_batches(query_lens, lens, kv_rows_per_batch):
        q_len = query_lens[batch[0]]
        shortest, longest = lens[batch[0]], lens[batch[-1]]                          # sorted ascending
        reqs = torch.tensor(batch, device=device)                                    # [m]
        sl = seq_lens_t[reqs]                                                        # [m]
        tokens = starts_t[reqs][:, None] + torch.arange(q_len, device=device)        # [m, q_len]
        num_blocks = -(-longest // block_size)
        in_use = torch.arange(num_blocks, device=device)[None, :] < (sl[:, None] + block_size - 1) // block_size
        blocks = torch.where(in_use, block_tables[reqs, :num_blocks].long(), 0)      # [m, num_blocks]
        kv_pad = torch.arange(shortest, longest, device=device)[None, :] >= sl[:, None]   # [m, longest - shortest]
        mask = None
        if not shortest == longest == q_len:
            # Fresh prompts of one length need no mask tensor: SDPA's is_causal skips the masked half.
            last_visible = (sl - q_len)[:, None] + torch.arange(q_len, device=device)          # [m, q_len]
            mask = (torch.arange(longest, device=device) <= last_visible[:, :, None])[:, None]  # [m, 1, q_len, longest]
        sub_batches.append(SubBatch(q_len, shortest, longest, tokens, blocks, kv_pad, mask))
    ### END SOLUTION
    return AttentionPlan(block_tables, seq_lens, query_start_loc, starts[-1] if starts else 0, block_size,
                         kv_rows_per_batch, tuple(sub_batches))


def _gather_padded(cache: torch.Tensor, sb: SubBatch) -> torch.Tensor:
    """[num_blocks, B, kvh, d] -> [m, longest, kvh, d]: the sub-batch's K (or V), zero past each seq_len."""
    m, nb = sb.blocks.shape
    # fp8 has no masked_fill: move an fp8 cache's bytes (a zero byte is fp8's 0.0, and a zero scale)
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    kv = raw.index_select(0, sb.blocks.reshape(-1)).view(m, nb * cache.shape[1], *cache.shape[2:])[:, :sb.longest]
    kv[:, sb.shortest:].masked_fill_(sb.kv_pad[:, :, None, None], 0)   # only rows shortest..longest can be padding
    return kv.view(cache.dtype)


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,         # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # accepted for a uniform backend signature; only validated
    max_seq_len: int | None = None,
    plan: AttentionPlan | None = None,  # build_plan(...) of these very tensors; None: build it here
    kv_rows_per_batch: int | None = None,   # with plan=None: the sub-batch cap (default KV_ROWS_PER_BATCH)
    kv_quant: KVQuant | None = None,    # an 8-bit cache: the gathered rows are dequantized (paged_attention.kv_quant)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                               check_values=check_values, max_query_len=max_query_len, max_seq_len=max_seq_len,
                               dtypes=FLOAT_DTYPES, kv_quant=kv_quant)
    head_dim = query.shape[-1]
    if plan is None:
        plan = build_plan(block_tables, seq_lens, query_start_loc, key_cache.shape[1],
                          KV_ROWS_PER_BATCH if kv_rows_per_batch is None else kv_rows_per_batch)
    else:
        if kv_rows_per_batch is not None:
            raise ValueError("kv_rows_per_batch shapes a plan: pass it to build_plan, not with plan=")
        plan.check_matches(query, key_cache, block_tables, seq_lens, query_start_loc)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    ### BEGIN SOLUTION
    for sb in plan.sub_batches:
        q = query[sb.tokens].transpose(1, 2)                                    # [m, h, q_len, d]
        k = read_rows(_gather_padded(key_cache, sb), kv_quant, "k", head_dim, q.dtype).transpose(1, 2)
        v = read_rows(_gather_padded(value_cache, sb), kv_quant, "v", head_dim, q.dtype).transpose(1, 2)
        # k, v: [m, kvh, longest, d]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=sb.mask, is_causal=sb.mask is None, scale=scale,
                                           enable_gqa=True)                     # [m, h, q_len, d]
        out[sb.tokens] = o.transpose(1, 2)
    ### END SOLUTION
    return out
