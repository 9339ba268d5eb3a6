"""Triton: one kernel moves whole blocks between two sets of caches, for copy_blocks and
swap_blocks alike. Same signatures as `kvcache.reference`.

How it reaches num_layers x 2 separate cache tensors in ONE launch: like vLLM's CUDA
copy_blocks, it takes a table of base addresses (int64 tensor, one per cache) and casts
each entry back to a pointer in the kernel. One launch for all layers and pairs instead
of 2 x num_layers x num_pairs tiny copies — the "fused block copy" of [Kwon 2025, §3.5.1].

Why copy words instead of the cache's float type: a copy does not care what the bits
mean. The kernel moves the widest integer word that divides the block and the base
addresses (bit-exact for any dtype, fp8 included; fewer, wider memory ops).

For swap on a GPU, a pinned CPU cache's address is valid on the device (unified virtual
addressing), so the same kernel pulls/pushes blocks over PCIe with one launch — a
zero-copy alternative to vLLM's one cudaMemcpyAsync per block (kernels_cuda/swap_blocks.cu).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kvcache.reference import check_copy_args, check_swap_args

_WORD_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _move_blocks_kernel(
    src_ptrs,               # [num_caches] int64: base address of each source cache
    dst_ptrs,               # [num_caches] int64: base address of each destination cache
    block_mapping,          # [num_pairs, 2] int64: (src block, dst block)
    words_per_block,        # one block = this many WORD-sized words
    WORD: tl.constexpr,     # tl.int8 / int16 / int32 / int64
    CHUNK: tl.constexpr,    # words per program
    ALIGNED16: tl.constexpr,  # every chunk starts 16-byte aligned: allow 16-byte vector loads/stores
):
    ### BEGIN SOLUTION
    pair = tl.program_id(0)             # which (src, dst) pair (axis 0: up to 2**31 - 1 of them)
    cache = tl.program_id(1)            # which tensor (layer x {key, value})
    chunk = tl.program_id(2)            # which CHUNK of the block
    src_block = tl.load(block_mapping + 2 * pair)       # int64: offsets below cannot overflow
    dst_block = tl.load(block_mapping + 2 * pair + 1)
    src = tl.load(src_ptrs + cache).to(tl.pointer_type(WORD))
    dst = tl.load(dst_ptrs + cache).to(tl.pointer_type(WORD))
    offs = chunk * CHUNK + tl.arange(0, CHUNK)          # [CHUNK]
    mask = offs < words_per_block
    src_words = src + src_block * words_per_block + offs
    dst_words = dst + dst_block * words_per_block + offs
    if ALIGNED16:
        # A pointer made from an integer has unknown alignment; promise what the host
        # checked, or the compiler falls back to one narrow access per word.
        src_words = tl.max_contiguous(tl.multiple_of(src_words, 16), CHUNK)
        dst_words = tl.max_contiguous(tl.multiple_of(dst_words, 16), CHUNK)
    tl.store(dst_words, tl.load(src_words, mask=mask), mask=mask)
    ### END SOLUTION


def _word_bytes(caches: Sequence[torch.Tensor], bytes_per_block: int) -> int:
    """Widest word dividing the block size and every base address."""
    for w in (8, 4, 2, 1):
        if bytes_per_block % w == 0 and all(c.data_ptr() % w == 0 for c in caches):
            return w
    raise AssertionError("unreachable: 1 divides everything")


def _pointer_table(caches: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=device)


def move_blocks(src_caches: Sequence[torch.Tensor], dst_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor, run_on: torch.device, max_chunk_bytes: int = 8192) -> None:
    """Launch `_move_blocks_kernel` on device `run_on`; arguments already checked."""
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    first = src_caches[0]
    bytes_per_block = first[0].numel() * first.element_size()
    word = _word_bytes(list(src_caches) + list(dst_caches), bytes_per_block)
    words_per_block = bytes_per_block // word
    chunk = min(triton.next_power_of_2(words_per_block), max(1, max_chunk_bytes // word))
    aligned16 = (bytes_per_block % 16 == 0 and (chunk * word) % 16 == 0
                 and all(c.data_ptr() % 16 == 0 for c in list(src_caches) + list(dst_caches)))
    grid = (num_pairs, len(src_caches), triton.cdiv(words_per_block, chunk))
    mapping = block_mapping.to(device=run_on, dtype=torch.int64).contiguous()
    _move_blocks_kernel[grid](_pointer_table(src_caches, run_on), _pointer_table(dst_caches, run_on), mapping,
                              words_per_block, WORD=_WORD_TYPES[word], CHUNK=chunk, ALIGNED16=aligned16,
                              num_warps=4)


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor, check_values: bool = True) -> None:
    check_copy_args(key_caches, value_caches, block_mapping, check_values)
    caches = list(key_caches) + list(value_caches)
    move_blocks(caches, caches, block_mapping, caches[0].device)


def swap_blocks(src_caches: Sequence[torch.Tensor], dst_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor, check_values: bool = True) -> None:
    check_swap_args(src_caches, dst_caches, block_mapping, check_values)
    s, d = src_caches[0].device, dst_caches[0].device
    run_on = s if s.type == "cuda" else d             # the kernel runs on the GPU side, if any
    for c in (src_caches[0], dst_caches[0]):
        if run_on.type == "cuda" and c.device.type == "cpu" and not c.is_pinned():
            raise ValueError("swap_blocks(backend='triton'): the CPU side must be pinned memory "
                             "(the GPU reads/writes it directly over PCIe); allocate it with pin_memory=True")
    if s.type == "cuda" and d.type == "cuda" and s != d:
        raise ValueError(f"swap_blocks(backend='triton'): caches on two GPUs ({s}, {d}) are not supported")
    move_blocks(src_caches, dst_caches, block_mapping, run_on)
