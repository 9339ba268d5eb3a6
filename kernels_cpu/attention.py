"""Paged attention as a CPU kernel: C++ + OpenMP + AVX-512 / AVX2 (or portable scalar code).
Mirrors vLLM's CPU attention (csrc/cpu/cpu_attn_impl.hpp, used by vllm/v1/attention/backends/cpu_attn.py).

    from kernels_cpu import attention
    out = attention.unified_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                      query_start_loc, scale)                       # [T, H, D]
    out = attention.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    out = attention.paged_prefill_attention(query, key, value, key_cache, value_cache, slot_mapping,
                                            query_start_loc, scale)                 # [T, H, D]
    attention.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    attention.is_available()    # False (with unavailable_reason()) when no compiler / build fails

Why a kernel at all: on a CPU, decode attention is memory-bound — each step reads every
cached K/V byte once — and the vectorized torch path (chapter 05) must first GATHER the
paged K/V into contiguous tensors for SDPA: it writes and re-reads every byte, plus a string
of small ops per sub-batch. The kernel reads K/V in place through the block table, all query
heads of a GQA group per K/V row, with an online softmax in fp32 (csrc/attention_kernel.cpp
explains the work split, split-KV and the cache behaviour).

These are the RAW entry points: they check what the kernel itself needs (CPU tensors, a unit
stride along head_dim in the caches, head_dim a multiple of 8) and trust the rest. The chapters'
"cpu" backends (paged_attention.cpu_ops, chunked_prefill.ops) run the shared argument checks
(paged_attention.checks: shapes, dtypes, index ranges) first, as for every other backend.
Semantics are chapter 05's `unified_attention`: request i's query_start_loc[i+1] -
query_start_loc[i] >= 1 new tokens are the last of its seq_lens[i] KV tokens, causal with that
offset; GQA head h reads KV head h // (H // KVH); fp32 softmax, output in the query dtype (fp32,
bf16, fp16); positions past seq_len and block-table entries past ceil(seq_len / block_size) are
never read.

Build: on first use (build.py: tens of seconds, then cached on disk). `load(isa)` builds one variant by
name (tests check every variant the machine runs, "avx512_simde" included).
Threads: the kernel's OpenMP pool is torch's own (the extension links the libgomp torch
already loaded), sized by torch.get_num_threads() at each call.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels_cpu import build

SOURCES = ("attention_binding.cpp", "attention_kernel.cpp")   # + attention.h, vec.h
WHAT = "CPU attention kernel"
HEAD_DIM_MULTIPLE = 8                              # AVX2 vectors hold 8 fp32 lanes


def load(isa: str | None = None):
    """Build (first call on this machine) or load (cached) the extension for `isa`
    (default: `build.cpu_isa()`), and return the module. Raises RuntimeError with the reason when
    it cannot: no compiler, or the build failed (the compiler's output is in the message)."""
    return build.load_extension("cpu_attention", SOURCES, WHAT, isa)


def is_available(isa: str | None = None) -> bool:
    """True when the kernel is (or can be) built here. Builds it on the first call."""
    return unavailable_reason(isa) is None


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why `load` fails here (None when it works)."""
    try:
        load(isa)
        return None
    except RuntimeError as e:
        return str(e)


def check_cpu_layout(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """What this kernel needs beyond the shared checks: CPU tensors, a contiguous head_dim
    axis in the caches (read in place, so never copied), head_dim a multiple of 8."""
    if query.device.type != "cpu":
        raise ValueError(f"the cpu backend runs on CPU tensors, got {query.device}; use 'triton' or 'cuda' on a GPU")
    head_dim = query.shape[-1]
    if head_dim % HEAD_DIM_MULTIPLE:
        raise ValueError(f"the cpu backend needs head_dim to be a multiple of {HEAD_DIM_MULTIPLE} (one AVX2 vector), "
                         f"got {head_dim}; use backend='torch'")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.numel() and cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride along head_dim (the kernel reads its rows in place), "
                             f"got strides {cache.stride()}")


def _index_int32(t: torch.Tensor) -> torch.Tensor:
    """int32, unit last stride (the kernel reads rows through a pointer + row stride)."""
    t = t if t.dtype == torch.int32 else t.to(torch.int32)
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def _contiguous_index(t: torch.Tensor) -> torch.Tensor:
    """A 1-D index tensor the kernel reads element by element: contiguous int32."""
    return _index_int32(t).contiguous()


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim] (any strides; head_dim contiguous or copied)
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim], unit stride along head_dim (written)
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim] (written in place)
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
    *,
    kv_quant=None,               # an 8-bit cache (paged_attention.kv_quant.KVQuant): rows quantized as written
) -> None:
    """The cache write as one C++ pass: a row copy (or quantization) per token and KV head, bit for
    bit what the torch path (paged_attention.cache_ops) writes, without its index tensors and
    index_put_ calls. The C++ side range-checks every slot before it writes anything."""
    if key.shape[0] == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    load().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *_scales(kv_quant))


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32 (int64 accepted)
    seq_lens: torch.Tensor,         # [num_seqs] int32: context + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cu_seqlens of the new tokens
    scale: float,
    *,
    kv_splits: int | None = None,   # tests: split every item's KV into this many pieces (None: automatic)
    q_tile: int | None = None,      # tests: new tokens per work item (None: automatic)
    kv_quant=None,                  # an 8-bit cache (paged_attention.kv_quant.KVQuant)
    tree_masks=None,                # per request [q_len, q_len] bool or None (causal), or pack_tree_masks(...)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim], query's dtype
    """Unified (varlen, causal-with-context) paged attention on the CPU kernel. With `tree_masks`
    (EAGLE-2's draft trees, chapter 04's `paged_tree_attention` semantics), a request's new tokens
    see the whole context and, among themselves, what its mask allows."""
    check_cpu_layout(query, key_cache, value_cache)
    query_start_loc = _contiguous_index(query_start_loc)
    tree = tree_masks if isinstance(tree_masks, PackedTreeMasks) else pack_tree_masks(tree_masks, query_start_loc)
    return _run(query, key_cache, value_cache, block_tables, _contiguous_index(seq_lens), query_start_loc, scale,
                kv_splits, q_tile, kv_quant=kv_quant, tree=tree)


class PackedTreeMasks(NamedTuple):
    """A step's tree masks as the kernel reads them (one packing per step serves every layer)."""
    mask: torch.Tensor              # [sum of the masked requests' q_len^2] uint8, row-major per request
    start: torch.Tensor             # [num_seqs] int64: where request i's mask begins, -1: causal


def pack_tree_masks(tree_masks, query_start_loc: torch.Tensor) -> PackedTreeMasks | None:
    """Per-request masks ([q_len, q_len] bool, or None: causal) -> the kernel's packed form (None: no
    tree). A mask must let a token see itself and nothing after it (a node's ancestors come first):
    the kernel bounds what it reads by the causal rule."""
    if tree_masks is None or all(m is None for m in tree_masks):
        return None
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    if len(tree_masks) != len(q_lens):
        raise ValueError(f"{len(tree_masks)} tree masks for {len(q_lens)} requests")
    flat, starts, offset = [], [], 0
    for i, (mask, q_len) in enumerate(zip(tree_masks, q_lens)):
        if mask is None:
            starts.append(-1)
            continue
        mask = torch.as_tensor(mask, device="cpu").bool()
        if mask.shape != (q_len, q_len):
            raise ValueError(f"request {i}: tree mask must be [{q_len}, {q_len}] (one row and column per new token), "
                             f"got {tuple(mask.shape)}")
        if not mask.diagonal().all() or mask.triu(1).any():
            raise ValueError(f"request {i}: a tree mask must let each token see itself and nothing after it")
        flat.append(mask.reshape(-1))
        starts.append(offset)
        offset += q_len * q_len
    return PackedTreeMasks(torch.cat(flat).to(torch.uint8), torch.tensor(starts, dtype=torch.int64))


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]: one new token per request
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32: KV tokens, the new one included (0: a padding row)
    scale: float,
    *,
    kv_splits: int | None = None,
    kv_quant=None,               # an 8-bit cache (paged_attention.kv_quant.KVQuant)
) -> torch.Tensor:               # [num_seqs, num_heads, head_dim]
    """Decode = unified attention with query_len 1 for every request (a seq_len-0 padding
    row gets zeros, as in the reference)."""
    check_cpu_layout(query, key_cache, value_cache)
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return _run(query, key_cache, value_cache, block_tables, _contiguous_index(seq_lens), query_start_loc, scale,
                kv_splits, None, kv_quant=kv_quant)


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]: the prompts back to back
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,      # (written)
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = don't cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int: cu_seqlens of the prompts
    scale: float,
    *,
    max_query_len: int | None = None,
    kv_quant=None,                  # an 8-bit cache: the write quantizes; the attention reads the fresh K/V
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Chapter 01's prefill: write the prompts' K/V (one row copy), then causal attention of
    each prompt over its OWN fresh K/V, as the reference does (a token with slot -1 is not
    cached but is attended). The kernel reads the fresh key [T, KVH, D] in place, viewed as a
    cache of T blocks of one position each: prompt i's block table is simply its token indices."""
    check_cpu_layout(query, key_cache, value_cache)
    query_start_loc = _contiguous_index(query_start_loc)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_quant=kv_quant)
    num_tokens = query.shape[0]
    starts = query_start_loc.long()
    lens = starts[1:] - starts[:-1]                                              # [num_seqs]
    if num_tokens == 0 or lens.numel() == 0:
        return torch.empty(query.shape, dtype=query.dtype)
    width = max_query_len if max_query_len is not None else int(lens.max())
    # entries past a prompt's length are never read; clamped to stay valid ids all the same
    block_tables = (starts[:-1, None] + torch.arange(max(width, 1))).clamp_max(num_tokens - 1)   # [num_seqs, width]
    fresh_k = (key if key.stride(-1) == 1 else key.contiguous()).unsqueeze(1)    # [T, 1, KVH, D]
    fresh_v = (value if value.stride(-1) == 1 else value.contiguous()).unsqueeze(1)
    return _run(query, fresh_k, fresh_v, block_tables, _index_int32(lens), query_start_loc, scale, None, None)


