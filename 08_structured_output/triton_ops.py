"""The token bitmask as a Triton kernel (backend "triton"): on a GPU, or on CPU tensors under
TRITON_INTERPRET=1 (tests/conftest.py sets it), the same kernel either way.

vLLM hands the mask to xgrammar's `apply_token_bitmask_inplace`, whose GPU paths are a Triton and
a CUDA kernel (vllm/v1/structured_output/utils.py: apply_grammar_bitmask); this is the same job
written from the layout up:

* one program per (mask row, block of BLOCK_WORDS words): the block covers 32 * BLOCK_WORDS
  tokens of one logits row, so a 49k vocabulary is 48 programs per row at the default 32 words;
* it loads its words ONCE ([BLOCK_WORDS], the mask is 32x smaller than the logits), and shifts
  each by 0..31 to get a [BLOCK_WORDS, 32] tile of bits, token 32 w + k at (w, k);
* it stores -inf where a bit is 0 and nothing anywhere else (a masked store): allowed logits are
  never read or written, so the kernel moves 4 bytes per 32 tokens plus the -inf writes.
  Words past the mask load as 0 (forbidden); tokens past vocab_size are outside the store mask.

Indices (the logits row of each mask row) are read by the program; a repeated index is safe,
since programs only ever store the same value, -inf.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from structured_output.reference import IndicesLike, check_bitmask_args, num_words

__all__ = ["BLOCK_WORDS", "apply_token_bitmask_inplace"]

BLOCK_WORDS = 32          # words per program: 1024 tokens (GPU: 4 KB of fp32 logits; not tuned)


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, bitmask_ptr, indices_ptr,          # indices: int64 [num_masks], read when HAS_INDICES
    stride_l_row, stride_l_col, stride_m_row, stride_m_col,
    vocab_size, words,
    HAS_INDICES: tl.constexpr, BLOCK_WORDS: tl.constexpr,
):
    mask_row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    if HAS_INDICES:
        logits_row = tl.load(indices_ptr + mask_row)
    else:
        logits_row = mask_row
    ### BEGIN SOLUTION
    offs_w = block * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)                       # [W] word numbers
    word = tl.load(bitmask_ptr + mask_row * stride_m_row + offs_w * stride_m_col,
                   mask=offs_w < words, other=0)                                  # past the mask: forbidden
    bit_pos = tl.arange(0, 32)                                                     # [32]
    bit = (word[:, None] >> bit_pos[None, :]) & 1                                  # [W, 32]
    tokens = offs_w[:, None] * 32 + bit_pos[None, :]                               # [W, 32] token ids
    forbidden = (bit == 0) & (tokens < vocab_size)
    neg_inf = tl.full([BLOCK_WORDS, 32], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + logits_row * stride_l_row + tokens * stride_l_col, neg_inf, mask=forbidden)
    ### END SOLUTION


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, indices: IndicesLike = None,
                                check_values: bool = True) -> None:
    rows = check_bitmask_args(logits, bitmask, indices, check_values)
    num_masks = bitmask.shape[0]
    vocab_size = logits.shape[1]
    if num_masks == 0 or vocab_size == 0:
        return
    grid = (num_masks, triton.cdiv(num_words(vocab_size), BLOCK_WORDS))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, rows if rows is not None else bitmask,
        *logits.stride(), *bitmask.stride(),
        vocab_size, bitmask.shape[1],
        HAS_INDICES=rows is not None, BLOCK_WORDS=BLOCK_WORDS,
    )
