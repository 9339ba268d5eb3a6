"""Chapter 07: mini_vllm — the engine composed from chapters 01-06 (see README.md).

    from mini_vllm import LLM, SamplingParams
    LLM().generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16))

`import mini_vllm` stays light: the engine classes (which import torch models, transformers and
the chapters) are loaded on first use of their names.
"""
from mini_vllm.default_model import default_model_path
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams

_LAZY = {
    "LLM": "mini_vllm.llm",
    "LLMEngine": "mini_vllm.llm_engine",
    "EngineConfig": "mini_vllm.engine_config",
    "RequestOutput": "mini_vllm.outputs",
    "CompletionOutput": "mini_vllm.outputs",
    "RequestMetrics": "mini_vllm.outputs",
    "Logprob": "mini_vllm.outputs",
    "BeamSearchParams": "mini_vllm.beam_search",
    "BeamSearchOutput": "mini_vllm.beam_search",
    "BeamSearchSequence": "mini_vllm.beam_search",
    "LoRARequest": "mini_vllm.lora_request",
}

__all__ = ["SamplingParams", "RequestOutputKind", "default_model_path", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mini_vllm' has no attribute {name!r}")
