"""The sampler: exact tests (greedy, top-k=1, seeds, logprobs, errors) and distributional tests.

Distributional bound (Bretagnolle-Huber-Carol): for N i.i.d. draws from a distribution p over V
outcomes, the empirical distribution p_hat satisfies
    P(||p_hat - p||_1 >= eps) <= 2^V * exp(-N eps^2 / 2).
Choosing eps = sqrt(2 (V ln 2 + ln(1/delta)) / N) makes the false-failure probability at most delta
= 1e-6 per case. (The draws are seeded, so a given run is deterministic; the bound says a correct
sampler fails for at most a 1e-6 fraction of seeds.) Each case also checks the test has power:
the nearest plausible wrong answer (no filter, or the filters in another order) is > 2 eps away.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.sampler import (Sampler, SamplingMetadata, apply_top_k_only, apply_top_k_top_p, request_generator)
from mini_vllm.sampling_params import SamplingParams

DELTA = 1e-6
# CPU always; the same tests on CUDA (CUDA generators, CUDA kernels) under `make test-gpu`.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.7, 0.3, 0.1, -0.2, -0.6, -1.0, -1.7, -2.5])   # V = 12, no ties


def target_distribution(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The filtered distribution, written independently of the sampler: float64, one token at a time."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones(len(z), dtype=bool)
    probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    order = np.argsort(-z, kind="stable")                      # most likely first
    if top_k != -1:
        for rank, token in enumerate(order):
            if rank >= top_k:
                keep[token] = False
    if top_p < 1:
        kept_probs = np.where(keep, np.exp(z - z.max()), 0.0)
        kept_probs /= kept_probs.sum()
        mass_before = 0.0
        for token in order:
            if not keep[token]:
                continue
            if mass_before >= top_p:                           # the tokens above already reach p
                keep[token] = False
            mass_before += kept_probs[token]
    out = np.where(keep, np.exp(z - z.max()), 0.0)
    return out / out.sum()


def bhc_eps(num_outcomes: int, num_draws: int, delta: float = DELTA) -> float:
    return math.sqrt(2 * (num_outcomes * math.log(2) + math.log(1 / delta)) / num_draws)


CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.3, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.15),
    "all": dict(temperature=0.9, top_k=7, top_p=0.9, min_p=0.05),
}
# For the power check: what a sampler that ignored (or misordered) the filters would produce.
WRONG = {
    "temperature": dict(temperature=1.0),
    "top_k": dict(temperature=1.0),
    "top_p": dict(temperature=1.3),
    "min_p": dict(temperature=1.0),
    # Top-p must see the distribution renormalised after top-k (vLLM's order), not the full one.
    "all": dict(temperature=0.9, top_p=0.9, min_p=0.05),
}
DRAWS_PER_CASE = 40_000


@pytest.mark.parametrize("dev", DEVICES)
def test_distributions_match_targets(dev):
    """All five cases in ONE batch (rows carry their own parameters), 40k rows each."""
    params = [SamplingParams(**kw) for kw in CASES.values() for _ in range(DRAWS_PER_CASE)]
    logits = LOGITS.to(dev).expand(len(params), -1).contiguous()
    sampler = Sampler(generator=torch.Generator(dev).manual_seed(1234))
    tokens = sampler(logits, SamplingMetadata.from_params(params, device=dev)).sampled_token_ids.cpu()
    V = LOGITS.numel()
    eps = bhc_eps(V, DRAWS_PER_CASE)
    for i, (name, kw) in enumerate(CASES.items()):
        counts = np.bincount(tokens[i * DRAWS_PER_CASE:(i + 1) * DRAWS_PER_CASE].numpy(), minlength=V)
        target = target_distribution(LOGITS, **kw)
        l1 = np.abs(counts / DRAWS_PER_CASE - target).sum()
        assert l1 < eps, f"{name}: L1 {l1:.4f} >= {eps:.4f}\ncounts {counts}\ntarget {np.round(target * DRAWS_PER_CASE)}"
        assert (counts[target == 0] == 0).all(), f"{name}: sampled a filtered-out token"
        wrong = target_distribution(LOGITS, **WRONG[name])
        assert np.abs(wrong - target).sum() > 2 * eps, f"{name}: the test could not tell the wrong answer apart"


@pytest.mark.parametrize("dev", DEVICES)
def test_greedy_rows_are_exact_argmax_next_to_random_rows(dev):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g).to(dev)
    logits[2, 17] = logits[2, 400] = logits[2].max() + 1           # a tie: argmax takes the first index, as HF does
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0),
              SamplingParams(temperature=2.0, top_p=0.9), SamplingParams(temperature=0, seed=5), SamplingParams(top_k=3)]
    out = Sampler()(logits, SamplingMetadata.from_params(params, device=dev)).sampled_token_ids
    greedy_rows = [0, 2, 4]
    assert out[greedy_rows].tolist() == logits[greedy_rows].argmax(-1).tolist()
    assert out[2].item() == 17


@pytest.mark.parametrize("dev", DEVICES)
def test_top_k_1_is_greedy(dev):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 500, generator=g).to(dev)
    params = [SamplingParams(temperature=t, top_k=1) for t in np.linspace(0.1, 3.0, 32).tolist()]
    out = Sampler(torch.Generator(dev).manual_seed(0))(logits, SamplingMetadata.from_params(params, device=dev)).sampled_token_ids
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("dev", DEVICES)
def test_seeded_rows_do_not_depend_on_the_batch(dev):
    """Request x (seed 42) samples the same 8 tokens alone and inside a batch whose size, order and
    other rows (greedy, unseeded, another seed, other filters) change every step."""
    V, steps = 64, 8
    g = torch.Generator().manual_seed(0)
    logits_x = torch.randn(steps, V, generator=g)
    x = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def sample_x(other_rows) -> list[int]:
        gen_x = request_generator(x, dev)                # created once, advances every step
        sampler = Sampler(torch.Generator(dev).manual_seed(99))
        tokens = []
        for step in range(steps):
            rows = other_rows(step)                        # [(params, generator or None)]
            at = step % (len(rows) + 1)                    # x moves around the batch
            rows.insert(at, (x, gen_x))
            logits = torch.randn(len(rows), V, generator=g)
            logits[at] = logits_x[step]
            md = SamplingMetadata.from_params([p for p, _ in rows], [gen for _, gen in rows], device=dev)
            tokens.append(sampler(logits.to(dev), md).sampled_token_ids[at].item())
        return tokens

    gen7 = request_generator(SamplingParams(seed=7), dev)
    busy_rows = lambda step: [(SamplingParams(temperature=0), None),
                              (SamplingParams(temperature=0.5, top_k=step + 1), None),
                              (SamplingParams(seed=7), gen7)][:1 + step % 3]
    alone = sample_x(lambda step: [])
    assert sample_x(busy_rows) == alone
    assert sample_x(lambda step: []) == alone                                  # and run to run
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=43)
    gen = request_generator(other_seed, dev)
    different = [Sampler()(logits_x[s][None].to(dev), SamplingMetadata.from_params([other_seed], [gen], device=dev))
                 .sampled_token_ids.item() for s in range(steps)]
    assert different != alone, "another seed should give another sequence"


def test_seeded_row_needs_its_generator():
    with pytest.raises(ValueError, match="row 1 has seed=3 but no generator"):
        SamplingMetadata.from_params([SamplingParams(), SamplingParams(seed=3)])


def test_logprobs_are_raw_model_logprobs():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 100, generator=g)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.5, logprobs=0),
              SamplingParams(temperature=3.0, top_k=50)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, SamplingMetadata.from_params(params))
    lp = out.logprobs_tensors
    raw = logits.log_softmax(-1)
    assert lp.logprob_token_ids.shape == (3, 6)                                 # sampled + max(5, 0) top
    assert torch.equal(lp.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(lp.logprobs[:, 0], raw.gather(-1, out.sampled_token_ids[:, None])[:, 0])
    assert torch.equal(lp.logprob_token_ids[:, 1:], raw.topk(5, -1).indices)
    assert torch.equal(lp.logprobs[:, 1:], raw.topk(5, -1).values)
    assert lp.logprob_token_ids[0, 0] == lp.logprob_token_ids[0, 1] and lp.selected_token_ranks[0] == 1   # greedy
    expected_ranks = (raw >= raw.gather(-1, out.sampled_token_ids[:, None])).sum(-1)
    assert torch.equal(lp.selected_token_ranks, expected_ranks)
    assert Sampler()(logits, SamplingMetadata.from_params([SamplingParams()] * 3)).logprobs_tensors is None


def test_non_finite_logits_name_the_rows():
    logits = torch.zeros(5, 10)
    logits[1, 3] = float("nan")
    logits[2, :9] = float("-inf")                    # masked tokens are fine while one stays finite
    logits[3, 0] = float("inf")
    logits[4, :] = float("-inf")                     # nothing left to sample
    md = SamplingMetadata.from_params([SamplingParams(temperature=0)] * 5, req_ids=["a", "b", "c", "d", "e"])
    with pytest.raises(FloatingPointError, match=r"non-finite logits \(NaN, \+inf or all -inf\) in rows \[1, 3, 4\] "
                                                 r"\(requests \['b', 'd', 'e'\]\)"):
        Sampler()(logits, md)
    assert Sampler()(logits[[0, 2]], SamplingMetadata.from_params([SamplingParams(temperature=0)] * 2)) \
        .sampled_token_ids.tolist() == [0, 9]
    with pytest.raises(TypeError, match="the sampler works in fp32"):
        Sampler()(logits.half(), md)
    with pytest.raises(ValueError, match=r"logits must be \[num_reqs=5, vocab\]"):
        Sampler()(logits[:3], md)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 300), rows=st.integers(1, 8))
def test_top_k_only_fast_path_equals_the_sorting_path(seed, vocab, rows):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    k = torch.randint(-1, vocab + 3, (rows,), generator=g)
    k[k == 0] = -1
    fast = apply_top_k_only(logits, k)
    sorted_path = apply_top_k_top_p(logits, k, torch.ones(rows))
    assert torch.equal(torch.isinf(fast), torch.isinf(sorted_path))
    kept = (~torch.isinf(fast)).sum(-1)
    expected = torch.where((k < 1) | (k > vocab), vocab, k)
    assert torch.equal(kept, expected)
