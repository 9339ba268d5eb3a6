"""The rejection-sampling dispatch: one signature, four backends.

    "reference"  per-request loop (reference.py) — the oracle
    "torch"      batched PyTorch over the ragged batch (rejection_sampler.py)
    "triton"     one Triton program per request (triton_ops.py; the interpreter on CPU)
    "cuda"       one CUDA thread block per request (kernels_cuda/rejection_sampler.cu, GPU only)

Triton and CUDA are imported lazily, so importing this module never imports triton.
"""
from __future__ import annotations

import torch

from spec_decode.checks import check_rejection_args

BACKENDS = ("reference", "torch", "triton", "cuda")


def rejection_sample(
    draft_token_ids: torch.Tensor,        # [num_draft_total] int
    cu_num_draft_tokens: torch.Tensor,    # [batch] int, inclusive cumsum
    draft_probs: torch.Tensor | None,     # [num_draft_total, vocab] fp32 or None (q one-hot)
    target_probs: torch.Tensor | None,    # [num_draft_total, vocab] fp32 (None if all greedy)
    target_argmax: torch.Tensor | None,   # [num_draft_total] int: argmax of RAW logits (None if none greedy)
    bonus_token_ids: torch.Tensor,        # [batch] int
    is_greedy: torch.Tensor | None,       # [batch] bool (None: all random)
    uniform_probs: torch.Tensor,          # [num_draft_total] fp32 U[0, 1)
    inv_exponential: torch.Tensor,        # [batch, vocab] fp32 1/E, E ~ Exp(1)
    max_spec_len: int,
    backend: str = "torch",
    check_values: bool = True,
) -> torch.Tensor:                        # [batch, max_spec_len + 1] int32, -1 padded
    check_rejection_args(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax,
                         bonus_token_ids, is_greedy, uniform_probs, inv_exponential, max_spec_len, check_values)
    args = (draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax, bonus_token_ids,
            is_greedy, uniform_probs, inv_exponential, max_spec_len)
    if backend == "reference":
        from spec_decode import reference
        return reference.rejection_sample(*args)
    if backend == "torch":
        from spec_decode.rejection_sampler import rejection_sample_torch
        return rejection_sample_torch(*args)
    if backend == "triton":
        from spec_decode import triton_ops
        return triton_ops.rejection_sample(*args)
    if backend == "cuda":
        from spec_decode import cuda_ops
        return cuda_ops.rejection_sample(*args)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
