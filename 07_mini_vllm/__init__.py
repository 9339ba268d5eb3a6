"""Chapter 07: mini_vllm — the engine composed from chapters 01-05 (see README.md)."""
from mini_vllm.default_model import default_model_path
from mini_vllm.sampling_params import SamplingParams

__all__ = ["SamplingParams", "default_model_path"]
