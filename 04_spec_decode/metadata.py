"""SpecDecodeMetadata: where the drafts sit in one step's flat batch, and which logits rows
verify them.

Mirrors vLLM's `vllm/v1/spec_decode/metadata.py: SpecDecodeMetadata` and the model runner's
`GPUModelRunner._calc_spec_decode_metadata` (vllm/v1/worker/gpu_model_runner.py).

Why drafts need no special batch: a request with k drafts is scheduled k + 1 tokens ([Kwon 2025,
Table 4.1]: Δ = 1 + L_draft). They are laid out in the flat batch like any other tokens:

    request i's scheduled tokens:  [ t_last | d_1 | d_2 | ... | d_k ]
    logits at those k + 1 positions:  p_1    p_2   p_3  ...   p_{k+1}

The logits at t_last verify d_1, at d_1 verify d_2, ..., and the logits at d_k give the
"bonus" token if every draft is accepted. So the model runner computes logits only at the
last num_draft_tokens + 1 positions of each request (`logits_indices`, into the flat
hidden states), and splits those rows into the `target_logits_indices` (rows that verify a
draft) and the `bonus_logits_indices` (one per request). Both index the LOGITS tensor, not
the flat batch, exactly as in vLLM.

Worked example (the one vLLM's docstring uses):
    num_scheduled_tokens = [4, 100, 3, 100, 2], num_draft_tokens = [3, 0, 2, 0, 1]
    logits_indices        = [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    target_logits_indices = [0, 1, 2, 5, 6, 9]
    bonus_logits_indices  = [3, 4, 7, 8, 10]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


@dataclass
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor        # [num_draft_total] int32: every request's drafts, back to back
    num_draft_tokens: list[int]          # [batch] drafts per request (0: no drafts, just a bonus/normal sample)
    cu_num_draft_tokens: torch.Tensor    # [batch] int32: inclusive cumsum of num_draft_tokens
    cu_num_sampled_tokens: torch.Tensor  # [batch] int32: inclusive cumsum of num_draft_tokens + 1
    target_logits_indices: torch.Tensor  # [num_draft_total] int32: rows of `logits` that verify a draft
    bonus_logits_indices: torch.Tensor   # [batch] int32: the row of `logits` for each request's bonus token
    logits_indices: torch.Tensor         # [num_draft_total + batch] int32: rows of the flat hidden states

    def __post_init__(self):
        b = len(self.num_draft_tokens)
        n = sum(self.num_draft_tokens)
        if any(k < 0 for k in self.num_draft_tokens):
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        expect = {"draft_token_ids": (n,), "cu_num_draft_tokens": (b,), "cu_num_sampled_tokens": (b,),
                  "target_logits_indices": (n,), "bonus_logits_indices": (b,), "logits_indices": (n + b,)}
        for name, shape in expect.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"SpecDecodeMetadata.{name} must have shape {list(shape)} for num_draft_tokens="
                                 f"{self.num_draft_tokens}, got {list(getattr(self, name).shape)}")

    @property
    def max_spec_len(self) -> int:
        return max(self.num_draft_tokens, default=0)

    @property
    def batch_size(self) -> int:
        return len(self.num_draft_tokens)

    @classmethod
    def from_draft_token_ids(cls, draft_token_ids: Sequence[Sequence[int]],
                             device: torch.device | str = "cpu") -> "SpecDecodeMetadata":
        """Metadata for a batch where each request's scheduled tokens are exactly its last
        verified token + its drafts (a pure speculative decode step). Tests and benchmarks."""
        num_draft = [len(d) for d in draft_token_ids]
        cu_scheduled = torch.cumsum(torch.tensor([k + 1 for k in num_draft], dtype=torch.int64), 0).tolist()
        # input_ids of that batch: [last token (unknown here: 0), d_1..d_k] per request; only drafts are read.
        input_ids = torch.tensor([t for d in draft_token_ids for t in [0, *d]], dtype=torch.int64)
        return calc_spec_decode_metadata(num_draft, cu_scheduled, input_ids, device=device)


def calc_spec_decode_metadata(
    num_draft_tokens: Sequence[int],          # [batch] drafts scheduled per request
    cu_num_scheduled_tokens: Sequence[int],   # [batch] inclusive cumsum of every request's scheduled tokens
    input_ids: torch.Tensor,                  # [num_tokens] the step's flat input ids (drafts included)
    device: torch.device | str | None = None,
) -> SpecDecodeMetadata:
    """Index arithmetic of one speculative step (vLLM: `_calc_spec_decode_metadata`).

    A request's sampled positions are its LAST num_draft + 1 scheduled tokens, so this works
    for any mix of decodes with drafts, decodes without, and prefill chunks (0 drafts).
    """
    num_draft = [int(k) for k in num_draft_tokens]
    cu_sched = [int(c) for c in cu_num_scheduled_tokens]
    if len(num_draft) != len(cu_sched):
        raise ValueError(f"num_draft_tokens ({len(num_draft)}) and cu_num_scheduled_tokens ({len(cu_sched)}) "
                         "need one entry per request")
    prev = 0
    for i, (k, c) in enumerate(zip(num_draft, cu_sched)):
        if k < 0:
            raise ValueError(f"request {i}: num_draft_tokens must be >= 0, got {k}")
        if c - prev < k + 1:
            raise ValueError(f"request {i}: {k} drafts need at least {k + 1} scheduled tokens, got {c - prev}")
        prev = c
    if cu_sched and input_ids.shape[0] < cu_sched[-1]:
        raise ValueError(f"input_ids has {input_ids.shape[0]} tokens but {cu_sched[-1]} are scheduled")
    device = input_ids.device if device is None else device
    ### BEGIN SOLUTION
    num_draft_t = torch.tensor(num_draft, dtype=torch.int64)                   # [b]
    num_sampled = num_draft_t + 1                                              # [b]
    cu_num_sampled = torch.cumsum(num_sampled, 0)                              # [b]
    cu_num_draft = torch.cumsum(num_draft_t, 0)                                # [b]
    total_sampled = int(cu_num_sampled[-1]) if num_draft else 0
    # For each sampled row r of request i: its offset inside the request's sampled block.
    req_of_row = torch.repeat_interleave(torch.arange(len(num_draft)), num_sampled)     # [n + b]
    offset_in_req = torch.arange(total_sampled) - (cu_num_sampled - num_sampled)[req_of_row]
    # logits_indices: the last num_sampled positions of each request in the flat batch.
    cu_sched_t = torch.tensor(cu_sched, dtype=torch.int64)
    logits_indices = (cu_sched_t - num_sampled)[req_of_row] + offset_in_req   # [n + b]
    # Rows of `logits` that verify drafts: every sampled row but each request's last one.
    is_bonus = offset_in_req == num_draft_t[req_of_row]                       # [n + b]
    rows = torch.arange(total_sampled)
    target_logits_indices = rows[~is_bonus]                                    # [n]
    bonus_logits_indices = cu_num_sampled - 1                                  # [b]
    # The draft verified by row r is the input token one position later in the flat batch.
    draft_token_ids = input_ids.cpu()[logits_indices[target_logits_indices] + 1]   # [n]
    ### END SOLUTION
    i32 = dict(dtype=torch.int32, device=device)
    return SpecDecodeMetadata(
        draft_token_ids=draft_token_ids.to(**i32),
        num_draft_tokens=num_draft,
        cu_num_draft_tokens=cu_num_draft.to(**i32),
        cu_num_sampled_tokens=cu_num_sampled.to(**i32),
        target_logits_indices=target_logits_indices.to(**i32),
        bonus_logits_indices=bonus_logits_indices.to(**i32),
        logits_indices=logits_indices.to(**i32),
    )


def spec_decode_metadata_from_scheduler_output(
    req_ids: Sequence[str],                                # the batch order of the model runner
    num_scheduled_tokens: Mapping[str, int],               # SchedulerOutput.num_scheduled_tokens
    scheduled_spec_decode_tokens: Mapping[str, Sequence[int]],   # SchedulerOutput.scheduled_spec_decode_tokens
    input_ids: torch.Tensor,                               # [num_tokens] flat, requests in req_ids order
    device: torch.device | str | None = None,
) -> SpecDecodeMetadata:
    """The model runner's entry point: chapter 03's SchedulerOutput (its
    scheduled_spec_decode_tokens filled by this chapter's SpecDecodeScheduler) -> SpecDecodeMetadata.

    The drafts are already part of each request's scheduled tokens (the scheduler counts them
    in Δ), so the flat batch needs no change; this only says which rows to verify. Checks that
    the input ids really end with the drafts the scheduler scheduled (a misaligned batch would
    verify the wrong tokens silently).
    """
    missing = [r for r in req_ids if r not in num_scheduled_tokens]
    if missing:
        raise ValueError(f"requests {missing} are in the batch but not in num_scheduled_tokens")
    unknown = [r for r in scheduled_spec_decode_tokens if r not in set(req_ids)]
    if unknown:
        raise ValueError(f"drafts scheduled for requests {unknown} that are not in the batch")
    num_draft = [len(scheduled_spec_decode_tokens.get(r, ())) for r in req_ids]
    cu, total = [], 0
    for r in req_ids:
        total += int(num_scheduled_tokens[r])
        cu.append(total)
    md = calc_spec_decode_metadata(num_draft, cu, input_ids, device)
    expected = [t for r in req_ids for t in scheduled_spec_decode_tokens.get(r, ())]
    if md.draft_token_ids.tolist() != expected:
        raise ValueError("input_ids do not end each request's tokens with its scheduled drafts: "
                         f"found {md.draft_token_ids.tolist()}, scheduled {expected}")
    return md
