"""Chapter 01: PagedAttention — KV cache in fixed-size blocks, read through block tables.

    from paged_attention import ops        # backend dispatch: reference | torch | triton | cuda
    from paged_attention import compute_slot_mapping, make_block_tables, AttentionMetadata

Triton and CUDA modules are imported lazily by `ops`, so importing this package never
imports triton (TRITON_INTERPRET must be set before that happens).
"""
from paged_attention.block_table import (
    build_attention_metadata,
    compute_slot_mapping,
    make_block_tables,
    slot_mapping_for_request,
)
from paged_attention.metadata import AttentionMetadata
from paged_attention.ops import BACKENDS, paged_decode_attention, paged_prefill_attention, reshape_and_cache

__all__ = [
    "AttentionMetadata",
    "BACKENDS",
    "build_attention_metadata",
    "compute_slot_mapping",
    "make_block_tables",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "slot_mapping_for_request",
]
