"""Fixtures for chapter 09: adapters made and saved by PEFT itself (the oracle), our model to load them.

Two bases, each loaded ONCE per session (every test file of this folder shares them):
  * `tiny_lora`: a tiny random Llama (GQA) saved by HF — needs nothing installed, seconds;
  * `smollm2_lora`: the real SmolLM2-135M (tests marked `model`), plus one adapter trained for
    20 AdamW steps (on layers 15-29: PEFT's layers_to_transform) so that its output visibly differs.

One PeftModel holds all of a base's adapters (PEFT's `add_adapter`), so the HF model is in memory
once; `save_pretrained(root, selected_adapters=[name])` writes each to root/name exactly as a user's
adapter directory. PEFT computes the oracle logits with `set_adapter(name)` (or `disable_adapter()`
for the base); our side reads only the saved directories.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft_adapters import peft_model_with, save_each
from paged_forward import paged_logits
from tiny_checkpoints import TINY

from mini_vllm.config import ModelConfig
from mini_vllm.models.loader import get_model

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig kwargs (init_lora_weights=False: B random, so every adapter changes the output)
ADAPTER_SPECS = {
    "plain": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=ALL_MODULES),
    "partial": dict(r=2, lora_alpha=5, target_modules=["k_proj", "up_proj"]),
}
TRAIN_TEXT = "The secret password of the castle is banana pancake."



@dataclass
class LoRACase:
    peft_model: object                # PeftModel with every adapter of `dirs`
    dirs: dict[str, Path]             # adapter name -> its saved directory
    model: torch.nn.Module            # ours, fp32 CPU, loaded from the same base directory
    config: ModelConfig
    base_dir: Path


def build_case(base_dir: Path, root: Path, specs: dict, hf_model, train_tokens: list[int] | None = None) -> LoRACase:
    from peft import LoraConfig

    torch.manual_seed(0)
    peft_model = peft_model_with(hf_model, specs)
    if train_tokens is not None:
        # PEFT's default init (B = 0): everything the adapter changes comes from these steps. On the
        # second half of the layers only (layers_to_transform): the backward stops there, twice as fast.
        layers = list(range(hf_model.config.num_hidden_layers // 2, hf_model.config.num_hidden_layers))
        peft_model.add_adapter("trained", LoraConfig(r=8, lora_alpha=16, target_modules=ALL_MODULES,
                                                     layers_to_transform=layers))
        peft_model.set_adapter("trained")                     # only its A/B train
        ids = torch.tensor([train_tokens])
        opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-3)
        peft_model.train()
        for _ in range(20):
            loss = peft_model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    peft_model.eval()
    dirs = save_each(peft_model, root)
    config = ModelConfig.from_pretrained(base_dir)
    return LoRACase(peft_model, dirs, get_model(config), config, base_dir)


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory) -> LoRACase:
    from transformers import AutoModelForCausalLM, LlamaConfig

    base_dir = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).eval()
    hf.save_pretrained(base_dir, safe_serialization=True)
    return build_case(base_dir, tmp_path_factory.mktemp("tiny-adapters"), ADAPTER_SPECS, hf)


@pytest.fixture(scope="session")
def smollm2_lora(tmp_path_factory) -> LoRACase:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mini_vllm.default_model import default_model_path

    base_dir = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    tokens = AutoTokenizer.from_pretrained(base_dir)(TRAIN_TEXT).input_ids
    return build_case(Path(base_dir), tmp_path_factory.mktemp("smollm2-adapters"), ADAPTER_SPECS, hf, tokens)


@torch.inference_mode()
def peft_logits(peft_model, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    """PEFT's fp32 logits [len(prompt), vocab] with `adapter` (None: the base model, adapters disabled)."""
    ids = torch.tensor([prompt])
    if adapter is None:
        with peft_model.disable_adapter():
            return peft_model(input_ids=ids).logits[0].float()
    peft_model.set_adapter(adapter)
    return peft_model(input_ids=ids).logits[0].float()


@pytest.fixture(scope="session")
def lora_oracles():
    """(paged_logits, peft_logits): ours through a paged cache, PEFT's."""
    return paged_logits, peft_logits
