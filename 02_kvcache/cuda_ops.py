"""The CUDA backend of copy_blocks / swap_blocks: host-side preparation for the kernels in
kernels_cuda/copy_blocks.cu and kernels_cuda/swap_blocks.cu (built on first use, GPU only).

copy_blocks: one kernel launch for all caches and pairs, through a table of base
addresses (vLLM's `copy_blocks_kernel`, csrc/cache_kernels.cu).
swap_blocks: no kernel at all — one cudaMemcpyAsync per block pair and cache, which is
exactly what vLLM's `swap_blocks` does: a copy between host and device is DMA work for
the copy engines, and a pinned host buffer lets it run asynchronously on the stream.
"""
from __future__ import annotations

from typing import Sequence

import torch

import kernels_cuda
from kvcache.reference import check_copy_args, check_swap_args


def _require_cuda(op: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{op}(backend='cuda') needs a CUDA GPU; this machine has none "
                           "(use backend='torch' or 'triton')")


def _vector_bytes(caches: Sequence[torch.Tensor], bytes_per_block: int) -> int:
    """Widest access (16-byte uint4 down to 1 byte) dividing the block and every base address."""
    for v in (16, 8, 4, 2, 1):
        if bytes_per_block % v == 0 and all(c.data_ptr() % v == 0 for c in caches):
            return v
    raise AssertionError("unreachable")


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor, check_values: bool = True) -> None:
    _require_cuda("copy_blocks")
    check_copy_args(key_caches, value_caches, block_mapping, check_values)
    caches = list(key_caches) + list(value_caches)
    dev = caches[0].device
    if dev.type != "cuda":
        raise ValueError(f"copy_blocks(backend='cuda'): caches must be on a CUDA device, got {dev}")
    if block_mapping.shape[0] == 0:
        return
    bytes_per_block = caches[0][0].numel() * caches[0].element_size()
    table = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=dev)
    mapping = block_mapping.to(device=dev, dtype=torch.int64).contiguous()
    with torch.cuda.device(dev):
        kernels_cuda.load("copy_blocks").copy_blocks(
            table, table, mapping, bytes_per_block, _vector_bytes(caches, bytes_per_block),
            torch.cuda.current_stream(dev).cuda_stream)


def swap_blocks(src_caches: Sequence[torch.Tensor], dst_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor, check_values: bool = True) -> None:
    _require_cuda("swap_blocks")
    check_swap_args(src_caches, dst_caches, block_mapping, check_values)
    s, d = src_caches[0].device, dst_caches[0].device
    if s.type != "cuda" and d.type != "cuda":
        raise ValueError("swap_blocks(backend='cuda'): at least one side must be on a CUDA device")
    gpu = s if s.type == "cuda" else d
    mapping = block_mapping.to(device="cpu", dtype=torch.int64).contiguous()   # read by the host loop
    ext = kernels_cuda.load("swap_blocks")
    with torch.cuda.device(gpu):
        stream = torch.cuda.current_stream(gpu).cuda_stream
        for src, dst in zip(src_caches, dst_caches):
            ext.swap_blocks(src, dst, mapping, stream)
