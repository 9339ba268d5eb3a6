"""Structured output's token mask as a CPU kernel: logits[row] = -inf wherever the grammar's packed
bitmask has a 0 bit (csrc/token_bitmask.cpp).

vLLM applies the grammar's mask with xgrammar's `apply_token_bitmask_inplace`
(vllm/v1/structured_output/utils.py: apply_grammar_bitmask), which runs a C++ loop on CPU tensors;
this is ours, the "cpu" backend of chapter 08 (`structured_output/cpu_ops.py`, which checks the
arguments first -- this module is the raw entry).

Why: the PyTorch path expands the 32x-smaller mask to one element per token before it can
masked_fill; the kernel reads each int32 word once and skips an all-allowed word (-1) with one
compare, fills an all-forbidden word (0) with 32 stores, and walks only the forbidden bits of the
rest. Bit for bit the reference's result: it stores the dtype's -inf pattern and nothing else.

Build: like every kernel here (build.py), compiled on first use into torch's extension cache.
"""
from __future__ import annotations

import torch

from kernels_cpu import build

SOURCES = ("token_bitmask.cpp",)      # + vec.h (for the ISA name only)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load(isa: str | None = None):
    """The token bitmask extension for `isa` (default: this CPU's best; built on first use, build.py)."""
    return build.load_extension("cpu_token_bitmask", SOURCES, "CPU token bitmask kernel", isa)


def is_available() -> bool:
    """True when the kernel is (or can be) built here. Builds it on the first call."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why `load` fails here (None when it works)."""
    return build.unavailable_reason_of(load)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None,
                                isa: str | None = None) -> None:
    """logits [N, V] (unit column stride, written in place), bitmask [M, W] int32 (unit column stride),
    rows None (M == N) or int64 [M] contiguous: logits[rows[i], t] = -inf where bit t % 32 of
    bitmask[i, t // 32] is 0, and for every t >= 32 W."""
    load(isa).apply_token_bitmask_inplace(logits, bitmask, rows)
