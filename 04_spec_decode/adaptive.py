"""Adaptive draft length: turn speculation down, per request, where it does not pay.

Why: every draft costs twice — the drafter's work (nothing for n-gram lookup, one head or
draft-model pass for EAGLE / a draft model) and one more position in the target's
verification pass — and it only pays if it is accepted. Draft j is emitted only if drafts
1..j are all accepted; with a per-draft acceptance rate α (the i.i.d. model behind
(1 - α^(k+1)) / (1 - α) tokens per pass) that happens with probability α^j. So draft j is
worth proposing while

    α^j >= θ        θ = what one more draft costs, as a fraction of one target step

and the draft length worth proposing is k* = the largest j <= k with α^j >= θ. A request
whose drafts keep failing (α^1 < θ: a free-text request under n-gram lookup that keeps
finding stale matches, a weak EAGLE head on this kind of text) gets k* = 0: speculation is off
for it, for a cool-down of a few steps (doubling each time it fails again, up to a cap),
after which it probes again with one draft. A request whose drafts are accepted climbs back to k.

α is estimated per request from decayed counts, as the maximum-likelihood rate of a geometric
run with censoring: each verification step adds its accepted drafts to A and, if it stopped at
a rejection (fewer accepted than proposed), one rejection to R; α̂ = A / (A + R). The decay
forgets old steps (text changes character: a request quoting a document, then writing freely).
Steps without drafts (n-gram found no match) teach nothing and cost nothing.

vLLM: v1's `SpeculativeConfig.disable_by_batch_size` turns speculation off for the whole batch
above a number of running requests (the engine applies that one, `spec_decode_worker.py`); a
per-request draft length driven by acceptance is this module's own (the idea of dynamic draft
lengths is in the literature, e.g. "dynamic speculation lookahead"). Pure bookkeeping: it
never changes which tokens are emitted, only how many drafts a request is offered.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from spec_decode.proposer import check_num_speculative_tokens


@dataclass
class RequestAcceptance:
    accepted: float            # decayed count of accepted drafts (A)
    rejected: float            # decayed count of steps that ended at a rejection (R)
    cooldown: int = 0          # steps left with speculation off
    backoff: int = 0           # the next cool-down's length (0: none yet)

    @property
    def rate(self) -> float:
        """α̂ = A / (A + R)."""
        return self.accepted / (self.accepted + self.rejected)


class AdaptiveDraftLength:
    """Per-request draft length k* from the observed acceptance (see the module doc).

    num_speculative_tokens  k, the most drafts a request ever gets
    min_acceptance          θ: propose draft j only while α̂^j >= θ (the cost of a draft
                            relative to a target step; 0 = never turn down)
    decay                   weight of the past per verification step (0.8: ~5 steps of memory)
    prior_accepted          a new request starts as if it had this many accepted drafts and no
                            rejection: it begins at k and must earn its way down
    cooldown, max_cooldown  steps off after α̂ < θ; doubled at each further failure, capped
    """

    def __init__(self, num_speculative_tokens: int, min_acceptance: float, decay: float = 0.8,
                 prior_accepted: float = 1.0, cooldown: int = 4, max_cooldown: int = 64):
        self.k = check_num_speculative_tokens(num_speculative_tokens)
        if not 0.0 <= min_acceptance < 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1), got {min_acceptance!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        if prior_accepted <= 0 or cooldown < 1 or max_cooldown < cooldown:
            raise ValueError("need prior_accepted > 0 and 1 <= cooldown <= max_cooldown")
        self.min_acceptance = min_acceptance
        self.decay = decay
        self.prior_accepted = prior_accepted
        self.cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.requests: dict[str, RequestAcceptance] = {}

    def _state(self, req_id: str) -> RequestAcceptance:
        state = self.requests.get(req_id)
        if state is None:
            state = self.requests[req_id] = RequestAcceptance(self.prior_accepted, 0.0)
        return state

    def draft_length(self, rate: float) -> int:
        """k* = the largest j <= k with rate^j >= θ (0 when even one draft does not pay)."""
        if self.min_acceptance == 0.0 or rate >= 1.0:
            return self.k
        if rate <= 0.0 or rate < self.min_acceptance:
            return 0
        # rate^j >= θ  <=>  j <= log θ / log rate (both logs negative); the epsilon absorbs
        # rounding when rate^j == θ exactly.
        return min(self.k, int(math.log(self.min_acceptance) / math.log(rate) + 1e-9))

    def num_drafts(self, req_id: str) -> int:
        """How many drafts to propose for this request THIS step (call once per step: it also
        counts the cool-down down). A request coming out of its cool-down probes with one."""
        state = self._state(req_id)
        if state.cooldown > 0:
            state.cooldown -= 1
            return 1 if state.cooldown == 0 else 0
        k = self.draft_length(state.rate)
        if k == 0:
            state.backoff = min(self.max_cooldown, 2 * state.backoff) if state.backoff else self.cooldown
            state.cooldown = state.backoff
        return k

    def observe(self, req_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verification step of this request: it had num_draft_tokens drafts, the first
        num_accepted_tokens of which were accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"need 0 <= accepted ({num_accepted_tokens}) <= drafts ({num_draft_tokens})")
        if num_draft_tokens == 0:
            return
        state = self._state(req_id)
        state.accepted = self.decay * state.accepted + num_accepted_tokens
        state.rejected = self.decay * state.rejected + (num_accepted_tokens < num_draft_tokens)
        if self.draft_length(state.rate) > 0:
            state.backoff = 0                 # it pays again: the next failure starts a short cool-down

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)
