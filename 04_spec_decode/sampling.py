"""The target distribution p and the random numbers of one verification step.

Mirrors vLLM's `vllm/v1/sample/rejection_sampler.py`: `compute_probs`,
`expand_batch_to_tokens`, `generate_uniform_probs`, and the exponential noise of
`sample_recovered_tokens`.

Why chapter 04 has its own p transform: speculative decoding must reproduce the
distribution the request would have been sampled from WITHOUT speculation — the target
logits after the request's own temperature, min-p, top-k and top-p. That transform belongs
to the engine's sampler (chapter 07), which this chapter may not import; so it is written
here once more, in the same order (temperature -> min-p -> top-k -> top-p -> softmax), and
the engine may equally pass probabilities it already processed.

Greedy rows (temperature 0) are never turned into probabilities: greedy verification
compares drafts with the argmax of the RAW logits, exactly the token the engine's greedy
sampler would pick (softmax can round two close logits to the same probability and move
the argmax — a greedy run with and without speculation must be identical).

Random numbers are inputs, never drawn inside a kernel: every backend (reference loop,
batched torch, Triton, CUDA) is fed the same tensors, so they must agree token for token.
    uniform_probs    [num_draft_total]  U[0, 1): one per draft, for the accept test
    inv_exponential  [batch, vocab]     1 / E with E ~ Exp(1): the exponential race
        argmax_i r_i / E_i is distributed as r / sum(r) (equivalently Gumbel-max). One row
        per request suffices because at most one recovered token per request is ever kept.
        Passing 1/E turns the race into a product: fp32 products are bit-identical on every
        backend, while Triton's fp32 division on a GPU is approximate.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch


class SamplingMetadataLike(Protocol):
    """What the rejection sampler reads from the engine's sampling metadata (chapter 07's
    `SamplingMetadata` has these fields; so does `SpecSamplingMetadata` below). One row per request."""
    temperature: torch.Tensor                 # [batch] fp32, 0 = greedy
    top_k: torch.Tensor | None                # [batch] int, -1 (or < 1) = off
    top_p: torch.Tensor | None                # [batch] fp32, 1 = off
    generators: dict[int, torch.Generator]    # row -> the request's own generator (seeded requests)
    all_greedy: bool
    all_random: bool


@dataclass(frozen=True)
class SpecSamplingMetadata:
    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    @property
    def all_random(self) -> bool:
        return bool((self.temperature > 0).all())

    @classmethod
    def from_lists(cls, temperature: Sequence[float], top_k: Sequence[int] | None = None,
                   top_p: Sequence[float] | None = None, min_p: Sequence[float] | None = None,
                   generators: dict[int, torch.Generator] | None = None,
                   device: torch.device | str = "cpu") -> "SpecSamplingMetadata":
        if any(t < 0 for t in temperature):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {list(temperature)}")
        n = len(temperature)
        for name, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            if v is not None and len(v) != n:
                raise ValueError(f"{name} needs one value per request ({n}), got {len(v)}")
        if top_p is not None and any(not 0 < p <= 1 for p in top_p):
            raise ValueError(f"top_p must be in (0, 1], got {list(top_p)}")
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor(list(temperature), **f32),
            top_k=None if top_k is None else torch.tensor(list(top_k), dtype=torch.int64, device=device),
            top_p=None if top_p is None else torch.tensor(list(top_p), **f32),
            min_p=None if min_p is None else torch.tensor(list(min_p), **f32),
            generators=dict(generators or {}),
        )


def expand_batch_to_tokens(x: torch.Tensor, num_tokens_per_req: Sequence[int]) -> torch.Tensor:
    """[batch] -> [sum(num_tokens_per_req)]: each request's value repeated for each of its
    drafts (vLLM: expand_batch_to_tokens). x = [a, b, c], counts [2, 3, 1] -> [a, a, b, b, b, c]."""
    counts = torch.tensor(list(num_tokens_per_req), dtype=torch.int64, device=x.device)
    if counts.shape[0] != x.shape[0]:
        raise ValueError(f"{x.shape[0]} values for {counts.shape[0]} requests")
    return torch.repeat_interleave(x, counts)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's top probability. [N, V], [N]."""
    probs = logits.softmax(dim=-1)                                             # [N, V]
    return logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Per-row top-k then top-p (nucleus) masking with -inf. logits [N, V], top_k [N], top_p [N].

    top-k keeps every token whose logit is >= the k-th largest (ties at the boundary stay);
    top-p then keeps, in descending order, each token while the mass BEFORE it is < p (so the
    smallest prefix reaching p, and always the top token), measured on the top-k-renormalised
    distribution. Same rules as the engine's sampler (and vLLM's apply_top_k_top_p).
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    ### BEGIN SOLUTION
    sorted_logits, order = logits.sort(dim=-1, descending=True)                # [N, V]
    if top_k is not None:
        k = torch.where((top_k < 1) | (top_k > vocab), vocab, top_k).long()    # off -> keep all
        kth = sorted_logits.gather(-1, (k - 1)[:, None])                       # [N, 1] the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)                                  # [N, V] renormalised after top-k
        mass_before = probs.cumsum(dim=-1) - probs                             # [N, V] mass strictly before
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False                                                     # the top token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    ### END SOLUTION
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)         # back to vocabulary order


