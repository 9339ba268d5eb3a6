"""The sampler: exact tests (greedy, top-k=1, tiny temperatures, seeds, logprobs, errors), the fast
top-k/top-p path against the full-sort reference (property tests), and distributional tests.

Distributional bound (Bretagnolle-Huber-Carol): for N i.i.d. draws from a distribution p over V
outcomes, the empirical distribution p_hat satisfies
    P(||p_hat - p||_1 >= eps) <= 2^V * exp(-N eps^2 / 2).
Choosing eps = sqrt(2 (V ln 2 + ln(1/delta)) / N) makes the false-failure probability at most delta
= 1e-6 per case. (The draws are seeded, so a given run is deterministic; the bound says a correct
sampler fails for at most a 1e-6 fraction of seeds.) Each case also checks the test has power:
the nearest plausible wrong answer (no filter, or the filters in another order) is > 2 eps away.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sampling_oracle import bhc_eps

from mini_vllm.sampler import Sampler, SamplingMetadata, draw_uniforms, nonfinite_rows, request_generator
from mini_vllm.sampling_params import SamplingParams, SamplingType
from mini_vllm.topk_topp_sampler import apply_top_k_top_p, inverse_cdf_sample, top_k_top_p_candidates

# CPU always; the same tests on CUDA (CUDA generators, CUDA kernels) under `make test-gpu`.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.7, 0.3, 0.1, -0.2, -0.6, -1.0, -1.7, -2.5])   # V = 12, no ties
NEG_INF = float("-inf")


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
SAMPLERS = {"fast": dict(), "fast, top-p from 1 candidate (growth)": dict(top_p_candidates=1),
            "reference (full sort, exponential race)": dict(reference=True)}


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_distributions_match_targets(dev, kind):
    """All five cases in ONE batch (rows carry their own parameters), 40k rows each; the fast path,
    the fast path forced through its candidate growth, and the reference."""
    params = [SamplingParams(**kw) for kw in CASES.values() for _ in range(DRAWS_PER_CASE)]
    logits = LOGITS.to(dev).expand(len(params), -1).contiguous()
    sampler = Sampler(generator=torch.Generator(dev).manual_seed(1234), **SAMPLERS[kind])
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
def test_an_all_greedy_batch_is_torch_argmax_ties_included(dev):
    """The all-greedy path (torch.max's index, faster than argmax on CPU) == torch.argmax: the first
    maximum of each row, with many ties, -inf masks and SmolLM2's vocabulary size."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (64, 49152), generator=g).float()          # every row: thousands of tied maxima
    logits[5, :1000] = float("-inf")
    logits[6] = torch.randn(49152, generator=g)
    logits = logits.to(dev)
    out = Sampler()(logits, SamplingMetadata.from_params([SamplingParams(temperature=0)] * 64, device=dev))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("dev", DEVICES)
def test_top_k_1_is_greedy(dev):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 500, generator=g).to(dev)
    params = [SamplingParams(temperature=t, top_k=1) for t in np.linspace(0.1, 3.0, 32).tolist()]
    out = Sampler(torch.Generator(dev).manual_seed(0))(logits, SamplingMetadata.from_params(params, device=dev)).sampled_token_ids
    assert torch.equal(out, logits.argmax(-1))


