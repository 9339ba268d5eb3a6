"""Self-attention on the paged KV cache: qkv -> (q/k norm) -> RoPE -> write K/V -> attend -> o_proj.

Two classes, as in vLLM:
  * `PagedAttention` is vLLM's `Attention` layer (vllm/attention/layer.py): it owns no weights,
    only the head geometry and the backend. Given this step's q/k/v it writes k/v into the
    layer's cache at `attn_metadata.slot_mapping` (chapter 01's `reshape_and_cache`) and runs
    chapter 05's `unified_attention` over the cache through `attn_metadata.block_tables` —
    prefill, decode and chunked prefill are the same call with different metadata.
  * `SelfAttention` is the model-side block (vLLM: `LlamaAttention` in models/llama.py):
    the projections, Qwen3's per-head q/k RMSNorm, and RoPE. A CustomOp: on a CPU its
    forward_cpu splits q/k/v out of the qkv projection and rotates q and k in one C++ pass.

The KV cache and the metadata are arguments, not state: vLLM binds caches to layers and
passes metadata through a global "forward context"; passing both explicitly lets a reader see,
at each call, exactly which tensors the kernels read and write.
"""
from __future__ import annotations

import torch
from torch import nn

from chunked_prefill.ops import unified_attention
from kernels_cpu import layer_ops
from paged_attention.metadata import AttentionMetadata
from paged_attention.ops import reshape_and_cache

from mini_vllm.models.custom_op import CustomOp
from mini_vllm.models.layers import Linear, QKVLinear, RMSNorm, apply_rotary_emb

# attn_backend -> (chapter 01 cache-write backend, chapter 05 unified-attention backend)
ATTENTION_BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("cpu", "cpu"),                  # the CPU default: the C++/OpenMP kernel (kernels_cpu), K/V read in place
    "torch": ("torch", "torch"),            # vectorized SDPA over the gathered blocks (CPU fallback)
    "reference": ("reference", "reference"),  # the per-token / per-request loops, the oracles (slow, clear)
    "triton": ("triton", "triton"),         # GPU, or CPU under TRITON_INTERPRET=1
    # vLLM's TritonAttentionBackend pairing: CUDA reshape_and_cache_flash + Triton unified_attention.
    "cuda": ("cuda", "triton"),
}

KVCache = tuple[torch.Tensor, torch.Tensor]   # (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, backend: str = "torch"):
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not supported; supported: {', '.join(ATTENTION_BACKENDS)}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.backend = backend
        self.cache_backend, self.attention_backend = ATTENTION_BACKENDS[backend]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        # query [T, H, D], key/value [T, KVH, D] -> [T, H, D]
        key_cache, value_cache = kv_cache
        ### BEGIN SOLUTION
        # The engine built slot_mapping itself: skip the range check (a device sync per layer on GPU).
        md = attn_metadata
        reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, check_values=False,
                          backend=self.cache_backend)
        # md.plan: the backend's per-step precomputation (chunked_prefill.build_attention_plan), or None.
        return unified_attention(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                 self.scale, backend=self.attention_backend, max_query_len=md.max_query_len,
                                 max_seq_len=md.max_seq_len, check_values=False, plan=md.plan)
        ### END SOLUTION


class SelfAttention(CustomOp):
    """The attention block of a Llama/Qwen2/Qwen3 decoder layer.

    qkv_bias: Qwen2 (and Llama/Qwen3 with attention_bias) add a bias to q/k/v; o_bias likewise on o_proj.
    qk_norm:  Qwen3 RMS-normalises each head of q and k before RoPE (stabilises attention logits).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, rms_norm_eps: float,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False, attn_backend: str = "torch"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = QKVLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.attn = PagedAttention(num_heads, head_dim, num_kv_heads, scale=head_dim ** -0.5, backend=attn_backend)

    def forward_native(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        T = hidden_states.shape[0]                                                   # hidden_states [T, hidden]
        ### BEGIN SOLUTION
        qkv = self.qkv_proj(hidden_states)                                           # [T, (H + 2 KVH) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)                                 # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)                              # [T, KVH, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        out = self.attn(q, k, v.contiguous(), kv_cache, attn_metadata)             # [T, H, D]
        return self.o_proj(out.view(T, self.q_size))                                 # [T, hidden]
        ### END SOLUTION

    def forward_cpu(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """forward_native, with the split of qkv, both rotations and v's copy in one C++ pass
        (kernels_cpu.layer_ops.rope_split_qkv). Qwen3's q/k norms sit between the split and the
        rotation: its blocks run forward_native."""
        if self.q_norm is not None:
            return self.forward_native(hidden_states, rope, kv_cache, attn_metadata)
        T = hidden_states.shape[0]
        cos, sin = rope                                                              # [T, 1, D] each
        q, k, v = layer_ops.rope_split_qkv(self.qkv_proj(hidden_states), cos.view(T, -1), sin.view(T, -1),
                                           self.num_heads, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, attn_metadata)                            # [T, H, D]
        return self.o_proj(out.view(T, self.q_size))                                 # [T, hidden]
