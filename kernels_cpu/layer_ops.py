"""The decoder's small ops as fused CPU kernels: RMSNorm (+ residual add), SiLU-and-mul, and RoPE
applied while q/k/v are split out of the qkv projection (csrc/layer_ops.cpp).

vLLM's CPU build calls its own C++ for these (`csrc/cpu/layernorm.cpp`, `activation.cpp`,
`pos_encoding.cpp`), chosen by `CustomOp.forward_cpu` where other platforms take `forward_native`
or `forward_cuda`. The engine's layers (chapter 01's paged_attention/model/) are CustomOps the same way:
their `forward_native` is the readable PyTorch (the oracle: HF's math op for op), their
`forward_cpu` calls these, and which one runs is bound once when the model is built.

Why: in PyTorch each of these is 3-8 ops, each a pass over the activations and a dispatch;
`python -m benchmarks.bench_cpu_layer_ops` times both per op and through a SmolLM2 forward.

Numerics (see the .cpp): RoPE and the residual add are bit for bit the PyTorch result;
the RMSNorm row sum and SiLU's exp() differ from torch's in the last bits (tolerance tests).

Build: like every kernel here (build.py), compiled on first use into torch's extension cache.
"""
from __future__ import annotations

import torch

from kernels_cpu import build

SOURCES = ("layer_ops.cpp",)          # + vec.h
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load(isa: str | None = None):
    """The layer ops' extension for `isa` (default: this CPU's best; built on first use, build.py)."""
    # -ffp-contract=off: no fused multiply-adds, so RoPE rounds exactly as the torch ops do.
    return build.load_extension("cpu_layer_ops", SOURCES, "CPU layer ops", isa, ("-ffp-contract=off",))


def is_available() -> bool:
    """True when the kernels are (or can be) built here. Builds them on the first call."""
    try:
        load()
        return True
    except RuntimeError:
        return False


def unavailable_reason() -> str | None:
    """Why `load` fails here (None when it works)."""
    try:
        load()
        return None
    except RuntimeError as e:
        return str(e)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] -> RMSNorm(x); with residual: residual += x (in place), returns RMSNorm(residual)."""
    return load().rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    return load().silu_and_mul(x)


def rope_split_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) * D], cos/sin [T, D] -> (q [T, H, D] rotated, k [T, KVH, D] rotated, v [T, KVH, D])."""
    return load().rope_split_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
