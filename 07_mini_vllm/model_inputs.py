"""From per-request bookkeeping to the flat tensors one model step reads.

Mirrors the input preparation of vLLM's model runner (vllm/v1/worker/gpu_model_runner.py:
`_prepare_inputs`): the scheduler says, for each request, how many of its tokens already have
K/V in the cache (`num_computed_tokens`), which tokens run this step, and which physical blocks
the request owns. The attention half — block tables, slot mapping, seq_lens, query_start_loc —
is chapter 01's `build_attention_metadata`; this module adds what the *model* needs around it:

    input_ids       the new tokens of every request, end to end            [T]
    positions[t]    = num_computed[r] + (t - query_start_loc[r])           [T]  (RoPE angle of token t)
    logits_indices  = query_start_loc[1:] - 1                              [R]  (each request's last new token)

Prefill, decode, chunked prefill and prefix-cache hits are all the same call with different
numbers. Everything is whole-batch tensor ops (no loop over tokens): this runs on the CPU
before every step and must stay cheap next to the model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_attention.block_table import build_attention_metadata
from paged_attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor           # [T] int64: the new tokens of every request, end to end
    positions: torch.Tensor           # [T] int64: each token's position in its sequence
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor      # [num_reqs] int64: row of each request's last new token in the hidden states


def prepare_inputs(new_token_ids: Sequence[Sequence[int]], num_computed_tokens: Sequence[int],
                   block_ids: Sequence[Sequence[int]], block_size: int,
                   device: str | torch.device = "cpu") -> ModelInputs:
    """Everything one forward needs, for requests whose new tokens this step are `new_token_ids[r]`.

    block_ids[r]: request r's physical blocks in logical order, enough for
    num_computed_tokens[r] + len(new_token_ids[r]) tokens. Block table rows are padded with 0.
    """
    num_new = [len(t) for t in new_token_ids]
    if not num_new or min(num_new) < 1:
        raise ValueError(f"need at least one request and num_new_tokens >= 1 for each, got {num_new}")
    md = build_attention_metadata(block_ids, num_computed_tokens, num_new, block_size, device=device)
    ### BEGIN SOLUTION
    query_lens = md.query_lens.long()                                                  # [R]
    req_of_token = torch.repeat_interleave(torch.arange(len(num_new), device=md.seq_lens.device), query_lens)   # [T]
    starts = md.query_start_loc.long()
    positions = md.context_lens.long()[req_of_token] + torch.arange(md.num_tokens, device=starts.device) \
        - starts[req_of_token]                                                        # [T]
    logits_indices = starts[1:] - 1                                                    # [R]
    ### END SOLUTION
    input_ids = torch.tensor([t for tokens in new_token_ids for t in tokens], dtype=torch.int64, device=device)
    return ModelInputs(input_ids=input_ids, positions=positions, attn_metadata=md, logits_indices=logits_indices)
