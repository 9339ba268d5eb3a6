"""The token bitmask vectorised in PyTorch (backend "torch"): the reference's result for the whole
batch in a few tensor ops, no Python loop over rows; runs on any device.

Where the reference shifts each word right by 0..31 and keeps the low bit, this ANDs each word
with the 32 one-bit masks 1 << k and compares with 0, which gives "forbidden" in two passes over
a [num_masks, words, 32] tensor (xgrammar's `torch_native` / `torch_compile` backends expand the
words with repeat_interleave and shift instead; same idea; gathering each token's word with an
index tensor was 5-10x slower on a CPU). Then one masked_fill_ over the logits:

* no indices: mask row i is logits row i, masked_fill_ them directly;
* indices: the forbidden tokens are summed into a [num_rows, vocab_size] count per logits row
  (index_add_), so a row named twice gets the union of what its masks forbid — a plain
  `logits[indices] = ...` would let one duplicate's write undo another's.

The cost is the expansion: an int32 and a bool per token of every mask row, where the kernels (Triton,
cpu) read each word once. `benchmarks/bench_token_bitmask.py` times it.
"""
from __future__ import annotations

import torch

from structured_output.reference import BITS, IndicesLike, check_bitmask_args

__all__ = ["apply_token_bitmask_inplace", "forbidden_tokens"]


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [num_masks, words] -> bool [num_masks, vocab_size], True = forbidden (the complement of
    reference.unpack_bitmask): each word ANDed with the 32 one-bit masks 1 << k at once."""
    num_masks, words = bitmask.shape
    one_bits = torch.ones(BITS, dtype=torch.int64, device=bitmask.device) << torch.arange(BITS, device=bitmask.device)
    one_bits = torch.where(one_bits >= 2 ** 31, one_bits - 2 ** 32, one_bits).to(torch.int32)   # 1 << 31 = INT_MIN
    forbidden = ((bitmask[:, :, None] & one_bits) == 0).view(num_masks, words * BITS)   # token order
    if words * BITS >= vocab_size:
        return forbidden[:, :vocab_size]
    past_mask = torch.ones(num_masks, vocab_size - words * BITS, dtype=torch.bool, device=bitmask.device)
    return torch.cat([forbidden, past_mask], dim=1)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, indices: IndicesLike = None,
                                check_values: bool = True) -> None:
    rows = check_bitmask_args(logits, bitmask, indices, check_values)
    num_rows, vocab_size = logits.shape
    if bitmask.shape[0] == 0 or vocab_size == 0:
        return
    forbidden = forbidden_tokens(bitmask, vocab_size)
    if rows is not None:
        hits = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=logits.device)
        forbidden = hits.index_add_(0, rows, forbidden.to(torch.int32)) > 0
    logits.masked_fill_(forbidden, float("-inf"))
