"""Chapter 01: PagedAttention — KV cache in fixed-size blocks, read through block tables.

    from paged_attention import ops        # backend dispatch: reference | torch | triton | cuda
    from paged_attention import compute_slot_mapping, make_block_tables, AttentionMetadata
    from paged_attention import cdiv       # ceil division: tokens -> blocks (every chapter)

Names are imported on first use (PEP 562): `cdiv` is imported by chapters 02 and 03, whose
block managers must not pay for importing torch. Triton and CUDA modules are imported lazily
by `ops`, so importing this package never imports triton (TRITON_INTERPRET must be set before
that happens).
"""
from __future__ import annotations

import importlib

from paged_attention.utils import cdiv

_EXPORTS = {
    "build_attention_metadata": "block_table", "compute_slot_mapping": "block_table",
    "make_block_tables": "block_table", "slot_mapping_for_request": "block_table",
    "AttentionMetadata": "metadata",
    "BACKENDS": "ops", "paged_decode_attention": "ops", "paged_prefill_attention": "ops",
    "reshape_and_cache": "ops",
}

__all__ = sorted([*_EXPORTS, "cdiv"])


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_attention' has no attribute {name!r}")
    return getattr(importlib.import_module(f"paged_attention.{module}"), name)


def __dir__() -> list[str]:
    return __all__
