"""One dispatch point for chapter 08's token mask, in the project's backend vocabulary:

    "reference"  reference.py   unpack each mask row to one bool per token, masked_fill: the oracle
    "torch"      torch_ops.py   the same for the whole batch in a few tensor ops (runs anywhere)
    "triton"     triton_ops.py  a Triton kernel: a GPU, or CPU tensors under TRITON_INTERPRET=1
    "cpu"        cpu_ops.py     a C++/OpenMP kernel (kernels_cpu/token_bitmask.py): CPU tensors,
                                built on first use (needs a C++ compiler and ninja)

    apply_token_bitmask_inplace(logits, bitmask, indices=None, backend="torch")

logits [num_rows, vocab_size] fp32/bf16/fp16 (written in place), bitmask [num_masks,
ceil(vocab_size / 32)] int32 in vLLM's packed layout (token t allowed iff bit t % 32 of word
t // 32 is set), indices: the logits row of each mask row (None: row i <- mask row i). Every
disallowed logit becomes -inf, every other is left untouched; tokens past the mask's 32 * words
are disallowed. reference.py's docstring has the whole contract; every backend gives the same
bits. There is no "cuda" rung for this op: on a GPU the Triton kernel is it (xgrammar ships both;
vLLM picks whichever xgrammar picks).

vLLM: vllm/v1/structured_output/utils.py: apply_grammar_bitmask (the scatter of the structured
requests' rows, then xgrammar's apply_token_bitmask_inplace).
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from paged_attention.ops import check_kernel_backend

from structured_output.reference import IndicesLike

BACKENDS = ("reference", "torch", "triton", "cpu")
_MODULES = {
    "reference": "structured_output.reference",
    "torch": "structured_output.torch_ops",
    "triton": "structured_output.triton_ops",
    "cpu": "structured_output.cpu_ops",
}


def check_backend(backend: str, device: torch.device) -> None:
    """Fail loudly for a backend this machine (or these tensors) cannot run (chapter 01's checks)."""
    check_kernel_backend(backend, device, BACKENDS, "structured_output.cpu_ops", "the token bitmask")


def backend_module(backend: str, device: torch.device) -> ModuleType:
    """The module implementing `backend`, imported on first use (importing this module never
    imports triton: TRITON_INTERPRET must be set before that happens)."""
    check_backend(backend, device)
    return importlib.import_module(_MODULES[backend])


def apply_token_bitmask_inplace(
    logits: torch.Tensor,          # [num_rows, vocab_size] fp32/bf16/fp16 (written in place)
    bitmask: torch.Tensor,         # [num_masks, words] int32, words = ceil(vocab_size / 32)
    indices: IndicesLike = None,   # [num_masks] ints: logits row of each mask row (None: num_masks == num_rows)
    backend: str = "torch",
    *,
    check_values: bool = True,     # False: skip the range check of a device tensor of indices (a sync)
) -> None:
    device = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    backend_module(backend, device).apply_token_bitmask_inplace(logits, bitmask, indices, check_values)
