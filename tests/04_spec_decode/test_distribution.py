"""Distributional proof: speculative sampling emits the target's distribution p, not q.

Stricter than vLLM's test (which checks that the distance to p shrinks with more samples):
a goodness-of-fit hypothesis test on whole speculative generations.

Set-up (spec_decode/distribution.py): a Markov target P[prev] and a Markov drafter
Q[prev] over V = 6 tokens, for adversarial pairs (disjoint supports, Q = P, uniform Q,
peaked P, P masked by top-k, Q close to P) at temperatures 0.5 / 1 / 2. 12 000 sequences
of 3 tokens are generated speculatively with k = 3 drafts per step (several steps each:
rejections, recoveries and bonus tokens all occur), and Pearson's chi-square compares
  * the first emitted token with P[start], and
  * the joint (t1, t2, t3) — 216 cells — with P[start, t1] P[t1, t2] P[t2, t3];
a token the target gives probability 0 must never appear.

The statement: the correct sampler passes at significance alpha = 1e-4 (with random seeds
it would fail one run in 10 000; the seeds here are fixed, so the test is deterministic).
The wrong samplers below are the mistakes one actually makes; each FAILS the same test with
a p-value below 1e-12 — the sample size is enough to separate them by many orders of
magnitude. Two "mistakes" are provably harmless and the test shows it: dropping the min in
min(1, p/q) (u < 1 already saturates the comparison) and dropping the clamp in max(0, p-q)
(the exponential race never picks a negative entry while a positive one exists). Forgetting
the bonus token wastes a token but is also distribution-correct; test_rejection_exact.py
catches it by count.
"""
import pytest
import torch

from spec_decode.distribution import (CASES, chi_square_test, exact_joint, inv_exponential, make_markov_pair, categorical,
                                      run_speculative_chain, sampler_verifier)

ALPHA = 1e-4              # the correct sampler must pass at this significance
MUTANT_P = 1e-12          # every wrong sampler must be rejected this strongly
N, L, K = 12_000, 3, 3


def mutant_verifier(bug):
    """A vectorised sampler for [n, k] drafts that equals the real one (bug=None, bit for
    bit, same random draws in the same order) except for one deliberate mistake."""
    def verify(drafts, q, p, g):
        n, k = drafts.shape
        vocab = p.shape[-1]
        bonus_probs = {"bonus_from_q": q[:, k], "bonus_off_by_one": p[:, k - 1]}.get(bug, p[:, k])
        bonus = categorical(bonus_probs, g)
        uniform = torch.rand(n * k, generator=g).reshape(n, k)
        if bug == "shared_uniform":                 # one u for every position of a request
            uniform = uniform[:, :1].expand(n, k)
        inv_exp = inv_exponential((n, vocab), g)
        p_k, q_k = p[:, :k], q[:, :k]                                       # [n, k, V]
        p_d = p_k.gather(-1, drafts[..., None])[..., 0]                     # [n, k]
        q_d = q_k.gather(-1, drafts[..., None])[..., 0]
        if bug == "no_min":                         # accept with prob p/q, no min(1, .)
            accept = (q_d > 0) & (uniform < p_d / q_d)
        elif bug == "inverted_ratio":               # min(1, q/p)
            accept = uniform * p_d < q_d
        elif bug == "accept_p_only":                # treats q as one-hot although it is not
            accept = uniform < p_d
        else:
            accept = (q_d > 0) & (uniform * q_d < p_d)
        residual = torch.clamp(p_k - q_k, min=0.0)
        if bug == "recover_from_p":
            residual = p_k
        elif bug == "recover_from_q_minus_p":
            residual = torch.clamp(q_k - p_k, min=0.0)
        elif bug == "no_clamp":
            residual = p_k - q_k
        score = residual * inv_exp[:, None, :]
        score = torch.where(score.amax(-1, keepdim=True) <= 0, p_k * inv_exp[:, None, :], score)
        recovered = score.argmax(-1)                                        # [n, k]
        out = torch.full((n, k + 1), -1, dtype=torch.int64)
        if bug == "no_stop":                        # keeps verifying after a rejection
            out[:, :k] = torch.where(accept, drafts, recovered)
            out[:, k] = torch.where(accept[:, -1], bonus, -1)
            return out
        num_acc = accept.long().cumprod(1).sum(1)                           # [n]
        pos = torch.arange(k + 1)
        draft_pad = torch.cat((drafts, drafts[:, :1]), 1)
        out = torch.where(pos < num_acc[:, None], draft_pad, out)
        final = torch.where(num_acc < k, recovered.gather(1, num_acc.clamp(max=k - 1)[:, None])[:, 0], bonus)
        if bug == "forget_bonus":
            final = torch.where(num_acc < k, final, -1)
        return out.scatter(1, num_acc[:, None], final[:, None])
    return verify


