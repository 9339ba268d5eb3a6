"""Tiny random checkpoints of real architectures, saved by HF itself: the fixtures of chapters 07,
09 and 10 build on them (imported by name: tests/ is on pytest's pythonpath)."""
from __future__ import annotations

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
            bos_token_id=1, eos_token_id=2)
ENGINE_VOCAB = 49152          # tiny engine checkpoints use SmolLM2's tokenizer, so text prompts work


def make_tiny_checkpoint(path, model_type: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a randomly initialised HF model of `model_type` to `path`; returns the HF model (eval, fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model


def make_tiny_engine_checkpoint(path, model_type: str, seed: int = 0, **overrides):
    """A tiny random checkpoint with SmolLM2's vocabulary and tokenizer; returns the HF model."""
    from transformers import AutoTokenizer

    from mini_vllm.default_model import default_model_path

    hf = make_tiny_checkpoint(path, model_type, seed=seed, **{"vocab_size": ENGINE_VOCAB,
                                                              "max_position_embeddings": 1024, **overrides})
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(path)
    return hf
