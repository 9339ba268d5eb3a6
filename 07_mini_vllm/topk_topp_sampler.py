"""Top-k / top-p filtering and the random draw (vLLM: vllm/v1/sample/ops/topk_topp_sampler.py).

Two ways to the same kept set, bit for bit:

* `apply_top_k_top_p` — the readable reference (the oracle): sort the whole row.
* `top_k_top_p_candidates` — what the Sampler runs: `torch.topk` of a few candidates per row,
  more only for the rows that need them, the full sort only as the last resort.

The rules (both paths share `threshold_from_sorted`, so they share its arithmetic):

    x [N, V] fp32 logits after temperature (and min-p); probs = softmax(x), per row
    top-k (1 <= k < V): keep the tokens whose logit is >= the k-th largest logit. Ties at the
        boundary survive, so a row may keep more than k tokens.
    top-p (p < 1): walk the tokens top-k kept, most likely first; a token stays while the mass
        of the tokens before it is < p * mass_k, where mass_k is what top-k kept (1 without
        top-k; with top-k, the running sum of the kept probabilities from the most likely down:
        top-p sees the distribution renormalised after top-k, as in vLLM). The most likely token
        always stays, and so does every token tied with the last one kept.
    => each row's result is one threshold t: keep exactly the tokens with x >= t.

vLLM's reference sorts ascending and drops a token when the mass at or below it is <= 1 - p;
"mass before < p" is the same rule summed from the other end (fewer rounding steps where the
decision is made) and lets a prefix of the sorted row decide it.

Why a prefix suffices (the proof `tests/07_mini_vllm/test_sampler.py` checks on adversarial rows):
`torch.topk(x, K)` returns the same K largest values, in the same descending order, as the
first K entries of the full sort (tied tokens may come in another order, but tied logits have
equal probabilities, so every quantity below sees the same sequence of numbers). The kept mass
is a `cumsum` (a left-to-right scan: its first K outputs do not depend on what follows), so
on the first K positions every decision is the reference's. The prefix is enough for a row when
    top-k rows:      the K-th candidate is below the k-th largest logit (no tie of the k-th
                     token is left outside), or the candidates hold every finite logit;
    top-p-only rows: the candidates' mass already reaches p (no token outside can be kept) and
                     the K-th candidate is below t (no tie of the last kept token is outside).
Rows that fail get 4x more candidates (top-p rows: as many as a histogram of their mass by
binary exponent says they need, if more); K = V is the full sort.

The draw: one uniform u per row, inverse CDF over the kept tokens in token-id order (the first
token whose cumulative mass exceeds u * total). A seeded row therefore consumes exactly one
number of its own generator per step, and what it draws depends only on its own logits,
parameters and generator: the candidate count K (which depends on the other rows) only adds
zero-probability entries, which neither change the running sums nor can be picked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _normalise(k: torch.Tensor | None, p: torch.Tensor | None, num_rows: int, vocab: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """k -> [N] int64 in [1, V] (V = off, also for k < 1 or k >= V); p -> [N] fp32 (1 = off)."""
    if k is None:
        k = torch.full((num_rows,), vocab, dtype=torch.int64, device=device)
    else:
        k = torch.where((k < 1) | (k >= vocab), vocab, k.to(torch.int64))
    if p is None:
        p = torch.ones(num_rows, dtype=torch.float32, device=device)
    return k, p.to(torch.float32)


def threshold_from_sorted(vals: torch.Tensor, probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                          vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k/top-p rule on each row's K largest logits (K = V: the whole sorted row).

    vals [N, K] fp32, descending; probs [N, K] their probabilities; k [N] in [1, V] (V = off);
    p [N] (1 = off). Returns (t [N]: keep x >= t; kth [N]: the k-th largest logit, -inf without
    top-k; mass [N, K]: the running kept mass, most likely first).
    """
    ### BEGIN SOLUTION
    topk_on, topp_on = k < vocab, p < 1                                        # [N], [N]
    kth = vals.gather(-1, (k - 1).clamp(max=vals.shape[-1] - 1)[:, None])[:, 0]
    kth = kth.masked_fill(~topk_on, float("-inf"))                             # [N]
    in_k = vals >= kth[:, None]                                                # [N, K] a prefix of each row
    mass = probs.masked_fill(~in_k, 0.0).cumsum(dim=-1)                        # [N, K]
    mass_k = torch.where(topk_on, mass[:, -1], 1.0)                            # [N] what top-k kept
    before = torch.cat((torch.zeros_like(mass[:, :1]), mass[:, :-1]), dim=-1)  # [N, K] mass of the tokens before
    keep = in_k & (~topp_on[:, None] | (before < (p * mass_k)[:, None]))       # [N, K] a prefix too
    keep[:, 0] = True                                                          # the most likely token always stays
    last = keep.sum(dim=-1, keepdim=True) - 1                                  # [N, 1]
    t = vals.gather(-1, last)[:, 0]                                            # [N] ties with it survive: x >= t
    ### END SOLUTION
    return t, kth, mass


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """The reference: top-k and/or top-p masking by sorting the whole row (vLLM: apply_top_k_top_p).

    logits [N, V] fp32 -> [N, V] with the dropped tokens at -inf. O(V log V) per row.
    """
    if k is None and p is None:
        return logits
    num_rows, vocab = logits.shape
    k, p = _normalise(k, p, num_rows, vocab, logits.device)
    probs = logits.softmax(dim=-1)                                             # [N, V]
    vals, order = logits.sort(dim=-1, descending=True)                         # [N, V]
    t, _, _ = threshold_from_sorted(vals, probs.gather(-1, order), k, p, vocab)
    return logits.masked_fill(logits < t[:, None], float("-inf"))


