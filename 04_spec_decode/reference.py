"""Rejection sampling, one request and one draft at a time — the oracle.

The algorithm ([Leviathan 2023]; [Chen 2023]). A drafter proposed tokens
d_1..d_k, each sampled from its distribution q_j; one target forward pass gave the target
distributions p_1..p_{k+1} at those positions. For j = 1..k:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j))       # test: u_j * q_j(d_j) < p_j(d_j)
    on the FIRST rejection emit a "recovered" token from
        norm(max(0, p_j - q_j))                                   # the mass p has and q lacks
    and stop (later drafts were conditioned on the rejected one: they are worthless).
    If all k are accepted, emit a "bonus" token from p_{k+1}: the target's forward pass
    already computed it, for free.

Why the output is distributed exactly as p_j: P(emit x) = q(x) min(1, p(x)/q(x))
+ P(reject) * residual(x) = min(q(x), p(x)) + (sum_y max(0, p(y) - q(y))) * max(0, p(x) - q(x))
/ sum_y max(0, p(y) - q(y)) = min(q, p)(x) + max(0, p - q)(x) = p(x).

Special cases, all the same algorithm:
* greedy requests (temperature 0): p is one-hot at argmax(logits), so "accept iff the
  draft equals the argmax" and the recovered token is the argmax;
* drafters without a distribution (n-gram lookup, greedy draft models, EAGLE with argmax):
  the draft is a deterministic function of the context, i.e. q is one-hot at the draft.
  Then min(1, p/q) = p(d) and max(0, p - q) is p with d's entry zeroed (vLLM's "ngram" path,
  draft_probs=None).

Conventions shared by every backend (so they agree token for token):
* accept iff q(d) > 0 and u * q(d) < p(d). Multiplication, not p/q: products are exact in
  every backend. Strict `<`: a token the target gives 0 (masked by top-k, say) is never
  accepted, even when u = 0 exactly. A draft its own q gives 0 is rejected (vLLM too).
* recovered token = argmax_v residual(v) * inv_exponential[req, v], first index on ties; if
  the residual is all zero (p == q up to rounding, and yet rejected), the race runs on p.
* output row: accepted drafts, then the recovered or bonus token, then PLACEHOLDER_TOKEN_ID.
"""
from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1     # vLLM: vllm/v1/sample/rejection_sampler.py


def race(weights: torch.Tensor, inv_exponential: torch.Tensor) -> int:
    """Sample from weights / sum(weights) by the exponential race: argmax w_v / E_v (first on ties)."""
    return int(torch.argmax(weights * inv_exponential))


def recover_token(p: torch.Tensor, q: torch.Tensor | None, draft: int, inv_exponential: torch.Tensor) -> int:
    """The token emitted at the first rejection: a sample from norm(max(0, p - q)).
    p, q, inv_exponential: [vocab]; q None = one-hot at `draft`."""
    ### BEGIN SOLUTION
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0                     # max(0, p - onehot(draft))
    else:
        residual = torch.clamp(p - q, min=0.0)
    if not bool((residual * inv_exponential).max() > 0):
        residual = p                              # only reachable through rounding: fall back to p
    return race(residual, inv_exponential)
    ### END SOLUTION


def rejection_sample_one(
    draft_token_ids: list[int],           # [k]
    draft_probs: torch.Tensor | None,     # [k, vocab] q_1..q_k, or None (q one-hot at the drafts)
    target_probs: torch.Tensor | None,    # [k, vocab] p_1..p_k (unused for greedy)
    target_argmax: torch.Tensor | None,   # [k] argmax of the raw target logits (greedy only)
    bonus_token_id: int,                  # already sampled from p_{k+1}
    is_greedy: bool,
    uniform: torch.Tensor,                # [k] U[0, 1)
    inv_exponential: torch.Tensor,        # [vocab]
) -> list[int]:                           # 1 .. k+1 tokens
    """One request: the accepted drafts, then one recovered or bonus token."""
    out: list[int] = []
    ### BEGIN SOLUTION
    for j, draft in enumerate(draft_token_ids):
        if is_greedy:
            best = int(target_argmax[j])
            if draft != best:
                out.append(best)                  # recovered = argmax p
                return out
        else:
            # fp32 scalars (not Python floats, which are doubles): the same rounding as every kernel.
            p = target_probs[j, draft]
            q = torch.ones((), dtype=torch.float32) if draft_probs is None else draft_probs[j, draft]
            if not (bool(q > 0) and bool(uniform[j] * q < p)):
                q_row = None if draft_probs is None else draft_probs[j]
                out.append(recover_token(target_probs[j], q_row, draft, inv_exponential))
                return out
        out.append(draft)                         # accepted
    out.append(bonus_token_id)                    # every draft accepted: the bonus token
    ### END SOLUTION
    return out


def rejection_sample(
    draft_token_ids: torch.Tensor,        # [num_draft_total] int
    cu_num_draft_tokens: torch.Tensor,    # [batch] int, inclusive cumsum
    draft_probs: torch.Tensor | None,     # [num_draft_total, vocab] fp32 or None
    target_probs: torch.Tensor | None,    # [num_draft_total, vocab] fp32 (None if every request is greedy)
    target_argmax: torch.Tensor | None,   # [num_draft_total] int (None if no request is greedy)
    bonus_token_ids: torch.Tensor,        # [batch] int
    is_greedy: torch.Tensor | None,       # [batch] bool, None = all random
    uniform_probs: torch.Tensor,          # [num_draft_total] fp32
    inv_exponential: torch.Tensor,        # [batch, vocab] fp32
    max_spec_len: int,
) -> torch.Tensor:                        # [batch, max_spec_len + 1] int32, PLACEHOLDER_TOKEN_ID-padded
    """The per-request loop over a flat ragged batch (same arguments as every backend)."""
    batch = bonus_token_ids.shape[0]
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    ends = cu_num_draft_tokens.tolist()
    for i in range(batch):
        s, e = (ends[i - 1] if i else 0), ends[i]
        tokens = rejection_sample_one(
            draft_token_ids[s:e].tolist(),
            None if draft_probs is None else draft_probs[s:e],
            None if target_probs is None else target_probs[s:e],
            None if target_argmax is None else target_argmax[s:e],
            int(bonus_token_ids[i]),
            bool(is_greedy[i]) if is_greedy is not None else False,
            uniform_probs[s:e],
            inv_exponential[i],
        )
        out[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    return out.to(bonus_token_ids.device)
