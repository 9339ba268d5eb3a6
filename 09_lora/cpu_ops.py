"""Backend "cpu": multi-LoRA's shrink and expand on the C++/OpenMP kernels (kernels_cpu/lora_ops.py,
csrc/lora_ops.cpp), the rung beside the reference, torch and Triton.

    from lora import cpu_ops
    cpu_ops.lora_shrink(x, lora_a, token_lora, scale, out)
    cpu_ops.lora_expand(buffer, lora_b, token_lora, y, slice_offsets, slice_sizes, add_inputs=True)
    cpu_ops.is_available()    # False (with unavailable_reason()) when no compiler / the build fails

vLLM on a CPU runs these products as torch ops (vllm/lora/punica_wrapper/punica_cpu.py ->
vllm/lora/ops/torch_ops/lora_ops.py); this is the kernel behind ours. Same signatures and the
same argument checks (reference.check_shrink_args / check_expand_args) as every backend here;
then whatever the kernel cannot take as it is (strided adapters or buffers, an x or y whose
columns are strided) is made contiguous first — the adapters are normally contiguous already,
so the copies are the rare case. An `out` that is not contiguous is computed aside and copied in.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kernels_cpu import lora_ops as cpu_lora
from lora import torch_ops
from lora.reference import ScaleLike, TokenLoraLike, check_expand_args, check_shrink_args

__all__ = ["is_available", "lora_expand", "lora_shrink", "unavailable_reason"]


def is_available() -> bool:
    """True when the kernels are (or can be) built here. Builds them on the first call."""
    return cpu_lora.is_available()


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None when they can): no compiler, a failed build."""
    return cpu_lora.unavailable_reason()


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.shape[1] <= 1 or t.stride(1) == 1


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora: TokenLoraLike, scale: ScaleLike,
                out: torch.Tensor, check_values: bool = True) -> None:
    slots, scales = check_shrink_args(x, lora_a, token_lora, scale, out, check_values)
    if x.device.type != "cpu":
        raise ValueError(f"backend='cpu' is the C++ kernel for CPU tensors, got {x.device}")
    if not _rows_contiguous(x):
        x = x.contiguous()
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    cpu_lora.lora_shrink(x, lora_a.contiguous(), slots.contiguous(), scales, target)
    if target is not out:
        out.copy_(target)


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora: TokenLoraLike, y: torch.Tensor,
                slice_offsets: Sequence[int], slice_sizes: Sequence[int] | None = None, add_inputs: bool = True,
                check_values: bool = True) -> None:
    slots, offsets, sizes = check_expand_args(buffer, lora_b, token_lora, y, slice_offsets, slice_sizes, check_values)
    if y.device.type != "cpu":
        raise ValueError(f"backend='cpu' is the C++ kernel for CPU tensors, got {y.device}")
    if not _rows_contiguous(y):                  # the kernel writes rows of y in place: the torch path takes any view
        return torch_ops.lora_expand(buffer, lora_b, slots, y, offsets, sizes, add_inputs, check_values=False)
    cpu_lora.lora_expand(buffer.contiguous(), lora_b.contiguous(), slots.contiguous(), y,
                         torch.tensor(offsets, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64), add_inputs)
