"""Rejection sampling as one Triton program per request.

In the spirit of vLLM's `rejection_greedy_sample_kernel`, `rejection_random_sample_kernel`
and `sample_recovered_tokens_kernel` (vllm/v1/sample/rejection_sampler.py), fused into one
kernel with a different split of the work:

* vLLM computes a recovered token for EVERY draft position (a grid of batch x max_spec_len
  programs, each a vocab-wide pass), then a per-request kernel walks the accept tests.
* Here one program per request does the accept tests for all its drafts at once (they are
  O(1) each: one gathered p(d), q(d), u), finds the first rejection with a min-reduction,
  and only then makes ONE vocab-wide pass — for the single recovered token that is kept.
  Per request: O(k + V) memory traffic instead of O(k * V).

The vocab pass keeps a running (max, argmax) over tiles of BLOCK_V, updating only on a
strictly larger tile max, so ties go to the smallest index (as torch.argmax). It races
max(0, p - q) * (1/E) and, at the same time, p * (1/E) for the all-zero-residual fallback.

Same inputs and outputs as `reference.rejection_sample` (see the conventions there).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spec_decode.reference import PLACEHOLDER_TOKEN_ID

DEFAULT_BLOCK_V = 1024
PLACEHOLDER = tl.constexpr(PLACEHOLDER_TOKEN_ID)


@triton.jit
def _rejection_sample_kernel(
    out_ptr,                # [batch, out_stride] int32
    cu_num_draft_ptr,       # [batch] int32 inclusive cumsum
    draft_ptr,              # [T] int32
    draft_probs_ptr,        # [T, vocab] fp32 (read only if not NO_DRAFT_PROBS)
    target_probs_ptr,       # [T, vocab] fp32 (read only if HAS_RANDOM)
    target_argmax_ptr,      # [T] int32 (read only if HAS_GREEDY)
    bonus_ptr,              # [batch] int32
    is_greedy_ptr,          # [batch] int8 (read only if HAS_GREEDY)
    uniform_ptr,            # [T] fp32
    inv_exp_ptr,            # [batch, vocab] fp32
    vocab_size,
    out_stride,             # max_spec_len + 1
    NO_DRAFT_PROBS: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    HAS_RANDOM: tl.constexpr,
    BLOCK_S: tl.constexpr,      # power of 2 >= max_spec_len + 1
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    end = tl.load(cu_num_draft_ptr + req)
    start = tl.load(cu_num_draft_ptr + req - 1, mask=req > 0, other=0)
    n = end - start
    offs = tl.arange(0, BLOCK_S)
    valid = offs < n
    draft = tl.load(draft_ptr + start + offs, mask=valid, other=0)                 # [BLOCK_S]
    rows = (start + offs).to(tl.int64)

    ### BEGIN SOLUTION
    # 1. Accept tests of all drafts at once.
    if HAS_GREEDY:
        greedy = tl.load(is_greedy_ptr + req) != 0
        best_target = tl.load(target_argmax_ptr + rows, mask=valid, other=-1)
        accept_greedy = draft == best_target
    if HAS_RANDOM:
        p_d = tl.load(target_probs_ptr + rows * vocab_size + draft, mask=valid, other=0.0)
        if NO_DRAFT_PROBS:
            q_d = tl.full([BLOCK_S], 1.0, tl.float32)
        else:
            q_d = tl.load(draft_probs_ptr + rows * vocab_size + draft, mask=valid, other=0.0)
        u = tl.load(uniform_ptr + start + offs, mask=valid, other=1.0)
        accept_random = (q_d > 0) & (u * q_d < p_d)
    if HAS_GREEDY and HAS_RANDOM:
        accept = tl.where(greedy, accept_greedy, accept_random)
    elif HAS_GREEDY:
        accept = accept_greedy
    else:
        accept = accept_random
    # 2. First rejection (n if none).
    num_accepted = tl.min(tl.where(valid & (accept == 0), offs, BLOCK_S), axis=0)
    num_accepted = tl.minimum(num_accepted, n)

    # 3. The token after the accepted drafts: bonus, or the recovered token.
    token = tl.load(bonus_ptr + req)
    if num_accepted < n:
        row = (start + num_accepted).to(tl.int64)
        if HAS_GREEDY:
            if greedy:
                token = tl.load(target_argmax_ptr + row)
        if HAS_RANDOM:
            run_race = True
            if HAS_GREEDY:
                run_race = greedy == 0
            if run_race:
                rejected_draft = tl.load(draft_ptr + row)
                best = -1.0
                best_idx = 0
                best_p = -1.0
                best_p_idx = 0
                for v0 in range(0, vocab_size, BLOCK_V):
                    v = v0 + tl.arange(0, BLOCK_V)
                    in_vocab = v < vocab_size
                    p = tl.load(target_probs_ptr + row * vocab_size + v, mask=in_vocab, other=0.0)
                    w = tl.load(inv_exp_ptr + req.to(tl.int64) * vocab_size + v, mask=in_vocab, other=0.0)
                    if NO_DRAFT_PROBS:
                        residual = tl.where(v == rejected_draft, 0.0, p)
                    else:
                        q = tl.load(draft_probs_ptr + row * vocab_size + v, mask=in_vocab, other=0.0)
                        residual = tl.maximum(p - q, 0.0)
                    score = tl.where(in_vocab, residual * w, -1.0)
                    score_p = tl.where(in_vocab, p * w, -1.0)
                    tile_best = tl.max(score, axis=0)
                    tile_idx = tl.argmax(score, axis=0) + v0
                    best_idx = tl.where(tile_best > best, tile_idx, best_idx)
                    best = tl.maximum(best, tile_best)
                    tile_best_p = tl.max(score_p, axis=0)
                    tile_idx_p = tl.argmax(score_p, axis=0) + v0
                    best_p_idx = tl.where(tile_best_p > best_p, tile_idx_p, best_p_idx)
                    best_p = tl.maximum(best_p, tile_best_p)
                token = tl.where(best > 0, best_idx, best_p_idx)

    # 4. The whole output row: accepted drafts, the token, placeholders.
    row_vals = tl.where(offs < num_accepted, draft, PLACEHOLDER)
    row_vals = tl.where(offs == num_accepted, token, row_vals)
    tl.store(out_ptr + req.to(tl.int64) * out_stride + offs, row_vals, mask=offs < out_stride)
    ### END SOLUTION



def rejection_sample(
    draft_token_ids: torch.Tensor,        # [T] int
    cu_num_draft_tokens: torch.Tensor,    # [B] int
    draft_probs: torch.Tensor | None,     # [T, V] fp32
    target_probs: torch.Tensor | None,    # [T, V] fp32
    target_argmax: torch.Tensor | None,   # [T] int
    bonus_token_ids: torch.Tensor,        # [B] int
    is_greedy: torch.Tensor | None,       # [B] bool
    uniform_probs: torch.Tensor,          # [T] fp32
    inv_exponential: torch.Tensor,        # [B, V] fp32
    max_spec_len: int,
    block_v: int = DEFAULT_BLOCK_V,
) -> torch.Tensor:                        # [B, max_spec_len + 1] int32
    batch, vocab = inv_exponential.shape
    out = torch.empty((batch, max_spec_len + 1), dtype=torch.int32, device=bonus_token_ids.device)
    if batch == 0:
        return out
    bonus = bonus_token_ids.to(torch.int32).contiguous()
    # Triton reads storage (contiguous copies); an empty tensor (no drafts at all) or an absent
    # one is replaced by a same-typed dummy that the kernel never dereferences.
    i32 = lambda t: bonus if t is None or t.numel() == 0 else t.to(torch.int32).contiguous()   # noqa: E731
    f32 = lambda t: inv_exponential.contiguous() if t is None or t.numel() == 0 else t.contiguous()   # noqa: E731
    _rejection_sample_kernel[(batch,)](
        out, i32(cu_num_draft_tokens), i32(draft_token_ids), f32(draft_probs), f32(target_probs),
        i32(target_argmax), bonus, bonus.to(torch.int8) if is_greedy is None else is_greedy.to(torch.int8).contiguous(),
        f32(uniform_probs), f32(inv_exponential), vocab, max_spec_len + 1,
        NO_DRAFT_PROBS=draft_probs is None, HAS_GREEDY=is_greedy is not None, HAS_RANDOM=target_probs is not None,
        BLOCK_S=triton.next_power_of_2(max_spec_len + 1), BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
    )
    return out
