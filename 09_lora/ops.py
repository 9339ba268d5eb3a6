"""One dispatch point for chapter 09's LoRA products, in the project's backend vocabulary:

    "reference"  reference.py   a loop over tokens and slices, one small matmul each: the oracle
    "torch"      torch_ops.py   batched: BGMV (a gather per token) for decode-sized batches,
                                SGMV (a matmul per adapter) above; runs anywhere
    "triton"     triton_ops.py  two Triton kernels over tiles of tokens sorted by adapter: a GPU,
                                or CPU tensors under TRITON_INTERPRET=1
    "cpu"        cpu_ops.py     C++/OpenMP kernels (kernels_cpu/lora_ops.py): CPU tensors, built on
                                first use (needs a C++ compiler and ninja)

    lora_shrink(x, lora_a, token_lora, scale, out, backend="torch")
    lora_expand(buffer, lora_b, token_lora, y, slice_offsets, slice_sizes=None, add_inputs=True, backend="torch")
    add_lora_linear(y, x, lora_a, lora_b, token_lora, scale, slice_sizes=None, backend="torch")

x [T, in], lora_a [num_slots, num_slices, max_rank, in] (x's dtype), token_lora [T] ints in
[-1, num_slots) (-1: no adapter), out / buffer [num_slices, T, max_rank] float32, lora_b
[num_slots, num_slices, max_out_slice, max_rank] (y's dtype), y [T, total_out] written in
place, slice s at columns [slice_offsets[s], + slice_sizes[s]). reference.py's docstring has
the whole contract; every backend computes in fp32 and gives the reference's numbers up to the
order of the sums. There is no "cuda" rung: on a GPU the Triton kernels are it (as in vLLM).

vLLM: vllm/lora/punica_wrapper/punica_gpu.py (add_shrink, add_expand, add_lora_linear over
vllm/lora/ops/triton_ops/lora_shrink_op.py, lora_expand_op.py) and punica_cpu.py (the same over
vllm/lora/ops/torch_ops/lora_ops.py).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Sequence

import torch

from paged_attention.ops import check_kernel_backend

from lora.reference import ScaleLike, Segments, TokenLoraLike, segments_from_token_lora

__all__ = ["BACKENDS", "Segments", "add_lora_linear", "backend_module", "check_backend", "lora_expand",
           "lora_shrink", "segments_from_token_lora"]

BACKENDS = ("reference", "torch", "triton", "cpu")
_MODULES = {
    "reference": "lora.reference",
    "torch": "lora.torch_ops",
    "triton": "lora.triton_ops",
    "cpu": "lora.cpu_ops",
}


def check_backend(backend: str, device: torch.device) -> None:
    """Fail loudly for a backend this machine (or these tensors) cannot run (chapter 01's checks)."""
    check_kernel_backend(backend, device, BACKENDS, "lora.cpu_ops", "the LoRA ops")


def backend_module(backend: str, device: torch.device) -> ModuleType:
    """The module implementing `backend`, imported on first use (importing this module never
    imports triton: TRITON_INTERPRET must be set before that happens)."""
    check_backend(backend, device)
    return importlib.import_module(_MODULES[backend])


def _device(t) -> torch.device:
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")


def lora_shrink(
    x: torch.Tensor,                 # [T, in] fp32/bf16/fp16
    lora_a: torch.Tensor,            # [num_slots, num_slices, max_rank, in], x's dtype
    token_lora: TokenLoraLike,       # [T] ints in [-1, num_slots): each token's adapter slot
    scale: ScaleLike,                # alpha / r: one float, or one per slot
    out: torch.Tensor,               # [num_slices, T, max_rank] fp32 (written, zeros for -1)
    backend: str = "torch",
    *,
    check_values: bool = True,       # False: skip the range check of a device tensor of slots (a sync)
) -> None:
    backend_module(backend, _device(x)).lora_shrink(x, lora_a, token_lora, scale, out, check_values)


def lora_expand(
    buffer: torch.Tensor,            # [num_slices, T, max_rank] fp32 (lora_shrink's out)
    lora_b: torch.Tensor,            # [num_slots, num_slices, max_out_slice, max_rank], y's dtype
    token_lora: TokenLoraLike,       # [T] ints in [-1, num_slots)
    y: torch.Tensor,                 # [T, total_out] fp32/bf16/fp16, written in place
    slice_offsets: Sequence[int],    # first column of each slice in y
    slice_sizes: Sequence[int] | None = None,   # width of each slice (None: max_out_slice each)
    add_inputs: bool = True,         # y += (False: y =) on the tokens with an adapter; -1 untouched
    backend: str = "torch",
    *,
    check_values: bool = True,
) -> None:
    backend_module(backend, _device(y)).lora_expand(buffer, lora_b, token_lora, y, slice_offsets, slice_sizes,
                                                    add_inputs, check_values)


def add_lora_linear(
    y: torch.Tensor,                 # [T, total_out]: the base layer's output, the LoRA part added in place
    x: torch.Tensor,                 # [T, in]: the layer's input
    lora_a: torch.Tensor,            # [num_slots, num_slices, max_rank, in]
    lora_b: torch.Tensor,            # [num_slots, num_slices, max_out_slice, max_rank]
    token_lora: TokenLoraLike,
    scale: ScaleLike,
    slice_sizes: Sequence[int] | None = None,   # slices side by side from column 0 (None: max_out_slice each)
    backend: str = "torch",
) -> None:
    """y[t] += scale_i * (x[t] A_i^T) B_i^T slice by slice: shrink into a float32 buffer, then expand
    (punica_wrapper's add_lora_linear). The base product x W^T is the caller's, already in y."""
    num_slices, max_out, max_rank = lora_b.shape[1], lora_b.shape[2], lora_b.shape[3]
    sizes = list(slice_sizes) if slice_sizes is not None else [max_out] * num_slices
    offsets = [sum(sizes[:s]) for s in range(num_slices)]
    buffer = torch.empty(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    lora_shrink(x, lora_a, token_lora, scale, buffer, backend)
    lora_expand(buffer, lora_b, token_lora, y, offsets, sizes, True, backend)
