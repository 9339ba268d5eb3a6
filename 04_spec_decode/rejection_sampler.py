"""The rejection sampler: batched over requests with different numbers of drafts.

Mirrors vLLM's `vllm/v1/sample/rejection_sampler.py`: `RejectionSampler.forward`,
`RejectionSampler.parse_output`, `rejection_sample`, `PLACEHOLDER_TOKEN_ID`.

`rejection_sample_torch` does the whole ragged batch (cu_num_draft_tokens) in a handful of
tensor ops — same arguments and same tokens as the per-request loop in `reference.py`:

  1. accept test for every draft at once (a gather of p(d) and q(d));
  2. the first rejection of each request: pad the accept flags to [batch, max_spec_len]
     with True and count the leading Trues (cumprod);
  3. the recovered token only where a request actually rejected — at most one vocab-wide
     race per request, never one per draft;
  4. scatter accepted drafts + recovered-or-bonus into the [batch, max_spec_len + 1] output.

The Triton and CUDA kernels (triton_ops.py, kernels_cuda/rejection_sampler.cu) do the same
per request in one program / thread block.
"""
from __future__ import annotations

import torch
from torch import nn

from spec_decode.metadata import SpecDecodeMetadata
from spec_decode.reference import PLACEHOLDER_TOKEN_ID
from spec_decode.sampling import (SamplingMetadataLike, compute_probs, generate_inv_exponential,
                                  generate_uniform_probs)


def rejection_sample_torch(
    draft_token_ids: torch.Tensor,        # [T] int
    cu_num_draft_tokens: torch.Tensor,    # [B] int
    draft_probs: torch.Tensor | None,     # [T, V] fp32 or None (q one-hot at the drafts)
    target_probs: torch.Tensor | None,    # [T, V] fp32
    target_argmax: torch.Tensor | None,   # [T] int
    bonus_token_ids: torch.Tensor,        # [B] int
    is_greedy: torch.Tensor | None,       # [B] bool
    uniform_probs: torch.Tensor,          # [T] fp32
    inv_exponential: torch.Tensor,        # [B, V] fp32
    max_spec_len: int,
) -> torch.Tensor:                        # [B, max_spec_len + 1] int32
    device = bonus_token_ids.device
    batch, num_tokens = bonus_token_ids.shape[0], draft_token_ids.shape[0]
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device)
    if batch == 0:
        return out
    ### BEGIN SOLUTION
    cu = cu_num_draft_tokens.long()
    num_draft = torch.diff(cu, prepend=cu.new_zeros(1))                            # [B]
    start = cu - num_draft                                                         # [B]
    req = torch.repeat_interleave(torch.arange(batch, device=device), num_draft)   # [T] request of each draft
    pos = torch.arange(num_tokens, device=device) - start[req]                     # [T] position in its request
    draft = draft_token_ids.long()                                                 # [T]
    greedy_tok = is_greedy[req] if is_greedy is not None else torch.zeros_like(draft, dtype=torch.bool)

    # 1. Accept test for every draft.
    accept = torch.zeros(num_tokens, dtype=torch.bool, device=device)              # [T]
    if target_probs is not None:
        p_d = target_probs.gather(1, draft[:, None])[:, 0]                         # [T] p(d)
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(1, draft[:, None])[:, 0]
        accept = (q_d > 0) & (uniform_probs * q_d < p_d)
    if target_argmax is not None:
        accept = torch.where(greedy_tok, draft == target_argmax.long(), accept)

    # 2. Accepted prefix length per request.
    padded = torch.ones(batch, max(max_spec_len, 1), dtype=torch.bool, device=device)   # pads count as accepted
    padded[req, pos] = accept
    num_accepted = torch.minimum(padded.long().cumprod(dim=1).sum(dim=1), num_draft)    # [B]
    rejected = num_accepted < num_draft                                                  # [B]

    # 3. Recovered tokens, only for the requests that rejected, at their first rejection.
    final = bonus_token_ids.long().clone()                                               # [B] bonus by default
    rej = rejected.nonzero()[:, 0]                                                       # [R]
    if rej.numel():
        row = start[rej] + num_accepted[rej]                                             # [R] flat row of the rejection
        rej_greedy = greedy_tok[row]
        recovered = torch.zeros_like(rej)
        if target_argmax is not None:
            recovered = torch.where(rej_greedy, target_argmax.long()[row], recovered)
        rand = (~rej_greedy).nonzero()[:, 0]
        if rand.numel():
            r_rows, r_req = row[rand], rej[rand]
            p = target_probs[r_rows]                                                     # [R', V]
            if draft_probs is None:   # q one-hot at the draft: max(0, p - q) = p without the draft
                residual = p.scatter(1, draft[r_rows][:, None], 0.0)
            else:
                residual = (p - draft_probs[r_rows]).clamp_(min=0.0)
            best, winner = residual.mul_(inv_exponential[r_req]).max(dim=1)              # the race (first on ties)
            empty = best <= 0                                                            # rounding only: race on p
            if bool(empty.any()):
                winner[empty] = (p[empty] * inv_exponential[r_req[empty]]).argmax(dim=1)
            recovered[rand] = winner
        final[rej] = recovered

    # 4. Output rows: accepted drafts, then the recovered or bonus token.
    keep = pos < num_accepted[req]
    out[req[keep], pos[keep]] = draft[keep].to(torch.int32)
    out[torch.arange(batch, device=device), num_accepted] = final.to(torch.int32)
    ### END SOLUTION
    return out


