"""Random paged KV layouts with a dense twin, for tests, the notebook and the benchmark.

`make_paged_kv` stores random K/V for a batch of requests in a paged cache AND keeps the
same K/V as contiguous per-request tensors, so any paged attention result can be compared
with `reference.dense_decode_attention` on the twin. The layout is adversarial on purpose:
physical blocks are shuffled (logical order != physical order), every slot no request
owns (free blocks, the tail of each last block) holds junk — NaN by default, so a kernel
that reads one poisons its output — and block-table padding can be a junk id too.

`make_paged_batch` adds a step of new tokens on top (query_lens new tokens after
context_lens cached ones per request, their K/V already in the cache, as the engine leaves
it before attention): the input of chapter 05's unified attention, whose tests and
benchmark build their batches here.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from paged_attention.block_table import make_block_tables


@dataclass
class PagedKV:
    key_cache: torch.Tensor      # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor    # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor   # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor       # [num_seqs] int32
    block_ids: list[list[int]]   # per request: its physical blocks in logical order
    keys: list[torch.Tensor]     # per request: [seq_len, num_kv_heads, head_dim], the dense twin
    values: list[torch.Tensor]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    num_spare_blocks: int = 2,          # free blocks no request owns (filled with junk)
    shuffle: bool = True,               # random physical placement of blocks
    junk: float = float("nan"),         # what unused slots hold
    pad_id: int = 0,                    # block-table padding entry
    extra_table_width: int = 0,         # padding columns beyond the longest request
    value_fill: float | None = None,    # every V row = this constant (e.g. 1.0: outputs must be exactly 1)
    seed: int = 0,
) -> PagedKV:
    if num_spare_blocks < 0 or block_size < 1 or any(n < 0 for n in seq_lens):
        raise ValueError("num_spare_blocks >= 0, block_size >= 1 and seq_lens >= 0 required")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    # The placement has its own generator, so the same seed gives the same K/V whatever the layout.
    placement = torch.Generator().manual_seed(seed + 7919)
    order = torch.randperm(num_blocks, generator=placement).tolist() if shuffle else list(range(num_blocks))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, junk, dtype=dtype)
    value_cache = torch.full(shape, junk, dtype=dtype)
    block_ids, keys, values, next_block = [], [], [], 0
    for n, nb in zip(seq_lens, blocks_per_seq):
        ids = order[next_block:next_block + nb]
        next_block += nb
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        if value_fill is not None:
            v.fill_(value_fill)
        for j, blk in enumerate(ids):     # logical block j of this request -> physical block blk
            rows = slice(j * block_size, min((j + 1) * block_size, n))
            key_cache[blk, :rows.stop - rows.start] = k[rows]
            value_cache[blk, :rows.stop - rows.start] = v[rows]
        block_ids.append(ids)
        keys.append(k.to(device))
        values.append(v.to(device))
    width = max(blocks_per_seq, default=0) + extra_table_width
    return PagedKV(
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=make_block_tables(block_ids, width, pad_id=pad_id).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_ids=block_ids,
        keys=keys,
        values=values,
    )


def random_query(num_seqs: int, num_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 1) -> torch.Tensor:   # [num_seqs, num_heads, head_dim]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype).to(device)


def make_query_start_loc(query_lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_seqs + 1] int32 cu_seqlens: request i's new tokens are rows qsl[i]:qsl[i+1]."""
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(list(query_lens), dtype=torch.int64).cumsum(0)
    return qsl.to(device)


@dataclass
class PagedBatch:
    """One step over a paged cache: query_lens[i] new tokens of request i attend to all its
    seq_lens[i] = context + query_len KV tokens (the new ones' K/V are already cached)."""
    query: torch.Tensor            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor     # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor         # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float
    keys: list[torch.Tensor]       # dense twin: per request [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    query_lens: list[int]

    @property
    def args(self) -> tuple:
        """(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
        the project's one argument order for attention over a paged cache."""
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def to(self, device) -> "PagedBatch":
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved, keys=[k.to(device) for k in self.keys], values=[v.to(device) for v in self.values])


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    scale: float | None = None,         # default head_dim ** -0.5
    seed: int = 0,
    **layout,                           # make_paged_kv's keywords: shuffle, junk, pad_id, num_spare_blocks, ...
) -> PagedBatch:
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens need one entry per request")
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed, **layout)
    query = random_query(sum(query_lens), num_heads, head_dim, dtype, device, seed=seed + 1)
    return PagedBatch(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                      make_query_start_loc(query_lens, device), head_dim ** -0.5 if scale is None else scale,
                      kv.keys, kv.values, list(query_lens))


def index_views(t: torch.Tensor, junk: int) -> dict[str, torch.Tensor]:
    """Views equal to the index tensor `t` whose STORAGE around or between the elements holds
    `junk` — what a kernel reading `t` by raw pointer instead of by its view would read.

    strided: every other element of a [..., 2] tensor (last-dim stride 2); offset: contiguous
    but 3 elements into its storage; 2-D only — transposed: column-major; row_slice: rows
    with a gap of junk after each. Used to prove every backend reads the view (or refuses).
    """
    views = {
        "strided": torch.stack([t, torch.full_like(t, junk)], dim=-1)[..., 0],
        "offset": torch.cat([torch.full((3,), junk, dtype=t.dtype, device=t.device), t.reshape(-1)])[3:].view(t.shape),
    }
    if t.dim() == 2:
        views["transposed"] = t.t().contiguous().t()
        views["row_slice"] = torch.cat([t, torch.full_like(t, junk)], dim=1)[:, :t.shape[1]]
    return views


def strided_rows(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> equal values in a view whose head_dim is NOT contiguous (stride != 1)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)