# ------------------------------------------------------------------ tiny temperatures (issue 9, item 8)
@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_tiny_temperatures_are_greedy(reference):
    """Below vLLM's _SAMPLING_EPS (1e-5) a temperature means greedy. Before, 1e-7 sampled the
    runner-up of a near tie (1 ulp apart), 1e-40 divided the logits into +inf (softmax NaN: garbage
    tokens), and 1e-50, 0 in the fp32 temperature tensor yet not greedy, sampled at temperature 1."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(200, 300, generator=g) * 0.5                        # all below 3
    top = 1 + torch.randint(0, 299, (200,), generator=g)                       # never column 0
    logits[torch.arange(200), top] = 3.0
    logits[torch.arange(200), top - 1] = 3.0 - 2.4e-7                          # a near tie: 1 ulp below
    temps = [1e-7, 1e-30, 1e-40, 1e-50, 9.99e-6] * 40
    params = [SamplingParams(temperature=t, top_p=0.9, top_k=5, seed=i if i % 3 else None)
              for i, t in enumerate(temps)]
    assert all(p.sampling_type == SamplingType.GREEDY and (p.top_p, p.top_k) == (1.0, -1) for p in params)
    md = SamplingMetadata.from_params(params)                                  # seeded but greedy: no generator
    assert md.all_greedy and not md.generators
    assert torch.equal(Sampler(reference=reference)(logits, md).sampled_token_ids, top)
    # Next to random rows (the mixed path), and just at the boundary (1e-5 samples).
    mixed = [SamplingParams(temperature=1.0), SamplingParams(temperature=1e-30), SamplingParams(temperature=1e-5)]
    assert SamplingParams(temperature=1e-5).sampling_type == SamplingType.RANDOM
    md = SamplingMetadata.from_params(mixed)
    assert not md.all_greedy and not md.all_random
    out = Sampler(torch.Generator().manual_seed(0), reference=reference)(logits[:3], md).sampled_token_ids
    assert out[1] == top[1]


# ------------------------------------------------------------------ seeds
SEEDED_X = {
    "top-p only": dict(temperature=1.0, top_p=0.95),
    "top-k + top-p": dict(temperature=0.8, top_k=40, top_p=0.9),
    "temperature only": dict(temperature=0.7),
    "min-p + top-p": dict(temperature=1.2, min_p=0.02, top_p=0.9),
}


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
@pytest.mark.parametrize("x_kw", list(SEEDED_X.values()), ids=list(SEEDED_X))
def test_seeded_rows_do_not_depend_on_the_batch(dev, reference, x_kw):
    """Request x (seed 42) samples the same 10 tokens alone and inside a batch whose size, order and
    other rows change every step: greedy and tiny-temperature rows, unseeded rows, another seed,
    and top-k values that change the candidate width (so x's row is decided with more or fewer
    candidates, in one round or several). x's logits are flat on some steps (its top-p set then
    outgrows the first 256 candidates) and peaked on others."""
    V, steps = 1000, 10
    g = torch.Generator().manual_seed(0)
    scales = [0.3, 4.0, 1.0, 8.0, 0.5, 2.0, 0.2, 6.0, 1.5, 3.0]
    logits_x = torch.randn(steps, V, generator=g) * torch.tensor(scales)[:, None]
    x = SamplingParams(seed=42, **x_kw)

    def sample_x(other_rows) -> list[int]:
        gen_x = request_generator(x, dev)                # created once, advances every step
        sampler = Sampler(torch.Generator(dev).manual_seed(99), reference=reference)
        tokens = []
        for step in range(steps):
            rows = other_rows(step)                        # [(params, generator or None)]
            at = step % (len(rows) + 1)                    # x moves around the batch
            rows.insert(at, (x, gen_x))
            logits = torch.randn(len(rows), V, generator=g) * 3
            logits[at] = logits_x[step]
            md = SamplingMetadata.from_params([p for p, _ in rows], [gen for _, gen in rows], device=dev)
            tokens.append(sampler(logits.to(dev), md).sampled_token_ids[at].item())
        return tokens

    gen7 = request_generator(SamplingParams(seed=7), dev)
    busy_rows = lambda step: [(SamplingParams(temperature=0), None),
                              (SamplingParams(temperature=0.5, top_k=37 * step + 1), None),
                              (SamplingParams(seed=7, top_p=0.5), gen7),
                              (SamplingParams(temperature=1e-7, seed=3), None),
                              (SamplingParams(top_k=900, top_p=0.99), None)][:1 + step % 5]
    alone = sample_x(lambda step: [])
    assert sample_x(busy_rows) == alone
    assert sample_x(lambda step: []) == alone                                  # and run to run
    other_seed = SamplingParams(seed=43, **x_kw)
    gen = request_generator(other_seed, dev)
    different = [Sampler(reference=reference)(logits_x[s][None].to(dev),
                                              SamplingMetadata.from_params([other_seed], [gen], device=dev))
                 .sampled_token_ids.item() for s in range(steps)]
    assert different != alone, "another seed should give another sequence"


def test_a_seeded_row_draws_one_number_per_step():
    """The fast path takes exactly one fp64 uniform per step from a seeded request's generator,
    whatever the batch (the reference's exponential race takes V)."""
    x = SamplingParams(seed=5, top_p=0.9)
    gen = request_generator(x)
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_k=300), x, SamplingParams(temperature=0)]
    for _ in range(4):
        Sampler()(logits, SamplingMetadata.from_params(params, [None, gen, None]))
    expected = torch.Generator().manual_seed(5)
    torch.rand(4, dtype=torch.float64, generator=expected)
    assert torch.equal(gen.get_state(), expected.get_state())
    u = draw_uniforms(3, {1: torch.Generator().manual_seed(5)}, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert u[1] == torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def test_seeded_row_needs_its_generator():
    with pytest.raises(ValueError, match="row 1 has seed=3 but no generator"):
        SamplingMetadata.from_params([SamplingParams(), SamplingParams(seed=3)])


# ------------------------------------------------------------------ logprobs and bad logits
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
    logits[2, :9] = NEG_INF                          # masked tokens are fine while one stays finite
    logits[3, 0] = float("inf")
    logits[4, :] = NEG_INF                           # nothing left to sample
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


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 70), rows=st.integers(1, 5), step=st.integers(1, 7))
def test_cheap_finiteness_check_equals_the_full_scan(seed, vocab, rows, step):
    """isfinite(amax) flags exactly the rows with a NaN, a +inf, or nothing finite — on any view."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, vocab * step, generator=g)
    specials = torch.tensor([float("nan"), float("inf"), NEG_INF])
    hit = torch.rand(base.shape, generator=g) < torch.rand(rows, 1, generator=g) ** 3
    base[hit] = specials[torch.randint(0, 3, (int(hit.sum()),), generator=g)]
    if rows > 1:
        base[1] = NEG_INF
    for x in (base[:, ::step], base.t().contiguous().t()):
        full_scan = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | ~torch.isfinite(x).any(-1)
        assert torch.equal(nonfinite_rows(x), full_scan)


# ------------------------------------------------------------------ the fast top-k / top-p vs the full sort
def _adversarial_logits(g: torch.Generator, rows: int, vocab: int, style: int) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=g) * (0.1 + 6 * torch.rand(rows, 1, generator=g))
    if style == 1:                                     # heavy ties: few distinct values
        x = x.round()
    elif style == 2:                                   # masked tokens (-inf), some rows mostly masked
        x = x.masked_fill(torch.rand(rows, vocab, generator=g) < torch.rand(rows, 1, generator=g), NEG_INF)
        x[:, 0] = x[:, 0].nan_to_num(neginf=0.0)      # a finite value in every row
    elif style == 3:                                   # a constant row and a one-hot row
        x[0] = 0.0
        if rows > 1:
            x[1] = NEG_INF
            x[1, vocab // 2] = 3.0
    return x


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 400), rows=st.integers(1, 6), style=st.integers(0, 3),
       start=st.sampled_from([1, 3, 256]), growth=st.sampled_from([2, 4]))
@example(seed=0, vocab=2, rows=1, style=2, start=1, growth=2)          # a probability of exactly 1.0 (bin 0)
def test_fast_top_k_top_p_equals_the_full_sort(seed, vocab, rows, style, start, growth):
    """Same kept set as the reference (same ties rule, same top token), from topk candidates that
    grow only when needed; the candidates carry exactly the reference's kept tokens with the
    softmax's probabilities (0 for everything else)."""
    g = torch.Generator().manual_seed(seed)
    x = _adversarial_logits(g, rows, vocab, style)
    k = torch.randint(-1, vocab + 3, (rows,), generator=g)
    k[k == 0] = -1
    p = torch.where(torch.rand(rows, generator=g) < 0.3, 1.0, torch.rand(rows, generator=g).clamp(min=1e-3))
    if style == 3:
        p[0] = 1e-30                                   # a tiny p: the top token alone (with its ties)
    probs = x.softmax(-1)
    for kk, pp in ((k, p), (None, p), (k, None)):
        reference = apply_top_k_top_p(x, kk, pp)
        cand = top_k_top_p_candidates(x, probs, kk, pp, start, growth)
        assert torch.equal(x.masked_fill(x < cand.threshold[:, None], NEG_INF), reference)
        kept_ref = (reference > NEG_INF) & (probs > 0)                 # what can be drawn
        drawn = cand.probs > 0                                          # (padding repeats token 0 with 0)
        kept = torch.zeros_like(kept_ref)
        kept[drawn.nonzero()[:, 0], cand.token_ids[drawn]] = True
        assert torch.equal(kept, kept_ref)
        assert torch.equal(cand.probs[drawn], probs.gather(-1, cand.token_ids)[drawn])
        assert bool((reference.argmax(-1) == x.argmax(-1)).all())      # the most likely token always stays


