"""The attention op of this chapter's models: the `attn` of chapter 01's LlamaDecoderLayer.

The EAGLE head (eagle.py) and the toy target (toy_model.py) are chapter 01's Llama layer — the very
class the engine's models are made of (paged_attention/model/llama.py) — built with this op:

* serving: K/V written through the slot mapping (chapter 01's `reshape_and_cache`) and read through
  the block tables, with the tree masks when the metadata carries them (`tree.paged_tree_attention`:
  a chain is the tree whose mask is causal). The engine's op (chapter 07's PagedAttention) reads the
  same cache with chapter 05's unified attention, which has no tree mask;
* training (`kv_cache is None`): no cache at all — the flat batch is whole sequences laid end to end
  (`CausalMetadata`), each attends causally to itself (SDPA); or equal windows run again and again on
  the head's own predictions (`UnrolledMetadata`, EAGLE-3's training-time test). Plain torch ops:
  autograd trains through it (train_eagle.py), and the same layer then serves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class UnrolledMetadata:
    """Training-time test ([EAGLE-3 2025]): B windows of T rows, the head run `step` = 1, 2, ... times,
    step j's input at row r being step j-1's prediction at row r-1 — what drafting feeds it. Each
    step's K/V are kept here (with their gradients) so that step j's row r attends to exactly what
    it would see when drafting token j: the rows with the target's real features up to r - j + 1,
    then one row per earlier step (step m's row r - j + m) and itself (`unrolled_mask`)."""
    num_windows: int
    window: int
    keys: list = field(default_factory=list)      # per step so far: [B, KVH, T, D]
    values: list = field(default_factory=list)


def unrolled_mask(window: int, step: int, device=None) -> torch.Tensor:   # [T, step * T] bool
    """Which keys of steps 1..`step` row r of step `step` sees (True = attend): step 1's (the real
    features) at columns <= r - step + 1, and step m's (m >= 2) at column r - step + m only."""
    r = torch.arange(window, device=device)[:, None]
    c = torch.arange(window, device=device)[None, :]
    return torch.cat([c <= r - step + 1] + [c == r - step + m for m in range(2, step + 1)], dim=1)


def unrolled_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: UnrolledMetadata,
                       scale: float) -> torch.Tensor:
    """query [B*T, H, D], key/value [B*T, KVH, D] of this step -> [B*T, H, D] (appends K/V to md)."""
    B, T = md.num_windows, md.window
    q, k, v = (t.view(B, T, t.shape[1], t.shape[2]).transpose(1, 2) for t in (query, key, value))  # [B, h, T, D]
    md.keys.append(k)
    md.values.append(v)
    mask = unrolled_mask(T, len(md.keys), query.device)
    o = F.scaled_dot_product_attention(q, torch.cat(md.keys, 2), torch.cat(md.values, 2), attn_mask=mask,
                                       scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return o.transpose(1, 2).reshape(B * T, query.shape[1], query.shape[2])


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
        if isinstance(md, UnrolledMetadata):
            return unrolled_attention(query, key, value, md, self.scale)
        if kv_cache is None:
            return causal_attention(query, key, value, md.query_start_loc, self.scale)
        key_cache, value_cache = kv_cache
        reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, check_values=False)
        return paged_tree_attention(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                    getattr(md, "tree_masks", None), self.scale)
