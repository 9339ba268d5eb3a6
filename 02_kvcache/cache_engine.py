"""CacheEngine: owns the KV tensors — device caches plus a CPU swap tier — and executes the
block moves the KVCacheManager decides. Mirrors vLLM v0's `vllm/worker/cache_engine.py`
(CacheEngine: _allocate_kv_cache, swap_in, swap_out, copy).

The manager (scheduler side) only deals in block ids; this object (worker side) holds the
bytes. Per step, before the forward pass, in this order: swap out, swap in, copy.

Pinned memory: a GPU can DMA to/from page-locked host memory asynchronously, and (under
unified virtual addressing) even read it from a kernel; pageable memory forces a staged,
synchronous copy. Pinning needs a CUDA runtime, so without a GPU the CPU tier is ordinary
memory (`pinned` says which one you got).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from kvcache.ops import copy_blocks, swap_blocks


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one model's KV cache (chapter 01's layout, one K and one V tensor per layer)."""
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    # Elements one (slot, KV head) row stores: head_dim, or more when the row carries its own
    # scale (an 8-bit cache's inline fp32 scale: head_dim + 4, paged_attention/kv_quant.py).
    row_dim: int | None = None

    def __post_init__(self):
        if self.row_dim is None:
            object.__setattr__(self, "row_dim", self.head_dim)
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "row_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}")
        if self.row_dim < self.head_dim:
            raise ValueError(f"KVCacheSpec.row_dim ({self.row_dim}) cannot be less than head_dim ({self.head_dim})")

    @property
    def bytes_per_block(self) -> int:
        """One logical block across the whole model: K and V of every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_dim * elem

    def allocate(self, num_blocks: int, device: torch.device | str, pin_memory: bool = False
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(key_caches, value_caches): num_layers tensors each of
        [num_blocks, block_size, num_kv_heads, row_dim (= head_dim for a float cache)], zero-filled."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a KV cache needs num_blocks >= 1, got {num_blocks!r}")
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.row_dim)

        def one_layer() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin_memory)
        return [one_layer() for _ in range(self.num_layers)], [one_layer() for _ in range(self.num_layers)]

    def allocate_per_layer(self, num_blocks: int, device: torch.device | str
                           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same tensors as `allocate`, as one (key_cache, value_cache) pair per layer: what a
        model's forward takes (chapter 07)."""
        return list(zip(*self.allocate(num_blocks, device)))


class CacheEngine:
    def __init__(self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 device: torch.device | str = "cpu", backend: str = "torch", pin_memory: bool | None = None):
        self.spec, self.backend = spec, backend
        self.device = torch.device(device)
        has_cuda = torch.cuda.is_available()
        if pin_memory is None:
            pin_memory = has_cuda
        elif pin_memory and not has_cuda:
            warnings.warn("pinned memory needs CUDA: the CPU swap tier falls back to ordinary (pageable) memory")
            pin_memory = False
        self.pinned = pin_memory
        self.key_caches, self.value_caches = spec.allocate(num_gpu_blocks, self.device)
        self.cpu_key_caches, self.cpu_value_caches = (spec.allocate(num_cpu_blocks, "cpu", pin_memory)
                                                      if num_cpu_blocks else ([], []))

    def swap_out(self, blocks_to_swap_out) -> None:
        """[(device_block, cpu_block)] from KVCacheManager.swap_out."""
        swap_blocks(self.key_caches + self.value_caches, self.cpu_key_caches + self.cpu_value_caches,
                    blocks_to_swap_out, backend=self.backend)

    def swap_in(self, blocks_to_swap_in) -> None:
        """[(cpu_block, device_block)] from KVCacheManager.swap_in."""
        swap_blocks(self.cpu_key_caches + self.cpu_value_caches, self.key_caches + self.value_caches,
                    blocks_to_swap_in, backend=self.backend)

    def copy(self, blocks_to_copy) -> None:
        """[(src, dst)] from KVCacheManager.append_slots (copy-on-write)."""
        copy_blocks(self.key_caches, self.value_caches, blocks_to_copy, backend=self.backend)

    def execute(self, blocks_to_swap_out=(), blocks_to_swap_in=(), blocks_to_copy=()) -> None:
        """One step's block moves, in the only safe order (see KVCacheManager's docstring)."""
        if len(blocks_to_swap_out):
            self.swap_out(blocks_to_swap_out)
        if len(blocks_to_swap_in):
            self.swap_in(blocks_to_swap_in)
        if len(blocks_to_copy):
            self.copy(blocks_to_copy)