def test_fast_top_k_top_p_equals_the_full_sort_at_vocab_scale():
    """LM-like rows of SmolLM2's vocabulary size (a few peaked, a few flat): the benchmark's settings."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 49152, generator=g) * torch.tensor([0.5, 1, 2, 3, 4, 6, 8, 12])[:, None] / 0.8
    probs = x.softmax(-1)
    for k, p in ((torch.full((8,), 50), torch.full((8,), 0.95)), (None, torch.full((8,), 0.95)),
                 (torch.tensor([1, 2, 5, 50, 100, 1000, 49151, -1]), torch.tensor([0.1, 0.5, 0.9, 0.95, 0.99, 1, 0.3, 0.7]))):
        cand = top_k_top_p_candidates(x, probs, k, p)
        assert torch.equal(x.masked_fill(x < cand.threshold[:, None], NEG_INF), apply_top_k_top_p(x, k, p))


def test_ties_at_the_boundary_survive():
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    assert (apply_top_k_top_p(x, torch.tensor([2]), None) > NEG_INF).sum() == 4          # 3 and all the 2s
    # top-p: the top token holds ~0.47 of the mass; p = 0.5 needs one more token, a 2 — all three 2s stay.
    assert (apply_top_k_top_p(x, None, torch.tensor([0.5])) > NEG_INF).sum() == 4
    assert (apply_top_k_top_p(x, None, torch.tensor([0.4])) > NEG_INF).sum() == 1         # the top token alone
    cand = top_k_top_p_candidates(x, x.softmax(-1), torch.tensor([2]), None)
    assert sorted(cand.token_ids[cand.probs > 0].tolist()) == [0, 1, 2, 3]


def test_candidates_stay_bounded():
    """Top-k rows get k + 1 candidates; a peaked top-p row 256; only a flat row grows (here to V)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 49152, generator=g)
    x[1] *= 8                                                          # peaked: a few tokens hold p
    probs = x.softmax(-1)
    width = lambda *a: top_k_top_p_candidates(*a).token_ids.shape
    assert width(x, probs, torch.tensor([50, 3, 20]), torch.full((3,), 0.95)) == (3, 51)
    assert width(x[1:2], probs[1:2], None, torch.tensor([0.95])) == (1, 256)
    assert width(x[:1], probs[:1], None, torch.tensor([0.95])) == (1, 49152)


def test_inverse_cdf_draw():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5, 0.0]])
    edges = {0.0: 1, 0.199: 1, 0.201: 3, 0.499: 3, 0.501: 4, 1 - 2 ** -53: 4}      # token 1 owns [0, 0.2), ...
    for u, token in edges.items():
        assert inverse_cdf_sample(probs, torch.tensor([u], dtype=torch.float64)).item() == token
    # candidates in any order, padded with zero-probability entries: the same token for the same u
    ids = torch.tensor([[40, 7, 9, 0, 3]])
    cand = torch.tensor([[0.5, 0.25, 0.0, 0.0, 0.25]])
    padded_ids = torch.tensor([[0, 3, 40, 11, 12, 9, 7]])
    padded = torch.tensor([[0.0, 0.25, 0.5, 0.0, 0.0, 0.0, 0.25]])
    for u in torch.linspace(0, 1 - 2 ** -53, 41, dtype=torch.float64):
        assert inverse_cdf_sample(cand, u[None], ids) == inverse_cdf_sample(padded, u[None], padded_ids)
