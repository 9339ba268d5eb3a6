"""The drafters' one interface, and the checks every drafter's output goes through.

Every proposer (n-gram lookup, a draft model, the LayerSkip self-draft, an EAGLE head)
answers the same question: given each running request's verified tokens, which k tokens
will it probably produce next? vLLM's proposers (vllm/v1/spec_decode/ngram_proposer.py,
draft_model.py, eagle.py) each take slightly different arguments; here one `DraftRequest`
per request carries all of them, and a proposer reads what it needs:

    token_ids      prompt + verified output, INCLUDING the token sampled this step
    hidden_states  (EAGLE only) the target's last hidden states for positions
                   [hidden_start, hidden_start + len) — the ones computed and accepted this step
    max_num_drafts at most this many drafts for this request (None: num_speculative_tokens) —
                   how an engine turns speculation down per request (spec_decode.adaptive)

The engine's flow (vLLM's, see README): after the target's step is sampled and verified,
`propose` runs, and its drafts go to `SpecDecodeScheduler.update_draft_token_ids`
(spec_decode/scheduler.py) so that the NEXT step schedules them as extra tokens
(`Request.spec_token_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass
class DraftRequest:
    req_id: str
    token_ids: Sequence[int]
    hidden_states: torch.Tensor | None = None   # [num_positions, hidden] (EAGLE)
    hidden_start: int = 0                       # position of hidden_states[0]
    max_num_drafts: int | None = None           # per-request cap on the drafts (None: k)


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Up to num_speculative_tokens draft ids per request (possibly none)."""
        ...

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        """Forget finished/aborted requests (free their draft KV blocks)."""
        ...


def check_num_speculative_tokens(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"num_speculative_tokens must be a positive int (k >= 1 drafts per step), got {k!r}")
    return k


def draft_budget(request: DraftRequest, num_speculative_tokens: int, max_model_len: int | None = None) -> int:
    """How many drafts `request` may get: k, the request's own cap, and never a draft at a
    position >= max_model_len (the verified tokens plus the drafts must fit)."""
    k = num_speculative_tokens
    if request.max_num_drafts is not None:
        k = min(k, request.max_num_drafts)
    if max_model_len is not None:
        k = min(k, max_model_len - len(request.token_ids))
    return max(0, k)


def validate_draft_token_ids(drafts: Sequence[Sequence[int]], vocab_size: int, max_drafts: int,
                             who: str = "drafter") -> list[list[int]]:
    """Every drafted id must be a token of the TARGET's vocabulary, and at most k per request.
    A drafter that breaks this (another tokenizer, a bug) fails loudly here, before its ids
    reach an embedding lookup or the rejection sampler."""
    out = []
    for i, d in enumerate(drafts):
        d = [int(t) for t in d]
        if len(d) > max_drafts:
            raise ValueError(f"{who} proposed {len(d)} tokens for request {i}, more than "
                             f"num_speculative_tokens={max_drafts}")
        bad = [t for t in d if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{who} proposed token ids {bad[:8]} for request {i}, outside the target's "
                             f"vocabulary [0, {vocab_size})")
        out.append(d)
    return out


def check_same_vocabulary(target_vocab_size: int, draft_vocab_size: int, target_tokenizer=None,
                          draft_tokenizer=None) -> None:
    """A draft model must speak the target's tokens: same vocabulary size, and — when the
    tokenizers are given — the same token -> id map and special tokens. (vLLM refuses a draft
    model whose vocab differs from the target's, unless a vocab mapping is configured.)"""
    if target_vocab_size != draft_vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft_vocab_size} tokens, the target's "
                         f"{target_vocab_size}: a draft model must use the target's tokenizer")
    if target_tokenizer is None or draft_tokenizer is None:
        return
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer maps tokens to different ids than the target's: "
                         "its drafts would be other words")
    for attr in ("eos_token_id", "bos_token_id"):
        a, b = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if a != b:
            raise ValueError(f"the draft tokenizer's {attr} is {b}, the target's {a}")
