"""Models written from scratch on paged attention: Llama family, Qwen2, Qwen3 (see registry.py)."""
from mini_vllm.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class"]
