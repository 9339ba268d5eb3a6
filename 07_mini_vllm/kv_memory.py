"""How many KV blocks the engine gets: profile on a GPU, a fixed budget on a CPU.

Mirrors vLLM v1's `vllm/v1/worker/gpu_worker.py: Worker.determine_available_memory` (with
`vllm/utils.py: memory_profiling`), `vllm/v1/core/kv_cache_utils.py:
check_enough_kv_cache_memory` and the start-up log lines "GPU KV cache size: N tokens" /
"Maximum concurrency for L tokens per request: Cx" — and the account of v0's
`determine_num_available_blocks` in [vLLM source notes, initialize_kv_caches].

GPU ([vLLM source notes, initialize_kv_caches]; [Kwon 2025, §4.2.1]): the engine may use `gpu_memory_utilization × total` bytes. Load
the weights, run one dummy forward at the largest step the scheduler can produce
(`ModelRunner.profile_run`), and read the peak. Whatever the weights, that activation peak and
the non-torch memory (CUDA context, cuBLAS workspaces) leave of the budget becomes KV blocks:

    kv_bytes   = total × gpu_memory_utilization − (torch peak: weights + activations) − non-torch
    num_blocks = kv_bytes // (2 × layers × block_size × kv_heads × head_dim × dtype bytes)

The budget counts only this process: memory other processes hold is checked up front (the
free memory at start must cover the budget), not subtracted.

CPU: nothing to profile against (activations come from the same RAM as everything else), so
the KV budget is given: `kv_cache_memory` bytes (vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mini_vllm.engine_config import GiB

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * GiB


@dataclass(frozen=True)
class KVCacheReport:
    """What start-up tells the user about KV memory."""
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    num_cpu_blocks: int = 0
    how: str = ""                        # how the size was decided

    @property
    def num_tokens(self) -> int:
        """KV slots: the most tokens all running requests together can hold."""
        return self.num_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len requests fit at once (vLLM's 'Maximum concurrency')."""
        return self.num_blocks / math.ceil(self.max_model_len / self.block_size)

    def __str__(self) -> str:
        text = (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens:,} tokens "
                f"({self.kv_cache_bytes / GiB:.2f} GiB, {self.how}); maximum concurrency for "
                f"{self.max_model_len:,}-token requests: {self.max_concurrency:.2f}x")
        if self.num_cpu_blocks:
            text += f"; CPU swap tier: {self.num_cpu_blocks} blocks"
        return text


def num_blocks_for_bytes(kv_bytes: int, bytes_per_block: int) -> int:
    return max(0, int(kv_bytes) // bytes_per_block)


def check_enough_kv_cache_memory(num_blocks: int, block_size: int, max_model_len: int, bytes_per_block: int,
                                 available_bytes: int) -> None:
    """Refuse to start if one max_model_len request cannot fit (vLLM: check_enough_kv_cache_memory),
    naming the max_model_len that would fit."""
    if num_blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({available_bytes / GiB:.2f} GiB available, one block is "
                         f"{bytes_per_block / 2**20:.2f} MiB): increase gpu_memory_utilization / kv_cache_memory, or "
                         "use a smaller model or dtype")
    needed = math.ceil(max_model_len / block_size)
    if num_blocks < needed:
        raise ValueError(f"to serve one request of max_model_len={max_model_len} tokens, the KV cache needs "
                         f"{needed} blocks ({needed * bytes_per_block / GiB:.2f} GiB) but only {num_blocks} fit "
                         f"({available_bytes / GiB:.2f} GiB available). The longest request that fits is "
                         f"{num_blocks * block_size} tokens: lower max_model_len to that, or raise "
                         "gpu_memory_utilization / kv_cache_memory")


@dataclass(frozen=True)
class GPUMemorySnapshot:
    free: int
    total: int

    @classmethod
    def take(cls, device: torch.device) -> "GPUMemorySnapshot":
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total)


def gpu_kv_cache_bytes(baseline: GPUMemorySnapshot, gpu_memory_utilization: float, device: torch.device) -> tuple[int, str]:
    """After the weights are loaded and profile_run() has run: the bytes left for KV blocks.

    baseline: taken before anything of ours was allocated on the device."""
    budget = baseline.total * gpu_memory_utilization
    if baseline.free < budget:
        raise ValueError(f"free memory on the device at start-up ({baseline.free / GiB:.2f} GiB of "
                         f"{baseline.total / GiB:.2f}) is less than the requested gpu_memory_utilization "
                         f"({gpu_memory_utilization} x {baseline.total / GiB:.2f} = {budget / GiB:.2f} GiB): "
                         "lower gpu_memory_utilization or free the device")
    torch.cuda.synchronize(device)
    torch_peak = torch.cuda.max_memory_allocated(device)             # weights + activation high-water mark
    now = GPUMemorySnapshot.take(device)
    used_by_us = (baseline.free - now.free)                          # what this process added since start-up
    non_torch = max(0, used_by_us - torch.cuda.memory_reserved(device))   # CUDA context, cuBLAS workspace, ...
    kv_bytes = int(budget - torch_peak - non_torch)
    how = (f"{gpu_memory_utilization:.0%} of {baseline.total / GiB:.1f} GiB minus {torch_peak / GiB:.2f} GiB "
           f"weights + activation peak and {non_torch / GiB:.2f} GiB non-torch")
    return kv_bytes, how
