"""One Llama layer module: chapter 04's EAGLE head and toy target and the engine's models are built
from the same chapter 01 class (paged_attention/model/llama.py), each with its own attention op."""
from __future__ import annotations

import paged_attention.model.llama as chapter01
from mini_vllm.config import ModelConfig
from mini_vllm.models.attention import PagedAttention
from mini_vllm.models.llama import LlamaDecoderLayer, LlamaMLP
from mini_vllm.models.loader import get_model
from spec_decode.attention import TreeAttention
from spec_decode.eagle import EagleConfig, EagleHead
from spec_decode.toy_model import ToyForCausalLM


def test_chapter_04_and_the_engine_use_one_decoder_layer_class(tmp_path, tiny_checkpoint):
    assert LlamaDecoderLayer is chapter01.LlamaDecoderLayer and LlamaMLP is chapter01.LlamaMLP
    head = EagleHead(EagleConfig(hidden_size=32, vocab_size=40, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=8, intermediate_size=48))
    assert isinstance(head.layer, LlamaDecoderLayer) and type(head.layer) is LlamaDecoderLayer
    toy = ToyForCausalLM()
    assert all(type(layer) is LlamaDecoderLayer for layer in toy.model.layers)

    tiny_checkpoint(tmp_path, "llama")
    engine_model = get_model(ModelConfig.from_pretrained(tmp_path))
    assert all(type(layer) is LlamaDecoderLayer for layer in engine_model.model.layers)
    # What differs is the attention op each passes in.
    assert isinstance(head.layer.self_attn.attn, TreeAttention)
    assert all(isinstance(layer.self_attn.attn, PagedAttention) for layer in engine_model.model.layers)