def plan(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_heads: int, num_kv_heads: int, *,
         num_threads: int | None = None, kv_splits: int | None = None, q_tile: int | None = None) -> list[dict]:
    """The kernel's work items for a batch (in plan order; the kernel runs them longest first):
    dicts (seq, kv_head, num_kv_heads, q_begin, q_count, kv_begin, kv_end, split). Shows how
    a step is cut up: one item per decode request (all its KV heads), query tiles per KV head
    for a long prefill, split-KV pieces of a request that is a large share of the work
    (num_threads: default torch's)."""
    names = ("seq", "kv_head", "num_kv_heads", "q_begin", "q_count", "kv_begin", "kv_end", "split")
    items = load().plan(_contiguous_index(seq_lens), _contiguous_index(query_start_loc), num_heads, num_kv_heads,
                        num_threads or 0, kv_splits or 0, q_tile or 0)
    return [dict(zip(names, item)) for item in items]


def _scales(kv_quant) -> tuple[float, float]:
    """(k_scale, v_scale) for the kernel: an 8-bit cache's per-tensor scales (1.0 otherwise; per-row
    scales are read from the rows)."""
    return (1.0, 1.0) if kv_quant is None else (float(kv_quant.k_scale), float(kv_quant.v_scale))


def _run(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, kv_splits, q_tile,
         module=None, kv_quant=None, tree=None):
    """out = the kernel's attention (module: a build of it, default `load()`; kernels_cpu.dev times others;
    tree: PackedTreeMasks or None)."""
    for name, knob in (("kv_splits", kv_splits), ("q_tile", q_tile)):
        if knob is not None and knob < 1:
            raise ValueError(f"{name} must be >= 1 (or None for automatic), got {knob}")
    ext = module or load()
    query = query if query.shape[-1] == 0 or query.stride(-1) == 1 else query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    ext.unified_attention_out(out, query, key_cache, value_cache, _index_int32(block_tables),
                              _index_int32(seq_lens), _index_int32(query_start_loc), float(scale),
                              kv_splits or 0, q_tile or 0, *_scales(kv_quant), *(tree or (None, None)))
    return out
