"""The Llama family (Llama 2/3, SmolLM2, Mistral-style GQA) on paged attention, from scratch.

Mirrors vLLM's `vllm/model_executor/models/llama.py`: `LlamaModel`, `LlamaForCausalLM` (+
`compute_logits`, and `load_weights`' stacked_params_mapping, used by loader.py). The layers are
chapter 01's (paged_attention/model/: `LlamaDecoderLayer`, its `SelfAttention` — vLLM's
`LlamaAttention` — and `LlamaMLP`, the linears, norms and RoPE), the same class chapter 04's EAGLE
head is made of; the engine builds each layer with its attention op, attention.py's `PagedAttention`
(chapter 05's unified attention over the paged cache).

The forward contract the engine's model runner relies on (same as vLLM v1):

    hidden = model(input_ids [T] int64, positions [T] int64, kv_caches, attn_metadata)   # [T, hidden]
    logits = model.compute_logits(hidden[logits_indices])                                # [N, vocab] fp32

`T` tokens of any number of requests, laid end to end (no padding); `kv_caches[i]` is layer i's
(key_cache, value_cache); `attn_metadata` (chapter 01's AttentionMetadata) says where each token's
K/V go and which blocks each request reads. Only the rows that are sampled go through the
vocabulary projection: for a 500-token prefill that is 1 row, not 500.

Qwen2 and Qwen3 differ from Llama in three switches, chosen by `attention_options` (qwen2.py, qwen3.py).
"""
from __future__ import annotations

import torch
from torch import nn

from paged_attention.metadata import AttentionMetadata
from paged_attention.model.layers import RMSNorm, RotaryEmbedding
from paged_attention.model.linear import Linear, VocabEmbedding
from paged_attention.model.llama import STACKED_PARAMS_MAPPING, KVCache, LlamaDecoderLayer, LlamaMLP

from mini_vllm.config import ModelConfig
from mini_vllm.models.attention import PagedAttention

__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel"]


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, attn_backend: str):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, PagedAttention(config.num_attention_heads, config.head_dim,
                                                     config.num_key_value_heads, scale=config.head_dim ** -0.5,
                                                     backend=attn_backend),
                              qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # One table for all layers, sized for the longest sequence the engine will run.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta,
                                          config.rope_scaling, dtype=config.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)                               # [T, hidden]
        rope = self.rotary_emb.cos_sin(positions)                                  # computed once, used by every layer
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(hidden_states, residual, rope, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states                                                       # [T, hidden]


class LlamaForCausalLM(nn.Module):
    # Checkpoint names -> our merged parameters: (our param, checkpoint piece, shard id), the layer's
    # (vLLM: LlamaForCausalLM.load_weights' stacked_params_mapping). Used by loader.load_weights.
    stacked_params_mapping = STACKED_PARAMS_MAPPING

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        """What differs between the families' attention blocks. Llama: one flag for all biases."""
        return dict(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=False)

    def __init__(self, config: ModelConfig, attn_backend: str = "torch"):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend=attn_backend, **self.attention_options(config))
        # Tied embeddings (SmolLM2, small Qwens): the output projection IS the input embedding matrix.
        self.lm_head = self.model.embed_tokens if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be 1-D [num_tokens] (a flat ragged batch), got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if input_ids.shape[0] != attn_metadata.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} input tokens but attn_metadata.slot_mapping has {attn_metadata.num_tokens}")
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected one (key_cache, value_cache) per layer ({len(self.model.layers)}), got {len(kv_caches)}")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 (the sampler works in fp32 whatever the model dtype)."""
        return self.lm_head.linear_method.apply(self.lm_head, hidden_states).float()
