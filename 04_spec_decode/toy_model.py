"""A tiny Llama-shaped target model on the paged KV cache — for tests and the notebook only.

It is built like chapter 07's models — from the same chapter 01 layers (paged_attention/model/:
LlamaDecoderLayer, RMSNorm, RotaryEmbedding, the linears), with this chapter's attention op
(attention.py: TreeAttention) — and has their structure (model.embed_tokens / model.layers /
model.norm / model.rotary_emb.cos_sin, forward(input_ids, positions, kv_caches, attn_metadata) ->
hidden, compute_logits(hidden) -> fp32 logits), so the drafters are tested against the same
protocol the engine's models implement. Random weights; a `temperature`-like `logit_scale` makes
its greedy output less trivial.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_attention.block_table import build_attention_metadata
from paged_attention.model.layers import RMSNorm, RotaryEmbedding
from model_executor.linear import Linear, VocabEmbedding
from paged_attention.model.llama import LlamaDecoderLayer
from spec_decode.attention import TreeAttention


@dataclass
class ToyConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    intermediate_size: int = 64
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    logit_scale: float = 4.0
    rms_norm_eps: float = 1e-6


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        c = config
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(c, TreeAttention(c.num_attention_heads, c.head_dim, c.num_key_value_heads,
                                               scale=c.head_dim ** -0.5))
            for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, num_layers: int | None = None):
        hidden = self.embed_tokens(input_ids)                                     # [T, hidden]
        rope = self.rotary_emb.cos_sin(positions)
        residual = None
        for layer, kv_cache in zip(self.layers[:num_layers], kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class ToyForCausalLM(nn.Module):
    def __init__(self, config: ToyConfig | None = None, seed: int = 0):
        super().__init__()
        self.config = config or ToyConfig()
        torch.manual_seed(seed)
        self.model = ToyModel(self.config)
        self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size)
        # Chapter 01's layers start uninitialised (a loader fills them): torch.nn's init, the same draws in
        # the same order as the nn.Linear / nn.Embedding version of this model, so a seed keeps its weights.
        for m in self.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.5 / p.shape[-1] ** 0.5 * 2)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} (key_cache, value_cache) pairs, got {len(kv_caches)}")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) * self.config.logit_scale).float()

    def make_kv_caches(self, num_blocks: int, block_size: int, num_layers: int | None = None,
                       fill: float = float("nan")) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (key_cache, value_cache) [num_blocks, block_size, kv_heads, head_dim],
        NaN-filled so a read of a never-written slot poisons the output."""
        c = self.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        return [(torch.full(shape, fill), torch.full(shape, fill))
                for _ in range(num_layers or c.num_hidden_layers)]


@torch.no_grad()
def dense_logits(model: ToyForCausalLM, token_ids: list[int]) -> torch.Tensor:   # [len, vocab]
    """The whole sequence in one causal pass through a throwaway cache: the oracle the
    drafters' step-by-step, multi-request paged passes are compared with."""
    n = len(token_ids)
    block_size = 16
    num_blocks = -(-n // block_size)
    caches = model.make_kv_caches(num_blocks, block_size)
    md = build_attention_metadata([list(range(num_blocks))], [0], [n], block_size)
    hidden = model(torch.tensor(token_ids), torch.arange(n), caches, md)
    return model.compute_logits(hidden)


@torch.no_grad()
def greedy_generate(model: ToyForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """Plain greedy decoding (no speculation), recomputing the whole sequence: the oracle."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(dense_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]
