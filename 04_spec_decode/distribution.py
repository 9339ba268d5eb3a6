"""The empirical proof that speculative sampling emits the TARGET's distribution.

vLLM's own test (tests/v1/sample/test_rejection_sampler.py) checks that the distance to p
shrinks as samples grow. Here the claim is tested as a hypothesis, on whole generations:

* a "language" with a Markov target: the next token after `prev` has distribution
  P[prev] (vocab V, rows from logits under a temperature / top-k), and a Markov drafter
  Q[prev] — adversarial pairs (disjoint supports, Q = P, uniform Q, peaked P, masked P);
* `run_speculative_chain` generates N sequences speculatively, vectorised over the N
  trials: each step drafts k tokens from Q, verifies them in one call of the sampler
  under test (which sees p at the k + 1 positions, conditioned on the DRAFTED prefix, as a
  real target forward pass does), appends what it emits, and continues from there;
* `chi_square_test` compares the counts of the first L emitted tokens (the joint of
  several positions, spanning several speculative steps) with the exact probabilities
  P[s, t1] P[t1, t2] ...; cells the target gives probability 0 must be empty.

A correct sampler passes at the stated significance; the wrong samplers in
tests/04_spec_decode/test_distribution.py fail it by many orders of magnitude.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from spec_decode.sampling import apply_top_k_top_p

# verify(drafts [N, k], q [N, k + 1, V], p [N, k + 1, V], generator) -> [N, k + 1] emitted tokens, -1 padded.
# q[:, k] is what the drafter would predict after its last draft: a correct verifier never reads it.
Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]

CASES = ("disjoint", "equal", "uniform_q", "peaked_p", "masked_p", "near")


@dataclass
class MarkovPair:
    name: str
    P: torch.Tensor      # [V, V] target: row prev -> next-token probabilities
    Q: torch.Tensor      # [V, V] drafter


def categorical(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One sample per row of probs [..., V] (small V) by inverse CDF: the number of tokens
    whose cumulative mass is below u * total, u in (0, 1] — a zero-probability token is
    never chosen. The drafter's and the bonus token's sampler in the harness."""
    cdf = probs.cumsum(dim=-1)                                                  # [..., V]
    u = 1.0 - torch.rand(probs.shape[:-1] + (1,), generator=generator, dtype=probs.dtype)
    return (cdf < u * cdf[..., -1:]).sum(dim=-1).clamp_(max=probs.shape[-1] - 1)