class RejectionSampler(nn.Module):
    """Verify drafts against the target: accepted + recovered + bonus tokens (vLLM's terms).

    forward(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata)
        metadata        SpecDecodeMetadata of the step
        draft_probs     [num_draft_total, V] fp32 q, or None for drafters without a
                        distribution (n-gram, greedy draft model / EAGLE): q one-hot
        target_logits   [num_draft_total, V] fp32: logits[metadata.target_logits_indices]
        bonus_token_ids [batch] (or [batch, 1]): sampled by the engine's normal sampler from
                        logits[metadata.bonus_logits_indices] — so top-k/top-p/min-p/logprobs
                        of the bonus row need nothing new (vLLM does the same)
        sampling_metadata  temperature / top_k / top_p (/ min_p) / generators per request
    returns [batch, max_spec_len + 1] int32 padded with PLACEHOLDER_TOKEN_ID; parse_output
    turns it into per-request token lists.

    backend: "reference" | "torch" | "triton" | "cuda" (see ops.rejection_sample).
    generator: the random stream of unseeded requests (None: torch's default).
    """

    def __init__(self, backend: str = "torch", generator: torch.Generator | None = None):
        super().__init__()
        from spec_decode.ops import BACKENDS
        if backend not in BACKENDS:
            raise ValueError(f"unknown rejection-sampler backend {backend!r}; choose one of {BACKENDS}")
        self.backend = backend
        self.generator = generator

    def forward(self, metadata: SpecDecodeMetadata, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                bonus_token_ids: torch.Tensor, sampling_metadata: SamplingMetadataLike,
                check_values: bool = True) -> torch.Tensor:
        from spec_decode.ops import rejection_sample
        if bonus_token_ids.dim() == 2:
            bonus_token_ids = bonus_token_ids[:, 0]
        if target_logits.dim() != 2 or target_logits.shape[0] != sum(metadata.num_draft_tokens):
            raise ValueError(f"target_logits must be [num_draft_total={sum(metadata.num_draft_tokens)}, vocab], "
                             f"got {tuple(target_logits.shape)}")
        if sampling_metadata.temperature.shape[0] != metadata.batch_size:
            raise ValueError(f"sampling metadata has {sampling_metadata.temperature.shape[0]} rows for "
                             f"{metadata.batch_size} requests")
        ### BEGIN SOLUTION
        device = target_logits.device
        vocab = target_logits.shape[-1]
        greedy = sampling_metadata.temperature == 0                                      # [B]
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        target_probs = None if all_greedy else compute_probs(target_logits, metadata.num_draft_tokens,
                                                             sampling_metadata)
        target_argmax = None if all_random else target_logits.argmax(dim=-1)            # raw logits: exact greedy
        uniform = generate_uniform_probs(metadata.num_draft_tokens, sampling_metadata.generators,
                                         self.generator, device)
        inv_exp = generate_inv_exponential(metadata.num_draft_tokens, vocab, sampling_metadata.generators,
                                           self.generator, device)
        return rejection_sample(metadata.draft_token_ids, metadata.cu_num_draft_tokens, draft_probs, target_probs,
                                target_argmax, bonus_token_ids, None if all_random else greedy, uniform, inv_exp,
                                metadata.max_spec_len, backend=self.backend, check_values=check_values)
        ### END SOLUTION

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int) -> list[list[int]]:
        """[batch, max_spec_len + 1] -> per request the emitted tokens (placeholders dropped)."""
        rows = output_token_ids.cpu().tolist()
        return [[t for t in row if t != PLACEHOLDER_TOKEN_ID and 0 <= t < vocab_size] for row in rows]