@dataclass(frozen=True)
class Candidates:
    """Each row's most likely tokens, with the probability to draw them (0 = filtered out)."""
    token_ids: torch.Tensor                   # [N, K] int64 (padding: token 0 with probability 0)
    probs: torch.Tensor                       # [N, K] fp32: softmax(x) of kept tokens, else 0
    threshold: torch.Tensor                   # [N] fp32: the reference keeps exactly x >= threshold


def top_k_top_p_candidates(logits: torch.Tensor, probs: torch.Tensor, k: torch.Tensor | None,
                           p: torch.Tensor | None, top_p_candidates: int = 256, growth: int = 4) -> Candidates:
    """Top-k / top-p without sorting the vocabulary: the reference's kept set from torch.topk.

    logits, probs [N, V] fp32 (probs = logits.softmax(-1)). Top-k rows start with k + 1
    candidates (one more than k, to see whether the k-th logit's ties go on), top-p-only rows
    with `top_p_candidates`; rows whose kept set is not decided by their candidates retry with
    `growth` times as many (or as many as `_top_p_width` estimates), up to V (the full sort). One torch.topk per round, over the rows
    still open, with the round's largest K. Rows with neither filter keep everything (don't
    pass them: the Sampler draws from their full rows directly).
    """
    num_rows, vocab = logits.shape
    k, p = _normalise(k, p, num_rows, vocab, logits.device)
    ### BEGIN SOLUTION
    need = torch.where(k < vocab, k + 1, top_p_candidates).clamp(max=vocab)    # [N]
    width = int(need.max()) if num_rows else 1
    rows = None                                                                # None: every row (no copy)
    done: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    while True:
        x, pr = (logits, probs) if rows is None else (logits[rows], probs[rows])
        kr, pr_p = (k, p) if rows is None else (k[rows], p[rows])
        vals, ids = x.topk(width, dim=-1)                                      # [R, K] descending
        pv = pr.gather(-1, ids)                                                # [R, K]
        t, kth, mass = threshold_from_sorted(vals, pv, kr, pr_p, vocab)
        lowest = vals[:, -1]                                                   # [R] the K-th candidate
        decided = torch.where(kr < vocab, lowest < kth, (lowest < t) & (mass[:, -1] >= pr_p))
        decided |= (width == vocab) | (lowest == float("-inf"))               # every finite logit is a candidate
        kept_probs = pv.masked_fill(vals < t[:, None], 0.0)
        if rows is None and bool(decided.all()):
            return Candidates(ids, kept_probs, t)
        here = torch.arange(num_rows, device=logits.device) if rows is None else rows
        done.append((here[decided], ids[decided], kept_probs[decided], t[decided]))
        rows = here[~decided]
        if rows.numel() == 0:
            break
        width *= growth
        top_p_only = ~decided & (kr == vocab)                                  # [R]
        if bool(top_p_only.any()):
            width = max(width, _top_p_width(pr[top_p_only], pr_p[top_p_only]) * 9 // 8 + 16)
        width = vocab if width > vocab // 2 else width                         # then the full sort is cheaper
    ### END SOLUTION
    widest = max(piece[1].shape[-1] for piece in done)
    token_ids = torch.zeros((num_rows, widest), dtype=torch.int64, device=logits.device)
    kept = torch.zeros((num_rows, widest), dtype=probs.dtype, device=logits.device)
    threshold = torch.empty(num_rows, dtype=logits.dtype, device=logits.device)
    for where, ids, kp, t in done:
        token_ids[where, :ids.shape[-1]] = ids
        kept[where, :kp.shape[-1]] = kp
        threshold[where] = t
    return Candidates(token_ids, kept, threshold)


def _top_p_width(probs: torch.Tensor, p: torch.Tensor) -> int:
    """How many candidates the top-p-only rows of probs [R, V] need, at most: a histogram of each
    row's mass by binary exponent (bin b holds the probabilities in [2^-(b+1), 2^-b)) finds the
    bin where the mass from the top reaches p, and the top-p set lies within that bin and above.
    One pass over the rows (instead of topk after topk); it only sizes the next round, whose
    result is checked as always (a rounding slip just costs another round)."""
    num_rows = probs.shape[0]
    _, exponent = torch.frexp(probs)                                           # probs = m * 2^e, m in [0.5, 1)
    bins = torch.where(probs > 0, (-exponent).clamp(0, 63), 63).to(torch.int64)        # [R, V] in 0..63 (1.0: bin 0)
    flat = (bins + 64 * torch.arange(num_rows, device=probs.device)[:, None]).flatten()
    mass = torch.bincount(flat, weights=probs.flatten().double(), minlength=64 * num_rows).view(num_rows, 64)
    count = torch.bincount(flat, minlength=64 * num_rows).view(num_rows, 64)
    cut = (mass.cumsum(dim=1) < p[:, None]).sum(dim=1).clamp(max=63)          # [R] the bin where p is reached
    return int(count.cumsum(dim=1).gather(1, cut[:, None]).max())


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from one uniform per row: the first token whose running mass exceeds u * total.

    probs [N, K] fp32, not necessarily normalised (zeros are never drawn); u [N] fp64 in [0, 1);
    token_ids [N, K] (None: column j is token j). Sums run in token-id order and in fp64, so the
    result depends only on the kept tokens and u, not on how many zero entries pad the row.
    """
    ### BEGIN SOLUTION
    if token_ids is not None:
        token_ids, order = token_ids.sort(dim=-1)                              # [N, K] token-id order
        probs = probs.gather(-1, order)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)                            # [N, K]
    total = cdf[:, -1]                                                         # [N] > 0: the top token is kept
    # u * total can round up to total when u is within 2^-53 of 1: keep the target strictly below it.
    target = torch.minimum(u.to(torch.float64) * total, torch.nextafter(total, torch.zeros_like(total)))
    pos = torch.searchsorted(cdf, target[:, None], right=True)                 # [N, 1] first entry > target
    ### END SOLUTION
    return pos[:, 0] if token_ids is None else token_ids.gather(-1, pos)[:, 0]


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """The reference draw: argmax(p / E), E ~ Exp(1) i.i.d. per token (vLLM: random_sample).

    probs [N, V]. Exact in distribution (the exponential race, equivalent to Gumbel-max) but V
    random numbers per row and step; a seeded row fills its own row from its own generator.
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_(generator=generator)                                   # the shared stream, unseeded rows
    for row, g in generators.items():
        q[row].exponential_(generator=g)                                      # exactly V draws from the row's own stream
    # An exact 0 draw would turn p=0 into 0/0 = NaN (and argmax picks NaN): keep E > 0.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)