def inv_exponential(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """1 / E with E = -log(1 - U) ~ Exp(1) (cheaper than Tensor.exponential_ on CPU)."""
    e = -torch.log1p(-torch.rand(shape, generator=generator))
    return e.clamp_(min=torch.finfo(torch.float32).tiny).reciprocal_()


@contextlib.contextmanager
def single_thread():
    """Tiny tensors: torch's intra-op threads cost more than they save (argmax over 6 columns
    of 12 000 rows is 10x slower on 2 threads on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def make_markov_pair(case: str, vocab: int = 6, temperature: float = 1.0, seed: int = 0) -> MarkovPair:
    """An adversarial (P, Q) pair; P = softmax(logits / temperature) (+ top-k for masked_p)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 1.5
    q_logits = torch.randn(vocab, vocab, generator=g) * 1.5
    half = vocab // 2
    if case == "disjoint":                      # P lives on the first half, Q on the second
        logits[:, half:] = float("-inf")
        q_logits[:, :half] = float("-inf")
    elif case == "peaked_p":
        logits = logits * 4.0
    elif case == "masked_p":                    # top-k masks part of P; Q puts mass there
        logits = apply_top_k_top_p(logits, torch.full((vocab,), half), None)
    elif case not in CASES:
        raise ValueError(f"unknown case {case!r}; choose one of {CASES}")
    P = torch.softmax(logits / temperature, dim=-1)
    if case == "equal":
        Q = P.clone()
    elif case == "uniform_q":
        Q = torch.full((vocab, vocab), 1.0 / vocab)
    elif case == "near":                        # close to P: long accepted runs, many bonus tokens
        Q = 0.8 * P + 0.2 * torch.softmax(q_logits, dim=-1)
    else:
        Q = torch.softmax(q_logits, dim=-1)
    return MarkovPair(case, P, Q)


def run_speculative_chain(pair: MarkovPair, verify: Verifier, *, num_trials: int, num_tokens: int, k: int,
                          start_token: int = 0, seed: int = 0) -> torch.Tensor:   # [num_trials, num_tokens]
    """Generate num_tokens tokens per trial speculatively (k drafts per step)."""
    with single_thread():
        return _run_chain(pair, verify, num_trials, num_tokens, k, start_token, seed)


def _run_chain(pair, verify, num_trials, num_tokens, k, start_token, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    P, Q = pair.P, pair.Q
    n = num_trials
    out = torch.full((n, num_tokens + k + 1), -1, dtype=torch.int64)
    length = torch.zeros(n, dtype=torch.int64)
    last = torch.full((n,), start_token, dtype=torch.int64)
    rows = torch.arange(n)
    while bool((length < num_tokens).any()):
        # Draft k tokens autoregressively from Q; remember q at each position.
        drafts, qs, prev = [], [], last
        for _ in range(k):
            q = Q[prev]                                         # [n, V]
            d = categorical(q, g)
            drafts.append(d)
            qs.append(q)
            prev = d
        qs.append(Q[prev])                                      # the drafter's next distribution (unused)
        drafts_t = torch.stack(drafts, 1)                       # [n, k]
        contexts = torch.cat((last[:, None], drafts_t), 1)      # [n, k + 1] token before each position
        p = P[contexts]                                         # [n, k + 1, V]: target at every position
        emitted = verify(drafts_t, torch.stack(qs, 1), p, g)    # [n, k + 1]
        num = (emitted >= 0).sum(1)
        active = length < num_tokens                            # finished trials keep their tokens
        for j in range(k + 1):
            take = active & (j < num)
            out[rows[take], length[take] + j] = emitted[take, j]
        last = torch.where(active, emitted[rows, (num - 1).clamp(min=0)], last)
        length = torch.where(active, length + num, length)
    return out[:, :num_tokens]


def exact_joint(pair: MarkovPair, num_tokens: int, start_token: int = 0) -> torch.Tensor:   # [V] * num_tokens
    """P(t1, ..., tL | start) of the target chain, float64."""
    P = pair.P.double()
    joint = P[start_token]
    for _ in range(num_tokens - 1):
        # joint[..., t_m] * P[t_m, t_{m+1}]: P's row axis lines up with joint's last axis.
        joint = joint[..., None] * P.reshape(*([1] * (joint.dim() - 1)), *P.shape)
    return joint


@dataclass
class ChiSquareResult:
    statistic: float
    dof: int
    p_value: float               # probability of a statistic this large if the sampler is right
    impossible: int              # samples in cells the target gives probability 0
    total_variation: float       # 0.5 * sum |empirical - exact|

    @property
    def passed_at(self) -> float:
        return self.p_value if self.impossible == 0 else 0.0


def chi_square_test(samples: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> ChiSquareResult:
    """Pearson's chi-square goodness of fit of samples [N, L] (token ids) against the exact
    joint `expected` [V]*L. Cells with expected count < min_expected are pooled into one."""
    vocab = expected.shape[0]
    n, length = samples.shape
    flat = torch.zeros(samples.shape[0], dtype=torch.int64)
    for j in range(length):
        flat = flat * vocab + samples[:, j]
    observed = torch.bincount(flat, minlength=vocab ** length).double()
    exp_counts = expected.reshape(-1) * n
    impossible = int(observed[expected.reshape(-1) == 0].sum())
    big = exp_counts >= min_expected
    obs_cells = torch.cat((observed[big], observed[~big].sum()[None]))
    exp_cells = torch.cat((exp_counts[big], exp_counts[~big].sum()[None]))
    keep = exp_cells > 0
    obs_cells, exp_cells = obs_cells[keep], exp_cells[keep]
    stat = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    dof = max(int(keep.sum()) - 1, 1)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    tv = 0.5 * float((observed / n - expected.reshape(-1)).abs().sum())
    return ChiSquareResult(stat, dof, p_value if not math.isnan(p_value) else 0.0, impossible, tv)


def sampler_verifier(backend: str = "torch") -> Verifier:
    """The real rejection sampler (spec_decode.ops.rejection_sample) as a chain verifier:
    flattens the trials into a ragged batch of k drafts each, samples the bonus token from
    p_{k+1} (as the engine's sampler would), draws the uniforms and race noise."""
    from spec_decode.ops import rejection_sample

    def verify(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        n, k = drafts.shape
        vocab = p.shape[-1]
        bonus = categorical(p[:, k], g)
        uniform = torch.rand(n * k, generator=g)
        inv_exp = inv_exponential((n, vocab), g)
        out = rejection_sample(drafts.reshape(-1), torch.arange(1, n + 1, dtype=torch.int32) * k,
                               q[:, :k].reshape(-1, vocab).float(), p[:, :k].reshape(-1, vocab).float(), None, bonus, None,
                               uniform, inv_exp, k, backend=backend, check_values=False)
        return out.long()

    return verify
