"""Random paged KV layouts with a dense twin, for tests, the notebook and the benchmark.

`make_paged_kv` stores random K/V for a batch of requests in a paged cache AND keeps the
same K/V as contiguous per-request tensors, so any paged attention result can be compared
with `reference.dense_decode_attention` on the twin. The layout is adversarial on purpose:
physical blocks are shuffled (logical order != physical order), every slot no request
owns (free blocks, the tail of each last block) holds junk — NaN by default, so a kernel
that reads one poisons its output — and block-table padding can be a junk id too.
"""
from __future__ import annotations

from dataclasses import dataclass

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
