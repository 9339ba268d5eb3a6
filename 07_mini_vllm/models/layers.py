"""The building blocks of a Llama-family decoder, written for a flat ragged batch of tokens.

Mirrors vLLM's `vllm/model_executor/layers/`:
  * `layernorm.py: RMSNorm`                  -> RMSNorm (with the fused residual add)
  * `rotary_embedding/: get_rope`            -> RotaryEmbedding + rope_inv_freq
  * `activation.py: SiluAndMul`              -> SiluAndMul
  * `linear.py: MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear`
                                             -> MergedColumnLinear, QKVLinear, Linear (one GPU: no parallelism)
and `vllm/model_executor/custom_op.py: CustomOp` -> custom_op.py (RMSNorm, SiluAndMul and attention.py's
SelfAttention are CustomOps: forward_native, the readable PyTorch, and forward_cpu, a fused C++ op).

Every activation is 2-D `[num_tokens, ...]`: the tokens of all requests in a step laid end to end,
no batch dimension and no padding (vLLM v1's layout). Parameters are created uninitialised
(`torch.empty`): the loader overwrites every one of them and fails loudly if any is missing,
so random initialisation would be wasted work (seconds for SmolLM2 on a CPU).

Numerics follow HF transformers op for op (fp32 norm statistics, the same RoPE frequencies and
rotation), so fp32 results agree with the oracle to rounding (see the README, "Parity").

Fast ops enter through two seams only, both chosen once after loading (`loader.get_model`): a
Linear's `linear_method` (linear_method.py) and a CustomOp's bound forward (custom_op.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels_cpu import layer_ops

from mini_vllm.models.custom_op import CustomOp
from mini_vllm.models.linear_method import UNQUANTIZED, LinearMethodBase


class Linear(nn.Module):
    """y = x @ W^T (+ b), parameters uninitialised (the loader fills them).

    The matmul is `linear_method`'s (linear_method.py): plain `F.linear` until the loader picks a
    CPU GEMM for the loaded weights (`process_weights_after_loading`), which also sets
    `packed_weight`, W packed once for that GEMM (None: the method reads `weight` itself)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.linear_method: LinearMethodBase = UNQUANTIZED
        self.packed_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [T, in] -> [T, out]
        return self.linear_method.apply(self, x)

    def drop_unpacked_weight(self) -> None:
        """Once packed, the row-major weight is dead memory: replace it by an empty tensor (vLLM:
        `dispatch_cpu_unquantized_gemm(remove_weight=True)`). Only the packed copy is read."""
        if self.packed_weight is None:
            raise ValueError("drop_unpacked_weight: this Linear has no packed weight to run on")
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)


class MergedColumnLinear(Linear):
    """Several linears that read the same input, stacked along the output dim: ONE matmul.

    Why: q/k/v (and gate/up) projections all read the same normed hidden state. One GEMM over
    the stacked weight reads the input once and launches one kernel instead of three — what
    matters in a GPU decode step, where each small GEMM is bound by launch overhead and by reading
    its weights (on a CPU at SmolLM2's sizes the gain is within noise). Checkpoints still store the
    pieces separately, so each piece is a *shard* with its own `weight_loader`
    (vLLM: `MergedColumnParallelLinear.weight_loader(param, loaded_weight, loaded_shard_id)`).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_ids: tuple = tuple(range(len(output_sizes)))
        for param in self.parameters():
            param.weight_loader = self.weight_loader     # the loader calls param.weight_loader(param, tensor, shard_id)
            param.shard_ids = self.shard_ids             # every shard must be loaded exactly once

    def shard_slice(self, shard_id) -> tuple[int, int]:
        index = self.shard_ids.index(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id) -> None:
        offset, size = self.shard_slice(shard_id)
        target = param.data.narrow(0, offset, size)      # rows [offset, offset + size) of W (or b)
        if loaded_weight.shape != target.shape:
            raise ValueError(f"shard {shard_id!r}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(loaded_weight)


class QKVLinear(MergedColumnLinear):
    """q, k and v projections as one matmul: output = [q (H*D) | k (KVH*D) | v (KVH*D)].

    With GQA the three shards have different sizes (vLLM: `QKVParallelLinear`, shard ids "q"/"k"/"v").
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)
        self.shard_ids = ("q", "k", "v")
        for param in self.parameters():
            param.shard_ids = self.shard_ids