def compute_probs(
    target_logits: torch.Tensor,       # [num_tokens, vocab] fp32: logits at the rows that verify drafts
    num_draft_tokens: Sequence[int],   # [batch] how many of those rows each request owns
    sampling_metadata: SamplingMetadataLike,
) -> torch.Tensor:                     # [num_tokens, vocab] fp32 probabilities (greedy rows: softmax at T=1, unused)
    """p for every draft position: the target logits under the request's own sampling
    parameters (vLLM: compute_probs). Greedy rows get temperature 1 only to stay finite;
    the rejection sampler reads the raw-logit argmax for them instead."""
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be [num_tokens, vocab], got {tuple(target_logits.shape)}")
    if target_logits.shape[0] != sum(num_draft_tokens):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {sum(num_draft_tokens)} drafts")
    temperature = sampling_metadata.temperature
    temperature = expand_batch_to_tokens(torch.where(temperature == 0, 1.0, temperature), num_draft_tokens)
    logits = target_logits.float() / temperature[:, None]                      # [T, V]
    min_p = getattr(sampling_metadata, "min_p", None)
    if min_p is not None:
        logits = apply_min_p(logits, expand_batch_to_tokens(min_p, num_draft_tokens))
    top_k = None if sampling_metadata.top_k is None else expand_batch_to_tokens(sampling_metadata.top_k, num_draft_tokens)
    top_p = None if sampling_metadata.top_p is None else expand_batch_to_tokens(sampling_metadata.top_p, num_draft_tokens)
    return apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)


def generate_uniform_probs(num_draft_tokens: Sequence[int], generators: dict[int, torch.Generator],
                           generator: torch.Generator | None = None,
                           device: torch.device | str = "cpu") -> torch.Tensor:   # [num_draft_total] fp32
    """U[0, 1) per draft. A seeded request draws its slice from its own generator (exactly
    num_draft draws, none when it has no drafts), so its randomness never depends on which
    other requests share the batch (vLLM: generate_uniform_probs)."""
    out = torch.empty(sum(num_draft_tokens), dtype=torch.float32, device=device)
    out.uniform_(generator=generator)
    start = 0
    for i, n in enumerate(num_draft_tokens):
        if n and i in generators:
            out[start:start + n].uniform_(generator=generators[i])
        start += n
    return out


def generate_inv_exponential(num_draft_tokens: Sequence[int], vocab_size: int,
                             generators: dict[int, torch.Generator],
                             generator: torch.Generator | None = None,
                             device: torch.device | str = "cpu") -> torch.Tensor:  # [batch, vocab] fp32
    """1 / E, E ~ Exp(1), one row per request, for the recovered-token race. Seeded requests
    with drafts fill their row from their own generator, after their uniforms."""
    e = torch.empty(len(num_draft_tokens), vocab_size, dtype=torch.float32, device=device)
    e.exponential_(generator=generator)
    for i, n in enumerate(num_draft_tokens):
        if n and i in generators:
            e[i].exponential_(generator=generators[i])
    # E == 0 exactly (probability ~2^-24 per draw) would make 1/E infinite and 0 * inf NaN.
    return e.clamp_(min=torch.finfo(torch.float32).tiny).reciprocal_()
