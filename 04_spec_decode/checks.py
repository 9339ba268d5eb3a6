"""Argument checks shared by every rejection-sampling backend.

Shapes, dtypes and devices are always checked (free). Values — draft ids in range,
cu_num_draft_tokens non-decreasing, probabilities finite — need a device read; the engine's
hot path passes check_values=False once its own bookkeeping is trusted.
"""
from __future__ import annotations

import torch


def check_rejection_args(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, target_argmax,
                         bonus_token_ids, is_greedy, uniform_probs, inv_exponential, max_spec_len,
                         check_values: bool = True) -> int:
    """Validate the rejection sampler's inputs; return the vocabulary size."""
    if draft_token_ids.dim() != 1:
        raise ValueError(f"draft_token_ids must be 1-D [num_draft_total], got {tuple(draft_token_ids.shape)}")
    if cu_num_draft_tokens.dim() != 1 or bonus_token_ids.dim() != 1:
        raise ValueError(f"cu_num_draft_tokens and bonus_token_ids must be 1-D [batch], got "
                         f"{tuple(cu_num_draft_tokens.shape)} and {tuple(bonus_token_ids.shape)}")
    batch, num_tokens = bonus_token_ids.shape[0], draft_token_ids.shape[0]
    if cu_num_draft_tokens.shape[0] != batch:
        raise ValueError(f"cu_num_draft_tokens has {cu_num_draft_tokens.shape[0]} entries for {batch} requests")
    for name, t in (("draft_token_ids", draft_token_ids), ("cu_num_draft_tokens", cu_num_draft_tokens),
                    ("bonus_token_ids", bonus_token_ids), ("target_argmax", target_argmax)):
        if t is not None and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if target_probs is None and (is_greedy is None or (check_values and not bool(is_greedy.all()))):
        raise ValueError("target_probs is needed unless every request is greedy")
    if is_greedy is not None and target_argmax is None and (not check_values or bool(is_greedy.any())):
        raise ValueError("target_argmax (argmax of the raw target logits) is needed for greedy requests")
    if is_greedy is not None and (is_greedy.dtype != torch.bool or is_greedy.shape != (batch,)):
        raise ValueError(f"is_greedy must be a bool tensor [batch={batch}], got {is_greedy.dtype} {tuple(is_greedy.shape)}")
    vocab = inv_exponential.shape[-1]
    for name, t, shape in (("draft_probs", draft_probs, (num_tokens, vocab)),
                           ("target_probs", target_probs, (num_tokens, vocab)),
                           ("inv_exponential", inv_exponential, (batch, vocab)),
                           ("uniform_probs", uniform_probs, (num_tokens,)),
                           ("target_argmax", target_argmax, (num_tokens,))):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (num_draft_total={num_tokens}, batch={batch}, "
                             f"vocab={vocab}), got {list(t.shape)}")
        if name != "target_argmax" and t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.device != bonus_token_ids.device:
            raise ValueError(f"{name} is on {t.device} but bonus_token_ids on {bonus_token_ids.device}")
    if not check_values:
        return vocab
    cu = cu_num_draft_tokens.long()
    num_draft = torch.diff(cu, prepend=cu.new_zeros(1))
    if batch and (int(num_draft.min()) < 0 or int(cu[-1]) != num_tokens):
        raise ValueError(f"cu_num_draft_tokens must be non-decreasing and end at num_draft_total={num_tokens}, "
                         f"got {cu.tolist()}")
    if batch and int(num_draft.max()) > max_spec_len:
        raise ValueError(f"a request has {int(num_draft.max())} drafts but max_spec_len={max_spec_len}")
    for name, ids in (("draft_token_ids", draft_token_ids), ("bonus_token_ids", bonus_token_ids),
                      ("target_argmax", target_argmax)):
        if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = ids[(ids < 0) | (ids >= vocab)].tolist()[:8]
            raise ValueError(f"{name} out of range [0, {vocab}): {bad} (a drafter proposing ids outside the "
                             "target's vocabulary?)")
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if t is not None and t.numel() and not bool(torch.isfinite(t).all() and (t >= 0).all()):
            raise FloatingPointError(f"{name} holds NaN, inf or negative entries")
    return vocab