class VocabEmbedding(nn.Module):
    """token id -> row of the embedding matrix (vLLM: VocabParallelEmbedding, one GPU).

    A tied lm_head (SmolLM2, small Qwens) is this matrix: `compute_logits` runs it as a linear
    through the same seam as a Linear (`linear_method`, `packed_weight`; bias None)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.bias = None
        self.linear_method: LinearMethodBase = UNQUANTIZED
        self.packed_weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)


class RMSNorm(CustomOp):
    """y = x / sqrt(mean(x^2) + eps) * weight, the statistics in fp32.

    `forward(x, residual)` fuses the residual add that precedes every norm in a pre-norm
    decoder: it returns (norm(x + residual), x + residual). vLLM fuses the two into one kernel
    (`fused_add_rms_norm`) because the sum is read by the norm anyway; here it saves one
    activation-sized allocation per call, since the running residual is updated in place (it
    belongs to the model's forward and nobody else holds it). forward_cpu: the same in one C++
    pass (kernels_cpu.layer_ops.rms_norm).
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ### BEGIN SOLUTION
        if residual is not None:
            x = residual.add_(x)                                        # [T, hidden] running residual stream
        dtype = x.dtype
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)                      # [T, 1] in fp32 whatever the model dtype
        out = self.weight * (h * torch.rsqrt(variance + self.eps)).to(dtype)
        ### END SOLUTION
        return out if residual is None else (out, x)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dim() != 2:                  # Qwen3's per-head q/k norms, [T, heads, D]: the kernel takes rows
            return self.forward_native(x, residual)
        out = layer_ops.rms_norm(x, self.weight, self.eps, residual)        # residual updated in place
        return out if residual is None else (out, residual)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Rotation speed of each pair of dims, [head_dim // 2] fp32: theta^(-2i/d), then rescaled.

    The math of HF's `ROPE_INIT_FUNCTIONS` (transformers/modeling_rope_utils.py) and vLLM's
    `rotary_embedding/` classes, for the variants we support:
      default : inv_freq_i = theta^(-2i/d)
      linear  : inv_freq / factor                     (position interpolation: positions squeezed by `factor`)
      llama3  : long wavelengths (> original_len / low_freq_factor) slowed by `factor`, short ones
                (< original_len / high_freq_factor) kept, a smooth blend in between (Llama 3.1).
    """
    ### BEGIN SOLUTION
    # On the CPU whatever the model's device, as HF computes it (one ulp of pow differs across devices).
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        old_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)                 # 0 at the low edge, 1 at the high edge
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    ### END SOLUTION
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """RoPE through a precomputed table: cos/sin of every (position, frequency), looked up by position.

    vLLM's `RotaryEmbedding` keeps the same `cos_sin_cache` [max_position, head_dim] (cos | sin),
    computed once, and indexes it with the flat `positions` tensor: a step costs one gather, not
    a trig call per token per step. Rotation is the "neox" layout HF Llama uses: dims (i, i + d/2)
    form a pair. Positions must be < max_position (the engine's max_model_len).

    The model calls `cos_sin(positions)` once per step and every layer reuses it.
    """

    def __init__(self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict | None, dtype: torch.dtype):
        super().__init__()
        t = torch.arange(max_position, dtype=torch.float32)                        # [max_position] (on the model's device)
        inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling).to(t.device)  # [d/2] fp32
        freqs = t[:, None] * inv_freq[None, :]                                     # [max_position, d/2] (as HF: pos * inv_freq)
        # Rounded to the model dtype once, as HF rounds cos/sin to the activations' dtype.
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, d]: each half-angle repeated for both dims of its pair."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)                  # [T, d/2] each
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) by its angle: [T, heads, d] -> [T, heads, d].

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), written as HF writes it,
    `x * cos + rotate_half(x) * sin` with rotate_half(x) = (-x2, x1): the same ops in the same
    order, so bit for bit HF's result, and two full-width multiplies instead of four half-width ones.
    """
    ### BEGIN SOLUTION
    x1, x2 = x.chunk(2, dim=-1)                                                    # [T, heads, d/2] each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    ### END SOLUTION


class SiluAndMul(CustomOp):
    """[T, 2I] = [gate | up] -> silu(gate) * up, [T, I] (the SwiGLU of Llama's MLP).
    forward_cpu: one C++ pass (kernels_cpu.layer_ops.silu_and_mul)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return layer_ops.silu_and_mul(x)
