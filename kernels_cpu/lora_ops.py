"""Multi-LoRA's shrink and expand as CPU kernels (csrc/lora_ops.cpp): the products through each
token's own adapter, tokens grouped by adapter inside the kernel.

vLLM on a CPU runs them as torch ops (vllm/lora/ops/torch_ops/lora_ops.py, through
vllm/lora/punica_wrapper/punica_cpu.py: bgmv / sgmv); this is ours, the "cpu" backend of
chapter 09 (`lora/cpu_ops.py`, which checks the arguments first -- this module is the raw entry).

Why: BGMV in torch copies an adapter per token before it can multiply, SGMV is a Python loop of
small matmuls over the segments. The kernel counting-sorts the tokens by adapter, reads each
adapter's matrices once per group of up to 16 of its tokens, skips the tokens without one,
and computes in fp32 with one rounding to y's dtype (the reference's arithmetic, in another
order of sums).

Build: like every kernel here (build.py), compiled on first use into torch's extension cache.
"""
from __future__ import annotations

import torch

from kernels_cpu import build

SOURCES = ("lora_ops.cpp",)       # + vec.h
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load(isa: str | None = None):
    """The LoRA ops extension for `isa` (default: this CPU's best; built on first use, build.py)."""
    return build.load_extension("cpu_lora_ops", SOURCES, "CPU LoRA kernel", isa)


def is_available() -> bool:
    """True when the kernels are (or can be) built here. Builds them on the first call."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why `load` fails here (None when it works)."""
    return build.unavailable_reason_of(load)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora: torch.Tensor, scales: torch.Tensor,
                out: torch.Tensor, isa: str | None = None) -> None:
    """x [T, in] (unit column stride), lora_a contiguous [slots, slices, rank, in] of x's dtype,
    token_lora contiguous int64 [T] in [-1, slots), scales contiguous float32 [slots], out
    contiguous float32 [slices, T, rank]: out[s, t] = scales[i] * lora_a[i, s] @ x[t], i =
    token_lora[t]; zero rows for i = -1."""
    load(isa).lora_shrink(x, lora_a, token_lora, scales, out)


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora: torch.Tensor, y: torch.Tensor,
                offsets: torch.Tensor, sizes: torch.Tensor, add_inputs: bool = True, isa: str | None = None) -> None:
    """buffer contiguous float32 [slices, T, rank], lora_b contiguous [slots, slices, max_out, rank]
    of y's dtype, y [T, total_out] (unit column stride, written in place), offsets / sizes int64
    [slices]: y[t, offsets[s] + n] (+)= lora_b[i, s, n] @ buffer[s, t] for n < sizes[s], tokens
    with an adapter i = token_lora[t]; rows of tokens with -1 are not touched."""
    load(isa).lora_expand(buffer, lora_b, token_lora, y, offsets, sizes, add_inputs)
