"""The small layers of a Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU's activation.

Mirrors vLLM's `vllm/model_executor/layers/`:
  * `layernorm.py: RMSNorm`                  -> RMSNorm (with the fused residual add)
  * `rotary_embedding/: get_rope`            -> RotaryEmbedding + rope_inv_freq
  * `activation.py: SiluAndMul`              -> SiluAndMul

RMSNorm and SiluAndMul are CustomOps (custom_op.py): `forward_native` is the readable PyTorch (HF's
math op for op), `forward_cpu` one fused C++ pass of kernels_cpu/layer_ops.py, `forward_cuda` one
fused Triton kernel of triton_layer_ops.py. The C++ is imported only when chapter 07 binds that
forward (`EngineConfig.cpu_kernels="auto"`): with "off", and in chapter 04's EAGLE head and toy
target, nothing of kernels_cpu is touched. Likewise the Triton module is imported only by forward_cuda.
RotaryEmbedding is a table the model looks up once per step; the rotation happens in each
attention block, through QKRotation (a CustomOp: on a GPU one Triton kernel rotates q and k and
copies v; on a CPU the attention block's own forward_cpu fuses it with the split of qkv).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.custom_op import CustomOp


class RMSNorm(CustomOp):
    """y = x / sqrt(mean(x^2) + eps) * weight, the statistics in fp32.

    `forward(x, residual)` fuses the residual add that precedes every norm in a pre-norm
    decoder: it returns (norm(x + residual), x + residual). vLLM fuses the two into one kernel
    (`fused_add_rms_norm`) because the sum is read by the norm anyway; here it saves one
    activation-sized allocation per call, since the running residual is updated in place (it
    belongs to the model's forward and nobody else holds it) — except under autograd (chapter 04
    trains its EAGLE head through this layer), where backward still needs the old value.
    forward_cpu: the same in one C++ pass (kernels_cpu.layer_ops.rms_norm).
    forward_cuda: the same in one Triton kernel (triton_layer_ops.rms_norm), residual in place too.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)                                      # the identity scale, as HF and vLLM start

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ### BEGIN SOLUTION
        if residual is not None:
            if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad):
                x = residual + x                                        # a new tensor: autograd saved the old one
            else:
                x = residual.add_(x)                                    # [T, hidden] running residual stream
        dtype = x.dtype
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)                      # [T, 1] in fp32 whatever the model dtype
        out = self.weight * (h * torch.rsqrt(variance + self.eps)).to(dtype)
        ### END SOLUTION
        return out if residual is None else (out, x)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dim() != 2:                  # Qwen3's per-head q/k norms, [T, heads, D]: the kernel takes rows
            return self.forward_native(x, residual)
        from kernels_cpu import layer_ops                                   # only once chapter 07 bound this forward
        out = layer_ops.rms_norm(x, self.weight, self.eps, residual)        # residual updated in place
        return out if residual is None else (out, residual)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # Under autograd (chapter 04 trains through this layer) the native path keeps the graph; a residual
        # of another dtype or layout (never in the engine) also goes native.
        if (torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad))) or \
                x.dim() not in (2, 3) or x.stride(-1) != 1 or \
                (residual is not None and (x.dim() != 2 or residual.dtype != x.dtype or residual.shape != x.shape
                                           or residual.stride(-1) != 1)):
            return self.forward_native(x, residual)
        from paged_attention.model import triton_layer_ops                  # only once chapter 07 bound this forward
        out = triton_layer_ops.rms_norm(x, self.weight, self.eps, residual)  # residual updated in place
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

    def __init__(self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict | None = None,
                 dtype: torch.dtype = torch.float32):
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


class QKRotation(CustomOp):
    """q and k rotated by the step's (cos, sin), v copied beside them: what the attention block hands
    the attention op. q [T, H, D], k and v [T, KVH, D] (views of the qkv projection), cos/sin [T, 1, D]
    -> three new contiguous tensors of the same shapes.

    forward_native: `apply_rotary_emb` on q and on k. forward_cuda: both rotations and v's copy in
    one Triton launch (triton_layer_ops.rotary_embedding, exactly apply_rotary_emb's rounding) —
    vLLM's `RotaryEmbedding.forward_cuda` (csrc/pos_encoding_kernels.cu) in the same place."""

    def forward_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin), v.contiguous()

    def forward_cuda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):   # training: keep autograd's graph
            return self.forward_native(q, k, v, cos, sin)
        from paged_attention.model import triton_layer_ops                      # only once chapter 07 bound this forward
        return triton_layer_ops.rotary_embedding(q, k, cos, sin, v)


class SiluAndMul(CustomOp):
    """[T, 2I] = [gate | up] -> silu(gate) * up, [T, I] (the SwiGLU of Llama's MLP).
    forward_cpu: one C++ pass (kernels_cpu.layer_ops.silu_and_mul); forward_cuda: one Triton kernel
    (triton_layer_ops.silu_and_mul)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        from kernels_cpu import layer_ops                                   # only once chapter 07 bound this forward
        return layer_ops.silu_and_mul(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1 or (torch.is_grad_enabled() and x.requires_grad):
            return self.forward_native(x)
        from paged_attention.model import triton_layer_ops                  # only once chapter 07 bound this forward
        return triton_layer_ops.silu_and_mul(x)