def fit(pair, verify, seed=1, k=K):
    samples = run_speculative_chain(pair, verify, num_trials=N, num_tokens=L, k=k, seed=seed)
    first = chi_square_test(samples[:, :1], exact_joint(pair, 1))
    joint = chi_square_test(samples, exact_joint(pair, L))
    return first, joint, samples


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("case", CASES)
def test_correct_sampler_emits_p(case, temperature):
    pair = make_markov_pair(case, temperature=temperature, seed=3)
    first, joint, samples = fit(pair, sampler_verifier("torch"))
    assert first.impossible == 0 and joint.impossible == 0
    assert first.p_value > ALPHA, (case, first)
    assert joint.p_value > ALPHA, (case, joint)
    assert first.total_variation < 0.03           # 6 cells: sampling noise alone is ~0.007


def test_the_mutant_harness_is_the_real_sampler():
    """Without a bug, the test's vectorised sampler reproduces the real one bit for bit —
    so each mutant below is exactly one mistake away from the real thing."""
    pair = make_markov_pair("uniform_q", seed=3)
    real = run_speculative_chain(pair, sampler_verifier("torch"), num_trials=2000, num_tokens=L, k=K, seed=7)
    ours = run_speculative_chain(pair, mutant_verifier(None), num_trials=2000, num_tokens=L, k=K, seed=7)
    assert torch.equal(real, ours)


# (bug, the adversarial case that exposes it, does the FIRST token already show it?)
MUTANTS = [
    ("recover_from_p", "uniform_q", True),           # resample from p instead of p - q
    ("recover_from_q_minus_p", "disjoint", True),    # the residual with the sign flipped
    ("inverted_ratio", "uniform_q", True),           # accept with min(1, q/p)
    ("accept_p_only", "uniform_q", True),            # q treated as one-hot
    ("bonus_from_q", "near", False),                 # the bonus drawn from the drafter (k=1 below)
    ("bonus_off_by_one", "near", False),             # the bonus drawn from p_k, not p_{k+1}
    ("no_stop", "uniform_q", False),                 # keeps verifying drafts after a rejection
    ("shared_uniform", "uniform_q", False),          # one uniform for all positions
]


@pytest.mark.parametrize("bug,case,first_token_shows_it", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_wrong_samplers_are_rejected(bug, case, first_token_shows_it):
    pair = make_markov_pair(case, seed=3)
    # With k = 3 the bonus is the 4th token of a step; k = 1 puts it inside the 3 tokens tested.
    k = 1 if bug.startswith("bonus") else K
    first, joint, _ = fit(pair, mutant_verifier(bug), k=k)
    assert joint.passed_at < MUTANT_P, (bug, joint)
    if first_token_shows_it:
        assert first.passed_at < MUTANT_P, (bug, first)
    else:
        # Only the multi-position behaviour exposes these: why the joint test is needed.
        assert first.passed_at > ALPHA, (bug, first)


@pytest.mark.parametrize("bug", ["no_min", "no_clamp"])
def test_harmless_variants_are_identical(bug):
    """min(1, p/q) vs p/q, and max(0, p-q) vs p-q, give the same tokens with the same randomness."""
    for case in ("uniform_q", "disjoint", "near"):
        pair = make_markov_pair(case, seed=3)
        real = run_speculative_chain(pair, mutant_verifier(None), num_trials=4000, num_tokens=L, k=K, seed=5)
        variant = run_speculative_chain(pair, mutant_verifier(bug), num_trials=4000, num_tokens=L, k=K, seed=5)
        assert torch.equal(real, variant), (bug, case)


def test_forgetting_the_bonus_is_distribution_correct_but_wasteful():
    pair = make_markov_pair("near", seed=3)
    first, joint, _ = fit(pair, mutant_verifier("forget_bonus"))
    assert joint.p_value > ALPHA                     # p is still emitted ...
    g = torch.Generator().manual_seed(0)
    drafts = torch.zeros(1, K, dtype=torch.int64)
    p = torch.zeros(1, K + 1, 6)
    p[..., 0] = 1.0                                  # target and drafter agree: every draft accepted
    assert (mutant_verifier("forget_bonus")(drafts, p.clone(), p, g) >= 0).sum() == K       # ... one token short
    assert (mutant_verifier(None)(drafts, p.clone(), p, g) >= 0).sum() == K + 1


def test_greedy_chain_is_the_argmax_chain():
    """Temperature 0: p one-hot at the argmax; speculative output == greedy decoding, exactly."""
    pair = make_markov_pair("uniform_q", seed=3)
    greedy_P = torch.nn.functional.one_hot(pair.P.argmax(-1), pair.P.shape[0]).float()
    pair.P = greedy_P
    samples = run_speculative_chain(pair, sampler_verifier("torch"), num_trials=500, num_tokens=6, k=K, seed=2)
    expect, tok = [], 0
    for _ in range(6):
        tok = int(greedy_P[tok].argmax())
        expect.append(tok)
    assert (samples == torch.tensor(expect)).all()
