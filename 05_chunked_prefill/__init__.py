"""Chapter 05: chunked prefill — long prompts split into chunks that share a step with decodes."""
from chunked_prefill.ops import unified_attention

__all__ = ["unified_attention"]
