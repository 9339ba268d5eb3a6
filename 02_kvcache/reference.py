"""Block copy and block swap: the oracle (plain PyTorch) and the argument checks every
backend shares.

Mirrors `copy_blocks` and `swap_blocks` in vLLM's csrc/cache_kernels.cu (bound in
vllm/_custom_ops.py, called by v0's worker/cache_engine.py: CacheEngine.copy / swap_in /
swap_out). The block manager decides WHICH blocks move and returns (src, dst) pairs; these
ops move the bytes, for every layer's key and value cache at once:

    copy_blocks  within one device — copy-on-write (fork + append, [Kwon 2025, §3.4.4])
    swap_blocks  between two sets of caches, typically GPU <-> pinned CPU — swap preemption

Cache layout (chapter 01): per layer, key_cache and value_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; a block is one contiguous slab of
block_size * num_kv_heads * head_dim elements, so moving a block is moving a slab.
"""
from __future__ import annotations

from typing import Sequence

import torch


def as_block_mapping(pairs, device: torch.device | str | None = None) -> torch.Tensor:
    """[(src, dst), ...] (as the manager returns them) -> int64 tensor [num_pairs, 2]."""
    if isinstance(pairs, torch.Tensor):
        return pairs.to(device=device or pairs.device, dtype=torch.int64)
    return torch.tensor(list(pairs), dtype=torch.int64, device=device).reshape(-1, 2)


def check_block_mapping(block_mapping: torch.Tensor, num_src_blocks: int, num_dst_blocks: int,
                        same_tensors: bool, check_values: bool = True) -> None:
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2] (src, dst), got {tuple(block_mapping.shape)}")
    if block_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_mapping must be int32 or int64, got {block_mapping.dtype}")
    if not check_values or block_mapping.numel() == 0:
        return
    # Reading the values is a device sync: an engine that trusts its block manager passes
    # check_values=False on the hot path.
    src, dst = block_mapping[:, 0].tolist(), block_mapping[:, 1].tolist()
    if min(src) < 0 or max(src) >= num_src_blocks:
        raise IndexError(f"source blocks {min(src)}..{max(src)} outside [0, {num_src_blocks})")
    if min(dst) < 0 or max(dst) >= num_dst_blocks:
        raise IndexError(f"destination blocks {min(dst)}..{max(dst)} outside [0, {num_dst_blocks})")
    if len(set(dst)) != len(dst):
        raise ValueError("a destination block appears twice in block_mapping: the result would depend on copy order")
    if same_tensors and set(src) & set(dst):
        raise ValueError(f"blocks {sorted(set(src) & set(dst))} are both a source and a destination: "
                         "the result would depend on copy order (the kernels copy all pairs in parallel)")


def check_caches(caches: Sequence[torch.Tensor], name: str) -> None:
    if len(caches) == 0:
        raise ValueError(f"{name}: no caches given")
    first = caches[0]
    for c in caches:
        if c.dim() != 4:
            raise ValueError(f"{name}: each cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(c.shape)}")
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise ValueError(f"{name}: all caches must share shape, dtype and device; got {tuple(first.shape)}/{first.dtype}/"
                             f"{first.device} and {tuple(c.shape)}/{c.dtype}/{c.device}")
        if not c.is_contiguous():
            raise ValueError(f"{name}: caches must be contiguous (one block = one contiguous slab)")


def check_copy_args(key_caches, value_caches, block_mapping, check_values=True) -> None:
    check_caches(list(key_caches) + list(value_caches), "copy_blocks")
    if len(key_caches) != len(value_caches):
        raise ValueError(f"copy_blocks: {len(key_caches)} key caches but {len(value_caches)} value caches")
    check_block_mapping(block_mapping, key_caches[0].shape[0], key_caches[0].shape[0], True, check_values)


def check_swap_args(src_caches, dst_caches, block_mapping, check_values=True) -> None:
    check_caches(src_caches, "swap_blocks (src)")
    check_caches(dst_caches, "swap_blocks (dst)")
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"swap_blocks: {len(src_caches)} source caches but {len(dst_caches)} destination caches")
    s, d = src_caches[0], dst_caches[0]
    if s.shape[1:] != d.shape[1:] or s.dtype != d.dtype:
        raise ValueError(f"swap_blocks: blocks differ: src {tuple(s.shape[1:])} {s.dtype} vs dst {tuple(d.shape[1:])} {d.dtype}")
    same = any(a.data_ptr() == b.data_ptr() for a, b in zip(src_caches, dst_caches))
    check_block_mapping(block_mapping, s.shape[0], d.shape[0], same, check_values)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],    # num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: Sequence[torch.Tensor],  # num_layers x [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,           # [num_pairs, 2] int: (src, dst) block ids
    check_values: bool = True,
) -> None:
    """For every layer, key_cache[dst] = key_cache[src] and value_cache[dst] = value_cache[src]."""
    check_copy_args(key_caches, value_caches, block_mapping, check_values)
    ### BEGIN SOLUTION
    src = block_mapping[:, 0].to(key_caches[0].device, torch.int64)    # [num_pairs]
    dst = block_mapping[:, 1].to(key_caches[0].device, torch.int64)    # [num_pairs]
    for cache in list(key_caches) + list(value_caches):
        raw = cache.view(torch.uint8)             # [num_blocks, block_size, H, D * itemsize]: bytes, any dtype (fp8 too)
        raw.index_copy_(0, dst, raw.index_select(0, src))               # [num_pairs, block_size, H, D * itemsize]
    ### END SOLUTION


def swap_blocks(
    src_caches: Sequence[torch.Tensor],    # n x [num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_caches: Sequence[torch.Tensor],    # n x [num_dst_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,           # [num_pairs, 2] int: (src block in src_caches, dst block in dst_caches)
    check_values: bool = True,
) -> None:
    """dst_caches[i][dst] = src_caches[i][src] for every pair — typically src on the GPU and
    dst in pinned CPU memory (swap out) or the reverse (swap in)."""
    check_swap_args(src_caches, dst_caches, block_mapping, check_values)
    ### BEGIN SOLUTION
    src = block_mapping[:, 0].to(src_caches[0].device, torch.int64)    # [num_pairs]
    dst = block_mapping[:, 1].to(dst_caches[0].device, torch.int64)    # [num_pairs]
    for s, d in zip(src_caches, dst_caches):
        # Gather on the source device, one (blocking) transfer, scatter on the destination.
        s_raw, d_raw = s.view(torch.uint8), d.view(torch.uint8)        # bytes: any dtype
        d_raw.index_copy_(0, dst, s_raw.index_select(0, src).to(d.device))
    ### END SOLUTION
