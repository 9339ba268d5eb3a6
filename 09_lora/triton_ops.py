"""Multi-LoRA's shrink and expand as Triton kernels (backend "triton"): on a GPU, or on CPU tensors
under TRITON_INTERPRET=1 (tests/conftest.py sets it), the same kernels either way.

vLLM's GPU path (vllm/lora/ops/triton_ops/lora_shrink_op.py, lora_expand_op.py) groups the
batch's tokens by adapter once per step (LoRAKernelMeta: the token ids sorted by slot, and how
many each slot has) and launches a grid over (token block, N block) x slice x adapter, where
programs past their adapter's token count exit at once. This is the same plan with the
emptiness taken out on the host:

* the tokens are sorted by slot (`segments_from_token_lora(sort=True)`: one segment per adapter
  in the batch), and each segment is cut into TILES of at most BLOCK_M tokens (`make_tiles`);
  a tile knows its first position in the sorted order, its length and its slot;
* one program per (tile, slice, N block): it loads its tokens' ids, so the tokens of a tile
  need not be neighbours in the batch, multiplies a [BLOCK_M, K] block of the input by its
  adapter's [K, BLOCK_N] block with tl.dot, K in BLOCK_K steps, and writes [BLOCK_M, BLOCK_N];
* shrink (N = the rank, usually one block): tiles of tokens WITHOUT an adapter run too, with
  every load masked off, and store zeros (the op writes every row); expand (N = the slice's output columns): those tiles
  are not launched at all — y keeps the base layer's value there.

Arithmetic: operands are converted to fp32 and multiplied with input_precision="ieee" (no TF32
on tensor cores), so every backend's numbers differ only in summation order. A LoRA product is
thin (rank 8-64): its time is the time to read x and the adapters, not the multiply-adds.
tl.dot needs every block dim >= 16 on a GPU: rank 8 is padded to 16 by the masks.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from lora.reference import (ScaleLike, TokenLoraLike, check_expand_args, check_shrink_args,
                            segments_from_token_lora)

__all__ = ["BLOCK_M", "lora_expand", "lora_shrink", "make_tiles"]

BLOCK_M = 16              # tokens per tile (tl.dot's minimum; decode batches rarely fill more)
SHRINK_BLOCK_K = 128      # input features per step of the shrink's K loop (not tuned)
EXPAND_BLOCK_N = 128      # output columns per expand program (not tuned)


def make_tiles(token_lora: torch.Tensor, block_m: int, with_no_lora: bool):
    """(order, tile_start, tile_len, tile_slot), int64 on token_lora's device: the tokens sorted by
    slot (`order`), cut into tiles of at most block_m tokens of one slot; tile j is the tokens
    order[tile_start[j] : tile_start[j] + tile_len[j]]. with_no_lora=False drops slot -1."""
    seg = segments_from_token_lora(token_lora, sort=True)
    keep = torch.ones_like(seg.slots, dtype=torch.bool) if with_no_lora else seg.slots >= 0
    starts, lengths, slots = seg.starts[keep], seg.lengths[keep], seg.slots[keep]
    per_segment = (lengths + block_m - 1) // block_m                                  # tiles per segment
    seg_of_tile = torch.repeat_interleave(torch.arange(len(starts), device=starts.device), per_segment)
    first_tile = torch.cumsum(per_segment, 0) - per_segment                           # of each segment
    within = torch.arange(len(seg_of_tile), device=starts.device) - first_tile[seg_of_tile]
    tile_start = starts[seg_of_tile] + within * block_m
    tile_len = torch.minimum(lengths[seg_of_tile] - within * block_m, torch.full_like(tile_start, block_m))
    return seg.order, tile_start, tile_len, slots[seg_of_tile]


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr, scale_ptr,
    order_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,     # int64: the tiles (make_tiles)
    hidden, max_rank,
    stride_xt, stride_xk,
    stride_a_slot, stride_a_slice, stride_a_r, stride_a_k,
    stride_o_slice, stride_o_t, stride_o_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    sl = tl.program_id(1)                                       # the slice
    pid_n = tl.program_id(2)                                    # the block of rank rows
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    slot = tl.load(tile_slot_ptr + tile)
    ### BEGIN SOLUTION
    offs_m = tl.arange(0, BLOCK_M)
    in_tile = offs_m < length
    tokens = tl.load(order_ptr + start + offs_m, mask=in_tile, other=0)          # [M] this tile's token ids
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                              # [N] rank rows of A
    in_rank = offs_n < max_rank
    has_adapter = slot >= 0                                     # no adapter: every load masked off, zeros stored
    a_base = a_ptr + slot * stride_a_slot + sl * stride_a_slice
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < hidden
        xb = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                     mask=in_tile[:, None] & in_k[None, :] & has_adapter, other=0.0).to(tl.float32)     # [M, K]
        ab = tl.load(a_base + offs_k[:, None] * stride_a_k + offs_n[None, :] * stride_a_r,
                     mask=in_k[:, None] & in_rank[None, :] & has_adapter, other=0.0).to(tl.float32)    # [K, N] = A^T
        acc += tl.dot(xb, ab, input_precision="ieee")
    acc = acc * tl.load(scale_ptr + slot, mask=has_adapter, other=0.0)
    tl.store(out_ptr + sl * stride_o_slice + tokens[:, None] * stride_o_t + offs_n[None, :] * stride_o_r,
             acc, mask=in_tile[:, None] & in_rank[None, :])
    ### END SOLUTION


@triton.jit
def _lora_expand_kernel(
    buf_ptr, b_ptr, y_ptr,
    order_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,     # int64: the tiles (make_tiles, adapters only)
    slice_offset_ptr, slice_size_ptr,                           # int64 [num_slices]
    max_rank,
    stride_buf_slice, stride_buf_t, stride_buf_r,
    stride_b_slot, stride_b_slice, stride_b_n, stride_b_r,
    stride_yt, stride_yc,
    ADD_INPUTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    sl = tl.program_id(1)
    pid_n = tl.program_id(2)                                    # the block of this slice's output columns
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    slot = tl.load(tile_slot_ptr + tile)
    offset = tl.load(slice_offset_ptr + sl)
    size = tl.load(slice_size_ptr + sl)
    ### BEGIN SOLUTION
    offs_m = tl.arange(0, BLOCK_M)
    in_tile = offs_m < length
    tokens = tl.load(order_ptr + start + offs_m, mask=in_tile, other=0)          # [M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                              # [N] columns of the slice
    in_slice = offs_n < size                                    # a narrower slice (k, v) masks its tail blocks
    b_base = b_ptr + slot * stride_b_slot + sl * stride_b_slice
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, max_rank, BLOCK_K):                      # the rank: one step unless rank > BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < max_rank
        bufb = tl.load(buf_ptr + sl * stride_buf_slice + tokens[:, None] * stride_buf_t + offs_k[None, :] * stride_buf_r,
                       mask=in_tile[:, None] & in_k[None, :], other=0.0)                      # [M, K] fp32
        bb = tl.load(b_base + offs_k[:, None] * stride_b_r + offs_n[None, :] * stride_b_n,
                     mask=in_k[:, None] & in_slice[None, :], other=0.0).to(tl.float32)        # [K, N] = B^T
        acc += tl.dot(bufb, bb, input_precision="ieee")
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + (offset + offs_n)[None, :] * stride_yc
    in_y = in_tile[:, None] & in_slice[None, :]
    if ADD_INPUTS:
        acc += tl.load(y_ptrs, mask=in_y, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=in_y)
    ### END SOLUTION


def _rank_block(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora: TokenLoraLike, scale: ScaleLike,
                out: torch.Tensor, check_values: bool = True) -> None:
    slots, scales = check_shrink_args(x, lora_a, token_lora, scale, out, check_values)
    num_slots, num_slices, max_rank, hidden = lora_a.shape
    if x.shape[0] == 0 or num_slices == 0 or max_rank == 0:
        return
    order, tile_start, tile_len, tile_slot = make_tiles(slots, BLOCK_M, with_no_lora=True)
    block_n = min(_rank_block(max_rank), 64)
    grid = (len(tile_start), num_slices, triton.cdiv(max_rank, block_n))
    _lora_shrink_kernel[grid](
        x, lora_a, out, scales, order, tile_start, tile_len, tile_slot,
        hidden, max_rank, *x.stride(), *lora_a.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=min(SHRINK_BLOCK_K, max(16, triton.next_power_of_2(hidden))),
    )


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora: TokenLoraLike, y: torch.Tensor,
                slice_offsets: Sequence[int], slice_sizes: Sequence[int] | None = None, add_inputs: bool = True,
                check_values: bool = True) -> None:
    slots, offsets, sizes = check_expand_args(buffer, lora_b, token_lora, y, slice_offsets, slice_sizes, check_values)
    num_slots, num_slices, max_out, max_rank = lora_b.shape
    if y.shape[0] == 0 or num_slices == 0 or max(sizes) == 0:
        return
    order, tile_start, tile_len, tile_slot = make_tiles(slots, BLOCK_M, with_no_lora=False)
    if len(tile_start) == 0:
        return                                                  # no token has an adapter
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=y.device)   # noqa: E731
    grid = (len(tile_start), num_slices, triton.cdiv(max(sizes), EXPAND_BLOCK_N))
    _lora_expand_kernel[grid](
        buffer, lora_b, y, order, tile_start, tile_len, tile_slot, as_tensor(offsets), as_tensor(sizes),
        max_rank, *buffer.stride(), *lora_b.stride(), *y.stride(),
        ADD_INPUTS=add_inputs, BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_K=min(_rank_block(max_rank), 64),
    )
