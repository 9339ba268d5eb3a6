"""PEFT making the adapters the LoRA tests load (chapter 09's tests and the engine's): one PeftModel holds
every adapter (PEFT's add_adapter, so the base model is in memory once), each saved to its own directory
exactly as a user's `save_pretrained` would write it."""
from __future__ import annotations

from pathlib import Path


def peft_model_with(hf_model, specs: dict[str, dict], init_lora_weights: bool = False):
    """A PeftModel over `hf_model` (wrapped in place) with one adapter per {name: LoraConfig kwargs};
    init_lora_weights=False: A and B random, so every adapter changes the output."""
    from peft import LoraConfig, get_peft_model

    peft_model = None
    for name, kwargs in specs.items():
        config = LoraConfig(init_lora_weights=init_lora_weights, **kwargs)
        if peft_model is None:
            peft_model = get_peft_model(hf_model, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    return peft_model


def save_each(peft_model, root: Path, names=None) -> dict[str, Path]:
    """Every adapter (or `names`) saved to root/<name>; returns {name: directory}."""
    dirs = {}
    for name in names or list(peft_model.peft_config):
        peft_model.save_pretrained(root, selected_adapters=[name])
        dirs[name] = root / name
    return dirs
