"""How long one forward pass takes, without running a model: a + b·tokens + c·context.

Scheduling experiments need step times, not logits. One step of a decoder-only model:
  a        reads every weight once, whatever the batch (memory-bound floor);
  b·tokens does ~2·num_params FLOPs per token in the linear layers (compute-bound part);
  c·context reads the K/V of every token each scheduled request attends to (attention is
           memory-bound: context = Σ seq_len over the scheduled requests).
The sum is the usual linear approximation of a roofline max(); simulators such as Vidur and
the Sarathi paper [Agrawal 2023] fit exactly these terms. A swap adds blocks · block_bytes / PCIe bandwidth.

`StepCostModel.from_hardware` derives a, b, c from first principles (bytes and FLOPs over
bandwidth and peak throughput), so every number is stated and reproducible; the default
`OPT_13B_A100` is the thesis' main setting [Kwon 2025, §3.6.1, Table 3.1]: OPT-13B in fp16 on one
A100-40GB, 800 KB of K/V per token (2 · 5120 hidden · 40 layers · 2 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCostModel:
    a: float                       # seconds per step (weights read once)
    b: float                       # seconds per scheduled token (linear-layer FLOPs)
    c: float                       # seconds per context token attended to (K/V bytes read)
    swap_s_per_block: float = 0.0  # seconds to copy one KV block across PCIe (each direction)
    name: str = "custom"

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c, self.swap_s_per_block) < 0:
            raise ValueError(f"cost coefficients must be >= 0: {self}")

    def step_time(self, num_tokens: int, num_context_tokens: int, num_swapped_blocks: int = 0) -> float:
        """Seconds for one step; an empty step (nothing scheduled) costs nothing."""
        if num_tokens == 0 and num_swapped_blocks == 0:
            return 0.0
        ### BEGIN SOLUTION
        compute = self.a + self.b * num_tokens + self.c * num_context_tokens if num_tokens else 0.0
        return compute + self.swap_s_per_block * num_swapped_blocks
        ### END SOLUTION

    @classmethod
    def from_hardware(cls, *, num_params: float, kv_bytes_per_token: float, bytes_per_param: float,
                      mem_bandwidth: float, peak_flops: float, mfu: float, pcie_bandwidth: float,
                      block_size: int, copies_per_block: int = 0, copy_latency: float = 0.0,
                      name: str = "custom") -> "StepCostModel":
        """a = weight bytes / HBM bandwidth; b = 2·params FLOPs / (peak · MFU);
        c = K/V bytes per token / HBM bandwidth; swap = block bytes / PCIe bandwidth plus a fixed
        latency per copy — a block is `copies_per_block` separate copies (K and V of every layer),
        which is why small blocks make swapping slow [Kwon 2025, §3.7.3, Fig. 3.19a]."""
        if not 0 < mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {mfu}")
        return cls(a=num_params * bytes_per_param / mem_bandwidth,
                   b=2 * num_params / (peak_flops * mfu),
                   c=kv_bytes_per_token / mem_bandwidth,
                   swap_s_per_block=block_size * kv_bytes_per_token / pcie_bandwidth + copies_per_block * copy_latency,
                   name=name)


# OPT-13B fp16 on A100-40GB [Kwon 2025, Table 3.1]: 13e9 params x 2 B; 800 KB K/V per token;
# 1555 GB/s HBM2; 312 TFLOP/s fp16 tensor cores at an assumed 50% MFU; 25 GB/s effective
# PCIe 4.0 x16 for swapping, 80 copies per block (K and V of 40 layers) at an assumed 5 us each.
# -> a = 16.7 ms, b = 0.167 ms/token, c = 0.53 us/context token, swap = 0.92 ms per 16-token block.
def opt_13b_a100(block_size: int = 16) -> StepCostModel:
    return StepCostModel.from_hardware(
        num_params=13e9, kv_bytes_per_token=2 * 5120 * 40 * 2, bytes_per_param=2, mem_bandwidth=1555e9,
        peak_flops=312e12, mfu=0.5, pcie_bandwidth=25e9, block_size=block_size, copies_per_block=2 * 40,
        copy_latency=5e-6, name=f"OPT-13B fp16, A100-40GB, block {block_size}")


# KV capacity of that setting [Kwon 2025, Table 3.1]: 12 GB for the cache / 800 KB per token = 15.7K slots.
OPT_13B_A100_KV_TOKENS = 15_700


# Llama-3-8B bf16 on H100-SXM (a current setting, used by chapter 05's chunked-prefill
# experiment): 8.0e9 params x 2 B; K/V per token 2 (K,V) x 8 KV heads x 128 dims x 32 layers
# x 2 B = 128 KiB; 3.35 TB/s HBM3; 989 TFLOP/s dense bf16 at an assumed 50% MFU; 50 GB/s
# PCIe 5.0 x16, 64 copies per block at 5 us.
# -> a = 4.8 ms, b = 32 us/token, c = 39 ns/context token, swap = 0.36 ms per 16-token block.
def llama_3_8b_h100(block_size: int = 16) -> StepCostModel:
    return StepCostModel.from_hardware(
        num_params=8.0e9, kv_bytes_per_token=2 * 8 * 128 * 32 * 2, bytes_per_param=2, mem_bandwidth=3.35e12,
        peak_flops=989e12, mfu=0.5, pcie_bandwidth=50e9, block_size=block_size, copies_per_block=2 * 32,
        copy_latency=5e-6, name=f"Llama-3-8B bf16, H100-SXM, block {block_size}")


OPT_13B_A100 = opt_13b_a100()
LLAMA_3_8B_H100 = llama_3_8b_h100()
