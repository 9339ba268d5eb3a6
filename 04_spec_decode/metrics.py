"""Acceptance metrics: how much speculation actually bought.

Mirrors vLLM's `vllm/v1/spec_decode/metrics.py: SpecDecodingStats` (and the formulas of
`SpecDecodingLogging.log`):

    acceptance rate        = accepted drafts / proposed drafts
    mean acceptance length = 1 + accepted drafts / verification steps
                             (tokens emitted per target forward, the bonus/recovered included)
    per-position rate[j]   = steps whose draft j was accepted / steps

With acceptance rate a per draft (independent), k drafts give an expected
(1 - a^(k+1)) / (1 - a) tokens per target pass [Leviathan 2023]: the quantity a
speed-up is made of, before the drafting cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0                  # verification steps that had drafts
    num_draft_tokens: int = 0            # drafts proposed (and verified)
    num_accepted_tokens: int = 0         # drafts accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        if num_spec_tokens <= 0:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification step: it had num_draft_tokens drafts, the first
        num_accepted_tokens of which were accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"need 0 <= accepted ({num_accepted_tokens}) <= drafts ({num_draft_tokens}) "
                             f"<= num_spec_tokens ({self.num_spec_tokens})")
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def observe_step(self, num_draft_tokens: Sequence[int], output_token_ids: Sequence[Sequence[int]]) -> None:
        """A whole batch: the scheduled draft counts and the rejection sampler's parsed output
        (accepted drafts + one token per request)."""
        for n, out in zip(num_draft_tokens, output_token_ids):
            if out:
                self.observe_draft(n, len(out) - 1)

    def merge(self, other: "SpecDecodingStats") -> "SpecDecodingStats":
        if other.num_spec_tokens != self.num_spec_tokens:
            raise ValueError("cannot merge stats of different num_spec_tokens")
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts + other.num_drafts,
                                 self.num_draft_tokens + other.num_draft_tokens,
                                 self.num_accepted_tokens + other.num_accepted_tokens,
                                 [a + b for a, b in zip(self.num_accepted_tokens_per_pos,
                                                        other.num_accepted_tokens_per_pos)])

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else float("nan") for n in self.num_accepted_tokens_per_pos]

    def __str__(self) -> str:
        rates = ", ".join(f"{r:.3f}" for r in self.per_position_acceptance_rate)
        return (f"acceptance rate {self.acceptance_rate:.3f}, mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"per position [{rates}] ({self.num_accepted_tokens}/{self.num_draft_tokens} drafts, "
                f"{self.num_drafts} steps)")


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens per target pass with k drafts accepted i.i.d. with prob a."""
    if acceptance_rate >= 1.0:
        return k + 1.0
    return (1 - acceptance_rate ** (k + 1)) / (1 - acceptance_rate)
