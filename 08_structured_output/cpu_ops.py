"""Backend "cpu": the token bitmask on the C++/OpenMP kernel (kernels_cpu/token_bitmask.py,
csrc/token_bitmask.cpp), the rung beside the reference, torch and Triton.

    from structured_output import cpu_ops
    cpu_ops.apply_token_bitmask_inplace(logits, bitmask, indices=None)
    cpu_ops.is_available()    # False (with unavailable_reason()) when no compiler / the build fails

vLLM on a CPU masks with xgrammar's C++ loop (vllm/v1/structured_output/utils.py:
apply_grammar_bitmask -> xgrammar's apply_token_bitmask_inplace_cpu); this is ours. Same
signature and the same argument checks (reference.check_bitmask_args) as every backend here; the
kernel then reads each mask word once and skips an all-allowed word (-1) with one compare, which
is what a permissive grammar state is made of. Logits whose columns are strided (a transposed
view) take the torch path, which handles any layout; the kernel needs unit column stride.
"""
from __future__ import annotations

import torch

from kernels_cpu import token_bitmask as cpu_token_bitmask
from structured_output import torch_ops
from structured_output.reference import IndicesLike, check_bitmask_args

__all__ = ["apply_token_bitmask_inplace", "is_available", "unavailable_reason"]


def is_available() -> bool:
    """True when the kernel is (or can be) built here. Builds it on the first call."""
    return cpu_token_bitmask.is_available()


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None when it can): no compiler, a failed build."""
    return cpu_token_bitmask.unavailable_reason()


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, indices: IndicesLike = None,
                                check_values: bool = True) -> None:
    rows = check_bitmask_args(logits, bitmask, indices, check_values)
    if logits.device.type != "cpu":
        raise ValueError(f"backend='cpu' is the C++ kernel for CPU tensors, got {logits.device}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        return torch_ops.apply_token_bitmask_inplace(logits, bitmask, rows, check_values=False)
    if bitmask.shape[1] > 1 and bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()                 # 32x smaller than the logits: a cheap copy
    cpu_token_bitmask.apply_token_bitmask_inplace(logits, bitmask, rows)
