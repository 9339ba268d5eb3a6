"""Chapter 05: chunked prefill — long prompts split into chunks that share a step with decodes."""
from chunked_prefill.config import ChunkedPrefillConfig
from chunked_prefill.ops import build_attention_plan, unified_attention
from chunked_prefill.scheduler import ChunkedPrefillScheduler, PartialPrefillBudget

__all__ = ["build_attention_plan", "unified_attention", "ChunkedPrefillConfig", "ChunkedPrefillScheduler", "PartialPrefillBudget"]
