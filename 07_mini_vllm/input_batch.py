"""From per-request bookkeeping to the flat tensors one model step reads.

Mirrors the input preparation of vLLM's model runner (vllm/v1/worker/gpu_model_runner.py:
`_prepare_inputs`, with the block table of vllm/v1/worker/block_table.py): the scheduler says,
for each request, how many of its tokens already have K/V in the cache (`num_computed_tokens`),
how many new tokens run this step, and which physical blocks the request owns. From that:

    query_start_loc = [0, q0, q0+q1, ...]                       # where each request's new tokens start
    positions[t]    = num_computed[r] + (t - query_start_loc[r])   for token t of request r
    slot_mapping[t] = block_table[r][positions[t] // B] * B + positions[t] % B
    seq_lens[r]     = num_computed[r] + q_r
    logits_indices  = query_start_loc[1:] - 1                   # the last new token of each request

All of it is computed with tensor ops over the whole batch (no loop over tokens), as vLLM does
with numpy, because this runs on the CPU before every step and must stay cheap next to the model.
Prefill, decode, chunked prefill and prefix-cache hits are all the same call with different numbers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor           # [T] int64: the new tokens of every request, end to end
    positions: torch.Tensor           # [T] int64: each token's position in its sequence
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor      # [num_reqs] int64: row of each request's last new token in the hidden states


def build_attention_metadata(num_computed_tokens: Sequence[int], num_new_tokens: Sequence[int],
                             block_ids: Sequence[Sequence[int]], block_size: int,
                             device: str | torch.device = "cpu") -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions [T] int64, AttentionMetadata) for one step. Block table rows are padded with 0, as in vLLM."""
    num_reqs = len(num_new_tokens)
    if not (len(num_computed_tokens) == len(block_ids) == num_reqs) or num_reqs == 0:
        raise ValueError(f"need one entry per request in num_computed_tokens ({len(num_computed_tokens)}), "
                         f"num_new_tokens ({num_reqs}) and block_ids ({len(block_ids)}), at least one request")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    computed = torch.tensor(num_computed_tokens, dtype=torch.int64)             # [R]
    query_lens = torch.tensor(num_new_tokens, dtype=torch.int64)                # [R]
    num_blocks = torch.tensor([len(b) for b in block_ids], dtype=torch.int64)   # [R]
    seq_lens = computed + query_lens                                            # [R]
    if int(query_lens.min()) < 1 or int(computed.min()) < 0:
        raise ValueError(f"need num_new_tokens >= 1 and num_computed_tokens >= 0, got {list(num_new_tokens)} "
                         f"and {list(num_computed_tokens)}")
    short = (num_blocks * block_size < seq_lens).nonzero().flatten().tolist()
    if short:
        r = short[0]
        raise ValueError(f"request {r} needs {int(seq_lens[r])} slots but its {int(num_blocks[r])} blocks of "
                         f"{block_size} hold {int(num_blocks[r]) * block_size}")
    ### BEGIN SOLUTION
    # Block table [R, max_blocks]: scatter every request's block ids into its row at once.
    block_tables = torch.zeros(num_reqs, max(1, int(num_blocks.max())), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(num_reqs), num_blocks)
    cols = torch.arange(int(num_blocks.sum())) - torch.repeat_interleave(torch.cumsum(num_blocks, 0) - num_blocks, num_blocks)
    block_tables[rows, cols] = torch.tensor([b for ids in block_ids for b in ids], dtype=torch.int64)

    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    num_tokens = int(query_start_loc[-1])
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), query_lens)                       # [T]
    positions = computed[req_of_token] + torch.arange(num_tokens) - query_start_loc[req_of_token]  # [T]
    slot_mapping = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size
    ### END SOLUTION
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return positions.to(device), metadata


def prepare_inputs(new_token_ids: Sequence[Sequence[int]], num_computed_tokens: Sequence[int],
                   block_ids: Sequence[Sequence[int]], block_size: int,
                   device: str | torch.device = "cpu") -> ModelInputs:
    """Everything one forward needs, for requests whose new tokens this step are `new_token_ids[r]`."""
    positions, metadata = build_attention_metadata(num_computed_tokens, [len(t) for t in new_token_ids],
                                                   block_ids, block_size, device)
    input_ids = torch.tensor([t for tokens in new_token_ids for t in tokens], dtype=torch.int64, device=device)
    logits_indices = (metadata.query_start_loc[1:] - 1).long()
    return ModelInputs(input_ids=input_ids, positions=positions, attn_metadata=metadata, logits_indices=logits_indices)
