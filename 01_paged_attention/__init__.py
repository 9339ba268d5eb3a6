"""Chapter 01: PagedAttention — KV cache in fixed-size blocks, read through block tables."""
from paged_attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
