"""PagedAttention vectorized in PyTorch (backend "torch"): the reference's maths for the
whole batch in a few tensor ops, no Python loop over requests or tokens.

* `reshape_and_cache`: one scatter (cache_ops.py).
* `paged_decode_attention`: gather every block of every request at once through the
  block tables, mask the positions past each seq_len, one softmax.
* `paged_prefill_attention`: the scatter, then causal attention over the ragged prompts
  padded into one [num_seqs, longest prompt] batch.

Same signatures as `reference.py` (the oracle they are tested against) and the kernel
backends. They read seq_lens / query_start_loc on the host to size the padded batch
(pass max_seq_len / max_query_len to skip that read). Any view of any input works:
indexing reads views, never raw storage.
"""
from __future__ import annotations

import torch

from paged_attention.cache_ops import reshape_and_cache
from paged_attention.checks import check_decode_args, check_prefill_args
from paged_attention.kv_quant import KVQuant, read_rows

__all__ = ["paged_decode_attention", "paged_prefill_attention", "reshape_and_cache"]


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int
    seq_lens: torch.Tensor,      # [num_seqs] int
    scale: float,
    check_values: bool = True,
    *,
    max_seq_len: int | None = None,   # host-side bound of seq_lens (AttentionMetadata.max_seq_len)
    kv_quant: KVQuant | None = None,  # an 8-bit cache: the gathered rows are dequantized (kv_quant.py)
) -> torch.Tensor:               # [num_seqs, num_heads, head_dim]
    """The whole ragged batch at once — gather every block, mask what is past seq_len.

    Positions past a request's seq_len (the unused tail of its last block, or whole
    padding entries of its block-table row) may hold anything, NaN included: their scores
    are masked to -inf and their values to 0 before they touch the result.
    """
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, check_values, max_seq_len, kv_quant)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, row = key_cache.shape
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return torch.empty_like(query)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_blocks = min(-(-max_seq_len // block_size), block_tables.shape[1])
    ### BEGIN SOLUTION
    seq_lens = seq_lens.long()
    used = torch.arange(max_blocks, device=query.device)[None, :] < (seq_lens[:, None] + block_size - 1) // block_size
    # Entries past a request's blocks are padding: point them at block 0 (never used as data).
    ids = torch.where(used, block_tables[:, :max_blocks].long(), 0)                 # [b, n_blk]
    k = key_cache[ids].reshape(num_seqs, max_blocks * block_size, num_kv_heads, row)   # [b, L, kvh, d (+ 4)]
    v = value_cache[ids].reshape(num_seqs, max_blocks * block_size, num_kv_heads, row)
    k = read_rows(k, kv_quant, "k", head_dim, query.dtype)                          # [b, L, kvh, d]
    v = read_rows(v, kv_quant, "v", head_dim, query.dtype)
    valid = torch.arange(max_blocks * block_size, device=query.device)[None, :] < seq_lens[:, None]  # [b, L]
    v = torch.where(valid[:, :, None, None], v.float(), 0.0)                        # junk * 0 would be NaN
    q = query.float().reshape(num_seqs, num_kv_heads, group, head_dim)              # [b, kvh, g, d]
    scores = torch.einsum("bkgd,blkd->bkgl", q, k.float()) * scale                  # [b, kvh, g, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~valid[:, None, None, :], 0.0)  # seq_len 0 -> 0
    out = torch.einsum("bkgl,blkd->bkgd", probs, v)                                 # [b, kvh, g, d]
    ### END SOLUTION
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]: the prompts back to back
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,      # (written)
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = don't cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int: cu_seqlens of the prompts
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # host-side bound of the prompt lengths
    kv_quant: KVQuant | None = None,    # an 8-bit cache: the write quantizes (the attention uses fresh K/V)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Write the prompts' K/V, then causal attention of every prompt over itself in one
    padded batch: prompt i's tokens are rows 0..len_i-1 of batch row i; padding rows and
    columns are masked (keys) or dropped (queries)."""
    check_prefill_args(query, key, value, key_cache, value_cache, slot_mapping, query_start_loc, check_values,
                       max_query_len, kv_quant)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=False,   # checked just above
                      kv_quant=kv_quant)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    starts = query_start_loc.long()
    lens = starts[1:] - starts[:-1]                                                  # [b]
    longest = int(lens.max()) if max_query_len is None else max_query_len
    ### BEGIN SOLUTION
    pos = torch.arange(longest, device=query.device)                                 # [L]
    valid = pos[None, :] < lens[:, None]                                             # [b, L] real tokens
    rows = torch.where(valid, starts[:-1, None] + pos[None, :], 0)                   # [b, L] token index (0: padding)
    q = query[rows].float().reshape(num_seqs, longest, num_kv_heads, group, head_dim)  # [b, L, kvh, g, d]
    k = key[rows].float()                                                            # [b, L, kvh, d]
    v = torch.where(valid[:, :, None, None], value[rows].float(), 0.0)
    scores = torch.einsum("bqkgd,blkd->bkgql", q, k) * scale                         # [b, kvh, g, L, L]
    visible = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]               # [b, L(q), L(k)] causal, real keys
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)            # an empty prompt's row is all NaN: dropped below, touches no other
    o = torch.einsum("bkgql,blkd->bqkgd", probs, v).reshape(num_seqs, longest, num_heads, head_dim)
    out[rows[valid]] = o[valid].to(query.dtype)
    ### END SOLUTION
    return out
