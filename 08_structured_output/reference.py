"""The grammar's token mask applied to the logits, in plain PyTorch — the oracle every backend of
`apply_token_bitmask_inplace` is checked against (backend "reference").

Structured output ends every decode step the same way: the grammar (a regex automaton, a JSON
schema's pushdown automaton) says which tokens may come next, and every other token's logit
becomes -inf, so that no sampler — greedy, top-p, anything — can pick it. The grammar hands that
set over as a PACKED BITMASK, vLLM's and xgrammar's layout:

    bitmask: int32 [num_masks, words], words = ceil(vocab_size / 32)
    token t is allowed  <=>  bit (t % 32) of word (t // 32) is 1

32x smaller than one bool per token, which matters because the mask is built on the CPU for
every structured request at every step and copied to the GPU. int32 is signed: bit 31 is the
sign bit (token 31 allowed makes the word negative), and -1 (all bits set) allows all 32 tokens.

vLLM: `vllm/v1/structured_output/utils.py: apply_grammar_bitmask` scatters the structured
requests' mask rows to their logits rows (with speculative decoding a request owns several
consecutive rows: one per draft position) and calls xgrammar's `apply_token_bitmask_inplace`
(Triton / CUDA / C++ CPU kernels). Our op does both in one call:

    apply_token_bitmask_inplace(logits, bitmask, indices=None)
        logits  [num_rows, vocab_size] float32 / bfloat16 / float16, written in place
        bitmask [num_masks, words] int32
        indices None (num_masks == num_rows: row i gets mask row i), or num_masks ints: logits
                row indices[i] gets mask row i (the rows of the structured requests only). An
                index may repeat: that row gets every mask naming it (their intersection).

    * a disallowed token's logit becomes -inf; every other logit is left untouched, bit for bit;
    * tokens >= 32 * words (logits wider than the mask: a padded LM head) are disallowed — a
      token the grammar never heard of must not be sampled. (xgrammar, by default, leaves them
      alone and warns; that is the one place the two differ.)
    * mask bits past vocab_size (the last word's padding, or a wider mask) are ignored.

`pack_bitmask` / `unpack_bitmask` convert between the packed layout and one bool per token.
"""
from __future__ import annotations

from typing import Sequence

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = 32                           # tokens per mask word

IndicesLike = Sequence[int] | torch.Tensor | None


def num_words(vocab_size: int) -> int:
    """The words of one mask row covering vocab_size tokens: ceil(vocab_size / 32)."""
    return (vocab_size + BITS - 1) // BITS


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab_size] (True = allowed) -> int32 [rows, ceil(vocab_size / 32)], packed as
    above; the padding bits of the last word are 0."""
    if allowed.dim() != 2 or allowed.dtype != torch.bool:
        raise ValueError(f"pack_bitmask: allowed must be a bool [rows, vocab_size] tensor, got "
                         f"{allowed.dtype} {tuple(allowed.shape)}")
    rows, vocab_size = allowed.shape
    words = num_words(vocab_size)
    padded = torch.zeros(rows, words * BITS, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab_size] = allowed
    weights = torch.ones(BITS, dtype=torch.int64, device=allowed.device) << torch.arange(BITS, device=allowed.device)
    packed = (padded.view(rows, words, BITS) * weights).sum(-1)           # the unsigned word, in [0, 2^32)
    # As a signed int32: words with bit 31 set are negative (two's complement).
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, vocab_size], True = allowed. Tokens past 32 * words are
    not allowed; bits past vocab_size are dropped."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"unpack_bitmask: bitmask must be an int32 [rows, words] tensor, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    rows, words = bitmask.shape
    ### BEGIN SOLUTION
    # Shift every word right by 0..31 and keep the lowest bit: bits[r, w, k] is token 32 w + k.
    # (>> on int32 is an arithmetic shift, so bit 31 of a negative word still comes out as 1.)
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1                             # [rows, words, 32]
    allowed = bits.reshape(rows, words * BITS).bool()                      # token order
    if words * BITS >= vocab_size:
        return allowed[:, :vocab_size]                                     # drop the padding bits
    missing = torch.zeros(rows, vocab_size - words * BITS, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, missing], dim=1)                            # past the mask: disallowed
    ### END SOLUTION


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, indices: IndicesLike = None,
                       check_values: bool = True) -> torch.Tensor | None:
    """ValueError, naming the problem, for arguments no backend can apply; else the indices as an
    int64 tensor on the logits' device (None when there are none). check_values=False skips the
    range check of a device tensor of indices (a host sync), as chapter 01's ops do."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D [num_rows, vocab_size] tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype not in DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if not isinstance(bitmask, torch.Tensor) or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D [num_masks, words] int32 tensor, got "
                         f"{tuple(bitmask.shape) if isinstance(bitmask, torch.Tensor) else type(bitmask).__name__}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 (32 tokens per word, vLLM's packed layout), got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits are on {logits.device}: copy the mask first")
    num_rows, num_masks = logits.shape[0], bitmask.shape[0]
    if indices is None:
        if num_masks != num_rows:
            raise ValueError(f"bitmask has {num_masks} rows for {num_rows} logits rows: pass indices= to say "
                             "which logits row each mask row applies to")
        return None
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise ValueError(f"indices must be a 1-D integer tensor, got {indices.dtype} {tuple(indices.shape)}")
        rows = indices.to(device=logits.device, dtype=torch.int64).contiguous()
        known = indices.device.type == "cpu" or check_values
    else:
        values = list(indices)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
            raise ValueError(f"indices must be integers, got {values[:8]}")
        rows = torch.tensor(values, dtype=torch.int64, device=logits.device)
        known = True
    if rows.numel() != num_masks:
        raise ValueError(f"{rows.numel()} indices for {num_masks} bitmask rows: one logits row per mask row")
    if known and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise ValueError(f"indices must lie in [0, {num_rows}) (the logits rows), got "
                         f"min {int(rows.min())}, max {int(rows.max())}")
    return rows


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, indices: IndicesLike = None,
                                check_values: bool = True) -> None:
    """One mask row at a time: unpack it to one bool per token, -inf where False."""
    rows = check_bitmask_args(logits, bitmask, indices, check_values)
    targets = range(logits.shape[0]) if rows is None else rows.tolist()
    ### BEGIN SOLUTION
    allowed = unpack_bitmask(bitmask, logits.shape[1])                     # [num_masks, vocab_size]
    for i, row in enumerate(targets):
        # masked_fill_ writes only where the mask is True: allowed logits keep their exact bits,
        # and a row named twice is masked twice (the intersection of its masks).
        logits[row].masked_fill_(~allowed[i], float("-inf"))
    ### END SOLUTION
