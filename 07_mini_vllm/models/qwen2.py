"""Qwen2 = Llama + a bias on the q/k/v projections (none on o_proj).

Mirrors vLLM's `vllm/model_executor/models/qwen2.py` (`Qwen2Attention` builds `QKVParallelLinear(...,
bias=True)` and `RowParallelLinear(..., bias=False)`). Everything else — RMSNorm, RoPE, SwiGLU MLP,
tied embeddings for the small sizes, GQA — is the Llama code unchanged.
"""
from __future__ import annotations

from mini_vllm.config import ModelConfig
from mini_vllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return dict(qkv_bias=True, o_bias=False, qk_norm=False)
