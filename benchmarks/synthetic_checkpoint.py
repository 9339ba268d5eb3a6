"""Random-weight checkpoints that need nothing from the network: HF's own model classes with a
given config, saved with a synthetic tokenizer.

Why: a GPU machine may reach no package index, so SmolLM2's real weights (and the tokenizer that
comes with them) cannot be installed there. Speed and CUDA-graph / memory checks do not depend on
the weights' values, and parity with HF holds on any weights, so those checks run on random
weights of the real shape. Prompts are token ids; the tokenizer only has to load (the engine reads
its special tokens) and to turn ids into some text.
"""
from __future__ import annotations

from pathlib import Path

import torch

# SmolLM2-135M-Instruct's architecture (its config.json, as converted by mini_vllm.default_model).
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2, pad_token_id=2, initializer_range=0.02)


def save_synthetic_tokenizer(path: Path, vocab_size: int, bos_token_id: int, eos_token_id: int) -> None:
    """A word-level tokenizer over `vocab_size` made-up words "<i>" (id i), so any id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")          # joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token=f"<{bos_token_id}>",
                                   eos_token=f"<{eos_token_id}>")
    fast.save_pretrained(path)


def save_random_checkpoint(path: Path, model_type: str, config_kwargs: dict, dtype: torch.dtype = torch.float32,
                           seed: int = 0):
    """Save HF's `model_type` model with random weights and `config_kwargs`, plus a synthetic
    tokenizer, to `path`; returns the HF model (eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(path)
    save_synthetic_tokenizer(path, config.vocab_size, config.bos_token_id, _first(config.eos_token_id))
    return model


def _first(token_id):
    return token_id[0] if isinstance(token_id, (list, tuple)) else token_id
