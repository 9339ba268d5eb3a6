"""The attention op of this chapter's models: the `attn` of chapter 01's LlamaDecoderLayer.

The EAGLE head (eagle.py) and the toy target (toy_model.py) are chapter 01's Llama layer — the very
class the engine's models are made of (paged_attention/model/llama.py) — built with this op:

* serving: K/V written through the slot mapping (chapter 01's `reshape_and_cache`) and read through
  the block tables, with the tree masks when the metadata carries them (`tree.paged_tree_attention`:
  a chain is the tree whose mask is causal). The engine's op (chapter 07's PagedAttention) reads the
  same cache with chapter 05's unified attention, which has no tree mask;
* training (`kv_cache is None`): no cache at all — the flat batch is whole sequences laid end to end
  (`CausalMetadata`), each attends causally to itself (SDPA). Plain torch ops: autograd trains
  through it (train_eagle.py), and the same layer then serves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paged_attention.cache_ops import reshape_and_cache
from spec_decode.tree import paged_tree_attention


@dataclass(frozen=True)
class CausalMetadata:
    """A flat batch of whole sequences, no cache (training): sequence i is rows
    query_start_loc[i] .. query_start_loc[i + 1]."""
    query_start_loc: torch.Tensor          # [num_seqs + 1] cu_seqlens

    @classmethod
    def equal_lengths(cls, num_seqs: int, seq_len: int) -> "CausalMetadata":
        return cls(torch.arange(0, num_seqs * seq_len + 1, seq_len))


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Each sequence of the flat batch attends causally to itself. query [T, H, D], key/value
    [T, KVH, D] -> [T, H, D]."""
    gqa = query.shape[1] != key.shape[1]
    out = []
    for s, e in zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist()):
        q, k, v = (t[s:e].transpose(0, 1) for t in (query, key, value))             # [heads, L, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out.append(o.transpose(0, 1))                                                # [L, H, D]
    return torch.cat(out)


class TreeAttention(nn.Module):
    """attn(query [T, H, D], key [T, KVH, D], value [T, KVH, D], kv_cache, attn_metadata) -> [T, H, D].

    kv_cache (key_cache, value_cache) with chapter 01's AttentionMetadata (+ `tree_masks`, optional:
    per request a [q_len, q_len] bool mask or None = causal): the paged serving path.
    kv_cache None with CausalMetadata: the training path (see the top)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache, attn_metadata):
        md = attn_metadata
        if kv_cache is None:
            return causal_attention(query, key, value, md.query_start_loc, self.scale)
        key_cache, value_cache = kv_cache
        reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, check_values=False)
        return paged_tree_attention(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                    getattr(md, "tree_masks", None), self.scale)
