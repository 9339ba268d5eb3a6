"""Qwen3 = Llama + per-head RMSNorm on q and k before RoPE ("QK-norm"), no q/k/v bias.

Mirrors vLLM's `vllm/model_executor/models/qwen3.py` (`Qwen3Attention`: `q_norm`/`k_norm` are
RMSNorm(head_dim) applied to each head). QK-norm bounds the size of attention logits, which lets
Qwen3 drop Qwen2's qkv bias. Checkpoint names `self_attn.q_norm.weight` / `k_norm.weight` load
into `SelfAttention.q_norm` / `k_norm` directly. The `attention_bias` flag is honoured as in HF.
"""
from __future__ import annotations

from mini_vllm.config import ModelConfig
from mini_vllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return dict(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)
