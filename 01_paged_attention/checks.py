"""Argument checks shared by every backend of chapters 01 and 05: a clear exception, never
a silent wrong answer.

One family, built from small pieces, so each op checks exactly what it reads:

    check_query_and_cache       query [T, H, D] vs caches [num_blocks, B, KVH, D]
    check_block_tables          block_tables [num_seqs, max_blocks] + seq_lens [num_seqs]
    check_query_start_loc       query_start_loc [num_seqs + 1] (cu_seqlens of the new tokens)
    check_cache_write_args      reshape_and_cache: key/value [T, KVH, D] + slot_mapping [T]
    check_paged_attention_args  decode (one query per request) or varlen (query_start_loc
                                given: chapter 05's unified attention) over the paged cache
    check_prefill_args          chapter 01's prefill: cache write + causal attention

Two tiers, as in vLLM's wrappers:
* shapes, dtypes, devices — free (tensor metadata only), always checked;
* values (seq_lens vs. the blocks given, block ids vs. the cache, query_start_loc, slot
  ranges) — these read device tensors (a GPU sync, illegal under CUDA-graph capture), so
  the engine's hot path passes check_values=False once its own bookkeeping is trusted.

Index tensors and views: a Triton or CUDA kernel reads an index tensor through its data
pointer, i.e. by its STORAGE, while these checks read its VIEW. The two agree only for a
contiguous tensor, so every kernel wrapper calls `contiguous_index` on 1-D index tensors
BEFORE checking them (a no-op when already contiguous), and passes both strides of
block_tables to the kernel (or makes it row-contiguous for the CUDA kernel). Then the
checks validate exactly what the kernel reads.
"""
from __future__ import annotations

import torch

from paged_attention.kv_quant import KVQuant

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def contiguous_index(t: torch.Tensor) -> torch.Tensor:
    """What a kernel wrapper does to a 1-D index tensor (slot_mapping, seq_lens,
    query_start_loc) before checking it: the kernel reads element i at data_ptr + i, which
    is the view's element i only when the tensor is contiguous. Free when it already is."""
    return t if t.is_contiguous() else t.contiguous()


def check_query_and_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          dtypes: tuple = SUPPORTED_DTYPES, kv_quant: KVQuant | None = None) -> None:
    """query [T, H, D]; caches [num_blocks, block_size, KVH, D] (an 8-bit cache: `kv_quant`'s
    storage dtype and row length, kv_quant.py); H a multiple of KVH (GQA/MQA)."""
    if query.dim() != 3:
        raise ValueError(f"query must be 3-D [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    row = head_dim if kv_quant is None else kv_quant.cache_head_dim(head_dim)
    if key_cache.shape[3] != row:
        raise ValueError(f"head_dim mismatch: query has {head_dim}, the cache {key_cache.shape[3]}"
                         + ("" if kv_quant is None else f" (a {kv_quant.kv_cache_dtype} cache row holds {row})"))
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) (GQA/MQA)")
    check_cache_dtype(query.dtype, key_cache, value_cache, kv_quant, "query")
    if query.dtype not in dtypes:
        raise TypeError(f"unsupported dtype {query.dtype}; expected one of {dtypes}")
    if key_cache.device != query.device or value_cache.device != query.device:
        raise ValueError(f"device mismatch: query on {query.device}, caches on {key_cache.device} / {value_cache.device}")


def check_cache_dtype(dtype: torch.dtype, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      kv_quant: KVQuant | None, what: str) -> None:
    """A float cache has the query's (key's) dtype; an 8-bit one has kv_quant's storage dtype."""
    want = dtype if kv_quant is None else kv_quant.storage_dtype
    if key_cache.dtype != want or value_cache.dtype != want:
        hint = ("" if kv_quant is not None or key_cache.dtype not in (torch.int8, torch.float8_e4m3fn)
                else "; an 8-bit cache needs kv_quant= (paged_attention.kv_quant.KVQuant)")
        raise TypeError(f"dtype mismatch: {what} {dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype}"
                        + ("" if kv_quant is None else f" (a {kv_quant.kv_cache_dtype} cache is {want})") + hint)


def _check_index(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 (or int64), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"device mismatch: {name} on {t.device}, query on {device}")


def check_block_tables(
    block_tables: torch.Tensor,   # [num_seqs, max_num_blocks] int
    seq_lens: torch.Tensor,       # [num_seqs] int: KV tokens per request
    key_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    device: torch.device,
    check_values: bool = True,
    max_seq_len: int | None = None,   # a caller's upper bound of seq_lens (sizes launches)
) -> None:
    """seq_lens fit the blocks given, and every block a request USES exists in the cache.
    (Padding entries past a request's ceil(seq_len / block_size) blocks are never read, so
    they may hold anything.)"""
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [num_seqs], got {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_num_blocks], got {tuple(block_tables.shape)}")
    _check_index("block_tables", block_tables, device)
    _check_index("seq_lens", seq_lens, device)
    if not check_values or num_seqs == 0:
        return
    num_blocks, block_size = key_cache.shape[:2]
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {lo}")
    if max_seq_len is not None and max_seq_len < hi:
        raise ValueError(f"max_seq_len={max_seq_len} is smaller than the longest seq_len {hi}")
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


