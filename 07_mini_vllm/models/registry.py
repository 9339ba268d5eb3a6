"""Architecture name (config.json's "architectures") -> model class.

Mirrors vLLM's `vllm/model_executor/models/registry.py` (`_TEXT_GENERATION_MODELS`):
the table holds module and class *names* and imports lazily, so reading a config (which
only needs the list of supported names) never imports torch model code.
"""
from __future__ import annotations

import importlib

# architecture -> (module under mini_vllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    # Mistral 7B v0.2+ is a Llama with GQA (and no sliding window): vLLM maps it to the same class.
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"mini_vllm.models.{module_name}")
    return getattr(module, class_name)
