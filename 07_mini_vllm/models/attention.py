"""The engine's attention op: write this step's K/V into the paged cache, then attend over it.

`PagedAttention` is vLLM's `Attention` layer (vllm/attention/layer.py): it owns no weights, only
the head geometry and the backend. Given this step's q/k/v it writes k/v into the layer's cache at
`attn_metadata.slot_mapping` (chapter 01's `reshape_and_cache`) and runs chapter 05's
`unified_attention` over the cache through `attn_metadata.block_tables` — prefill, decode and
chunked prefill are the same call with different metadata.

It is the `attn` of chapter 01's attention block (paged_attention/model/llama.py: SelfAttention,
vLLM's `LlamaAttention`: the projections, Qwen3's q/k norms, RoPE), which chapter 04 builds with
its own op (tree masks) and the engine with this one (llama.py: LlamaModel).
"""
from __future__ import annotations

import torch
from torch import nn

from chunked_prefill.ops import unified_attention
from kernels_cpu import attention as cpu_attention
from paged_attention.kv_quant import KVQuant
from paged_attention.metadata import AttentionMetadata
from paged_attention.model.llama import KVCache
from paged_attention.ops import reshape_and_cache
from spec_decode.tree import paged_tree_attention

# attn_backend -> (chapter 01 cache-write backend, chapter 05 unified-attention backend)
ATTENTION_BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("cpu", "cpu"),                  # the CPU default: the C++/OpenMP kernel (kernels_cpu), K/V read in place
    "torch": ("torch", "torch"),            # vectorized SDPA over the gathered blocks (CPU fallback)
    "reference": ("reference", "reference"),  # the per-token / per-request loops, the oracles (slow, clear)
    "triton": ("triton", "triton"),         # GPU, or CPU under TRITON_INTERPRET=1
    # vLLM's TritonAttentionBackend pairing: CUDA reshape_and_cache_flash + Triton unified_attention.
    "cuda": ("cuda", "triton"),
}


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, backend: str = "torch",
                 kv_quant: KVQuant | None = None):
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not supported; supported: {', '.join(ATTENTION_BACKENDS)}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.backend = backend
        self.cache_backend, self.attention_backend = ATTENTION_BACKENDS[backend]
        # An 8-bit cache (kv_cache_dtype; chapter 01's kv_quant.py): the write quantizes, every read
        # dequantizes. Per-tensor fp8 keeps this layer's k_scale / v_scale (vLLM: Attention._k_scale).
        self.kv_quant = kv_quant

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        # query [T, H, D], key/value [T, KVH, D] -> [T, H, D]
        key_cache, value_cache = kv_cache
        if getattr(attn_metadata, "tree_masks", None):
            return self._tree_verification(query, key, value, key_cache, value_cache, attn_metadata)
        ### BEGIN SOLUTION
        # The engine built slot_mapping itself: skip the range check (a device sync per layer on GPU).
        md = attn_metadata
        reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, check_values=False,
                          backend=self.cache_backend, kv_quant=self.kv_quant)
        # md.plan: the backend's per-step precomputation (chunked_prefill.build_attention_plan), or None.
        return unified_attention(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                 self.scale, backend=self.attention_backend, max_query_len=md.max_query_len,
                                 max_seq_len=md.max_seq_len, check_values=False, plan=md.plan,
                                 kv_quant=self.kv_quant)
        ### END SOLUTION

    def _tree_verification(self, query, key, value, key_cache, value_cache, md) -> torch.Tensor:
        """A step that verifies EAGLE-2 trees (spec_decode_mixin.py lays them out): K/V written by
        slot as always, then tree attention — each new token sees the context and, among the new
        tokens, what its request's mask allows (None: causal). The CPU kernel takes the masks
        (vLLM's tree attention bias); the other backends run chapter 04's paged tree attention."""
        reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, check_values=False,
                          backend=self.cache_backend, kv_quant=self.kv_quant)
        if self.attention_backend == "cpu":
            # md.plan: the masks packed once for every layer (spec_decode_mixin._with_tree_layout)
            return cpu_attention.unified_attention(query, key_cache, value_cache, md.block_tables, md.seq_lens,
                                                   md.query_start_loc, self.scale, kv_quant=self.kv_quant,
                                                   tree_masks=md.plan if md.plan is not None else md.tree_masks)
        return paged_tree_attention(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                    md.tree_masks, self.scale, kv_quant=self.kv_quant)