def check_query_start_loc(
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int: cu_seqlens of the new tokens
    num_tokens: int,
    device: torch.device,
    num_seqs: int | None = None,    # None: any number of requests
    check_values: bool = True,
    min_query_len: int = 0,         # chapter 05's unified attention needs >= 1 new token per request
    max_query_len: int | None = None,
) -> torch.Tensor | None:           # [num_seqs] query lens when values were checked
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got {tuple(query_start_loc.shape)}")
    if num_seqs is not None and query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    _check_index("query_start_loc", query_start_loc, device)
    if query_start_loc.shape[0] == 1 and num_tokens:
        raise ValueError(f"{num_tokens} query tokens but no sequences")
    if not check_values:
        return None
    starts = query_start_loc.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"query_start_loc must run from 0 to num_tokens={num_tokens}, got {starts}")
    query_lens = query_start_loc[1:] - query_start_loc[:-1]                               # [num_seqs]
    if query_lens.numel() and int(query_lens.min()) < min_query_len:
        what = "non-decreasing" if min_query_len == 0 else \
            f"strictly increasing: every request needs query_len >= {min_query_len}"
        raise ValueError(f"query_start_loc must be {what}, got {starts}")
    if max_query_len is not None and query_lens.numel() and max_query_len < int(query_lens.max()):
        raise ValueError(f"max_query_len={max_query_len} but a request has {int(query_lens.max())} new tokens")
    return query_lens


def check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values: bool = True,
                           kv_quant: KVQuant | None = None) -> None:
    """reshape_and_cache: key/value rows [T, KVH, D] match the cache rows (an 8-bit cache: D +
    its inline scale, kv_quant.py); slot_mapping [T] holds slots in [0, num_blocks * block_size)
    or -1 (skip)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim]; got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    rows = (key.shape[1], key.shape[2] if kv_quant is None else kv_quant.cache_head_dim(key.shape[2]))
    if rows != tuple(key_cache.shape[2:]):
        raise ValueError(f"key rows {tuple(key.shape[1:])} do not match cache rows {tuple(key_cache.shape[2:])} "
                         "(num_kv_heads, head_dim" + (")" if kv_quant is None else
                                                      f"; a {kv_quant.kv_cache_dtype} row holds {rows[1]})"))
    if key.dtype != value.dtype:
        raise TypeError(f"dtype mismatch: key {key.dtype}, value {value.dtype}")
    check_cache_dtype(key.dtype, key_cache, value_cache, kv_quant, "key")
    if kv_quant is not None and key.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"an 8-bit cache quantizes fp32/fp16/bf16 rows, got {key.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in INDEX_DTYPES:
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"device mismatch: key/value/caches/slot_mapping on {sorted(map(str, devices))}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if check_values and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise IndexError(f"slot_mapping holds slots in [{lo}, {hi}] but the cache has slots [0, {num_slots}) (-1 = skip)")


def check_paged_attention_args(
    query: torch.Tensor,            # decode: [num_seqs, H, D]; varlen: [num_tokens, H, D]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,     # [num_seqs, max_num_blocks] int
    seq_lens: torch.Tensor,         # [num_seqs] int: KV tokens per request (context + new)
    query_start_loc: torch.Tensor | None = None,   # varlen: [num_seqs + 1]; None: one query per request
    *,
    check_values: bool = True,
    max_query_len: int | None = None,   # caller's upper bounds (they size launches): validated, never trusted
    max_seq_len: int | None = None,
    dtypes: tuple = SUPPORTED_DTYPES,
    kv_quant: KVQuant | None = None,
) -> None:
    """Attention of new tokens over their requests' paged KV.

    Decode (query_start_loc None): query row i is request i's one new token. Varlen
    (chapter 05's unified attention): request i's new tokens are query rows
    query_start_loc[i]:query_start_loc[i+1], at least one each, and they are the LAST of
    its seq_lens[i] KV tokens, so seq_len >= query_len.
    """
    check_query_and_cache(query, key_cache, value_cache, dtypes, kv_quant)
    if query_start_loc is None and seq_lens.shape != (query.shape[0],):
        raise ValueError(f"decode takes one query per request: seq_lens must be [num_seqs={query.shape[0]}], "
                         f"got {tuple(seq_lens.shape)}")
    check_block_tables(block_tables, seq_lens, key_cache, query.device, check_values, max_seq_len)
    if query_start_loc is None:
        return
    num_seqs = seq_lens.shape[0]
    query_lens = check_query_start_loc(query_start_loc, query.shape[0], query.device, num_seqs, check_values,
                                       min_query_len=1, max_query_len=max_query_len)
    if query_lens is not None and num_seqs and bool((seq_lens < query_lens).any()):
        raise ValueError(f"seq_lens {seq_lens.tolist()} shorter than query lens {query_lens.tolist()}: "
                         "seq_len counts the new tokens too")


def check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, check_values: bool = True,
                      max_seq_len: int | None = None, kv_quant: KVQuant | None = None) -> None:
    """Chapter 01's decode: one new token per request."""
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, None,
                               check_values=check_values, max_seq_len=max_seq_len, kv_quant=kv_quant)


def check_prefill_args(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,     # [num_tokens]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int
    check_values: bool = True,
    max_query_len: int | None = None,
    kv_quant: KVQuant | None = None,
) -> None:
    """Chapter 01's prefill: write the prompts' K/V, then causal attention over each prompt."""
    check_query_and_cache(query, key_cache, value_cache, kv_quant=kv_quant)
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values, kv_quant)
    if query.shape[0] != key.shape[0]:
        raise ValueError(f"query has {query.shape[0]} tokens but key/value have {key.shape[0]}")
    check_query_start_loc(query_start_loc, query.shape[0], query.device, None, check_values,
                          min_query_len=0, max_query_len=max_query_len)
