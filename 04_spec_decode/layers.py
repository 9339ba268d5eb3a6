"""A Llama decoder layer over the paged KV cache — the one the EAGLE head is made of (and the
toy target model of the tests and notebook).

The engine's own model classes live in chapter 07, which this chapter may not import; the
drafters only need this small set, written in the same shape as vLLM's / the engine's
Llama (`layer(hidden, residual, rope, kv_cache, attn_metadata) -> (hidden, residual)`, fused
residual-add RMSNorm), so that chapter 07's models plug into the same proposer protocol.

Two paths, same weights:
* `forward` — the serving path: a flat ragged batch, K/V written through the slot mapping
  (chapter 01's reshape_and_cache) and read through block tables, causal or tree-masked
  (tree.paged_tree_attention);
* `forward_dense` — training: [batch, seq] with causal SDPA, no cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_attention.cache_ops import reshape_and_cache
from spec_decode.tree import paged_tree_attention


class RMSNorm(nn.Module):
    """norm(x) or, with a residual, (norm(x + residual), x + residual) — the fused form."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings (HF's rotate-half form)."""

    def __init__(self, head_dim: int, max_position: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)    # [P, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                             # [P, d]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} beyond the rotary table ({self.cos.shape[0]})")
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, d]; cos/sin [..., T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


class SelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.scale = head_dim ** -0.5

    def _qkv(self, x, cos, sin):
        shape = x.shape[:-1]
        q = apply_rope(self.q_proj(x).view(*shape, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(*shape, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, rope, kv_cache, attn_metadata) -> torch.Tensor:   # [T, hidden]
        q, k, v = self._qkv(x, *rope)                                                   # [T, heads, d]
        key_cache, value_cache = kv_cache
        reshape_and_cache(k, v, key_cache, value_cache, attn_metadata.slot_mapping, check_values=False)
        out = paged_tree_attention(q, key_cache, value_cache, attn_metadata.block_tables, attn_metadata.seq_lens,
                                   attn_metadata.query_start_loc, getattr(attn_metadata, "tree_masks", None),
                                   self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_dense(self, x: torch.Tensor, cos, sin) -> torch.Tensor:                # [B, T, hidden]
        q, k, v = self._qkv(x, cos, sin)                                                # [B, T, heads, d]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama block: x + attn(norm(x)), then + mlp(norm(.)), residual carried fused."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float = 1e-6):
        super().__init__()
        self.self_attn = SelfAttention(hidden_size, num_heads, num_kv_heads, head_dim)
        self.mlp = MLP(hidden_size, intermediate_size)
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, hidden, residual, rope, kv_cache, attn_metadata):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_dense(self, hidden, residual, cos, sin):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn.forward_dense(hidden, cos, sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
