"""Random but adversarial inputs for the rejection sampler (tests, notebook, benchmark).

A case is a ragged batch of requests with different numbers of drafts (0 included), a mix
of greedy and random requests, drafts actually sampled from q (so acceptance is neither
always nor never), and the corners every backend must agree on: target probabilities with
masked (zero) entries, drafts their own q gives zero, tied probabilities, and requests
whose residual max(0, p - q) is all zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RejectionCase:
    draft_token_ids: torch.Tensor        # [T] int64
    cu_num_draft_tokens: torch.Tensor    # [B] int32
    draft_probs: torch.Tensor | None     # [T, V] fp32
    target_probs: torch.Tensor | None    # [T, V] fp32
    target_argmax: torch.Tensor | None   # [T] int64
    bonus_token_ids: torch.Tensor        # [B] int64
    is_greedy: torch.Tensor | None       # [B] bool
    uniform_probs: torch.Tensor          # [T] fp32
    inv_exponential: torch.Tensor        # [B, V] fp32
    max_spec_len: int

    def args(self) -> tuple:
        """Positional arguments of every backend's rejection_sample."""
        return (self.draft_token_ids, self.cu_num_draft_tokens, self.draft_probs, self.target_probs,
                self.target_argmax, self.bonus_token_ids, self.is_greedy, self.uniform_probs,
                self.inv_exponential, self.max_spec_len)

    def to(self, device) -> "RejectionCase":
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t   # noqa: E731
        return RejectionCase(*(move(a) for a in self.args()))


def make_rejection_case(num_draft_tokens: list[int], vocab_size: int, *, greedy: list[bool] | None = None,
                        ngram: bool = False, seed: int = 0, extra_spec_len: int = 0) -> RejectionCase:
    """greedy: per request (None: all random). ngram: no draft_probs (q one-hot at the drafts)."""
    g = torch.Generator().manual_seed(seed)
    batch, total = len(num_draft_tokens), sum(num_draft_tokens)
    # q: peaky random rows; p: a mix of q and an independent row, so p(d)/q(d) straddles 1.
    q = torch.softmax(torch.randn(total, vocab_size, generator=g) * 2.0, dim=-1)
    other = torch.softmax(torch.randn(total, vocab_size, generator=g) * 2.0, dim=-1)
    mix = torch.rand(total, 1, generator=g)
    p = mix * q + (1 - mix) * other
    if vocab_size > 2 and total:
        # Masked target entries (top-k style zeros) on every third row, renormalised.
        masked = torch.rand(total, vocab_size, generator=g) < 0.3
        masked[1::3] = False
        masked[:, 0] = False
        p = p.masked_fill(masked, 0.0)
        p = p / p.sum(-1, keepdim=True)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0] if total else torch.zeros(0, dtype=torch.int64)
    if total >= 4 and vocab_size >= 3:
        # Row 3: q = p exactly and the draft has q(d) = p(d) = 0 -> rejected, residual all zero (fallback).
        q[3] = p[3]
        q[3, 1] = 0.0
        p[3, 1] = 0.0
        q[3] /= q[3].sum()
        p[3] = q[3]
        drafts[3] = 1
    if total >= 3 and vocab_size >= 2:
        p[2, :2] = 0.5 / vocab_size          # an exact tie inside the target row
    target_argmax = (p + 0.01 * torch.rand(total, vocab_size, generator=g)).argmax(-1)
    if total:
        # Greedy requests accept some drafts: make the argmax equal the draft on a third of rows.
        agree = torch.rand(total, generator=g) < 0.6
        target_argmax = torch.where(agree, drafts, target_argmax)
    is_greedy = None if greedy is None else torch.tensor(greedy, dtype=torch.bool)
    if is_greedy is not None and len(greedy) != batch:
        raise ValueError("greedy needs one flag per request")
    e = torch.empty(batch, vocab_size).exponential_(generator=g)
    return RejectionCase(
        draft_token_ids=drafts,
        cu_num_draft_tokens=torch.tensor(num_draft_tokens, dtype=torch.int64).cumsum(0).to(torch.int32),
        draft_probs=None if ngram else q,
        target_probs=p,
        target_argmax=target_argmax if greedy is not None and any(greedy) else None,
        bonus_token_ids=torch.randint(0, vocab_size, (batch,), generator=g),
        is_greedy=is_greedy,
        uniform_probs=torch.rand(total, generator=g),
        inv_exponential=e.clamp(min=torch.finfo(torch.float32).tiny).reciprocal(),
        max_spec_len=max(num_draft_tokens, default=0) + extra_spec_len,
    )
