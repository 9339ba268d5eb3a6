"""AttentionMetadata: everything an attention op needs to know about one batched step.

Why a dataclass passed explicitly: vLLM v1 builds one metadata object per step in the
model runner (`vllm/v1/attention/backends/*.py: *MetadataBuilder.build`) and hands it to
every layer. We pass it as an argument instead of through a module-level "forward
context", so a reader can see, at every call, which tensors the kernel reads.

One step = a flat batch of `num_tokens` new tokens from `num_seqs` requests, laid out
request after request (ragged, no padding):

    query_start_loc = [0, q0, q0+q1, ...]          # cu_seqlens of the new tokens
    seq_lens[i]     = context_len[i] + query_len[i] # KV length after this step
    block_tables[i] = physical block ids of request i, in logical order
    slot_mapping[t] = block_tables[req(t)][pos(t) // B] * B + pos(t) % B

Prefill (context 0), chunked prefill (context > 0, query > 1), decode (query 1) and
prefix-cache hits (context filled by someone else) are all the same shape of data.

`plan` is the one backend-specific field: whatever an attention backend precomputes ONCE
per step from the index tensors above (chapter 05's torch path: its sub-batches, token
index tensors and masks), so that the per-layer call only executes it. vLLM splits the
same way: the per-backend `AttentionMetadataBuilder.build` runs once per step and every
layer's `forward` reads its result. None means "nothing precomputed": the backend builds
what it needs itself, on every call. A backend checks that a plan matches the tensors it
is called with and refuses one built for another step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [num_tokens] int64: flat cache slot of each new token (-1: don't write)
    block_tables: torch.Tensor     # [num_seqs, max_blocks_per_seq] int32: physical block ids, row-padded
    seq_lens: torch.Tensor         # [num_seqs] int32: tokens of KV after this step (context + query)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cu_seqlens of the new tokens
    max_query_len: int             # max over i of query_len[i] (1 for a pure decode batch)
    max_seq_len: int               # max over i of seq_lens[i]
    plan: object | None = None     # a backend's per-step precomputation (see the module doc), or None

    def __post_init__(self):
        n = self.seq_lens.shape[0]
        if self.query_start_loc.shape != (n + 1,):
            raise ValueError(f"query_start_loc must have shape [{n + 1}] (num_seqs + 1), got {tuple(self.query_start_loc.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != n:
            raise ValueError(f"block_tables must have shape [{n}, max_blocks], got {tuple(self.block_tables.shape)}")
        if self.slot_mapping.dim() != 1:
            raise ValueError(f"slot_mapping must be 1-D [num_tokens], got {tuple(self.slot_mapping.shape)}")

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:      # [num_seqs]
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def context_lens(self) -> torch.Tensor:    # [num_seqs] tokens already in the cache before this step
        return self.seq_lens - self.query_lens

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
