"""Speculative decoding through the whole engine (chapter 04 composed into chapter 07).

What must hold, and how each test can fail:
* greedy output identical with and without speculation, for every drafter (n-gram, a draft
  checkpoint — another tiny architecture, and the target itself, which makes almost every draft
  accepted —, an EAGLE head, the LayerSkip self-draft) on the tiny Llama / Qwen2 / Qwen3 and on
  SmolLM2 (vLLM issue #41758 reported n-gram changing greedy output on Qwen3-0.6B): a draft
  written to the wrong slot, a rejected draft's K/V read later, a bonus token taken from the
  wrong row, an off-by-one in the rollback all change a greedy continuation;
* the same, composed with chunked prefill, prefix caching (a second turn hits blocks written by
  speculative steps), preemption by recompute and by swap through a tiny pool, and the priority
  policy, with the engine's invariants checked after every step (every KV block — the target's
  and the drafter's — is free at the end: tests/conftest.py's autouse check);
* seeded sampling: a seeded request's tokens do not depend on what else is in the batch;
* the sampled distribution: the speculative engine's samples follow the target's exact joint
  distribution (chi-square), and an engine that accepts every draft fails the same test;
* bad input: clear errors at LLM(...) construction; a drafter that fails (or proposes ids
  outside the vocabulary) during a step costs only its own request its drafts;
* metrics per request and for the engine; the adaptive turn-down.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mini_vllm import SamplingParams
from mini_vllm.engine_config import EngineConfig

K = 3
MAX_NEW = 24
ARCHS = ["llama", "qwen2", "qwen3"]
METHODS = ["ngram", "draft_model", "draft_model_self", "eagle", "layer_skip"]


def token_prompts(seed: int = 0) -> list[list[int]]:
    """Token-id prompts for the tiny models: one that repeats (n-gram matches at once), one random,
    one periodic, and one sharing a long prefix with the first (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(100, 49000, 8).tolist()
    return [base + base + base[:3], rng.integers(100, 49000, 21).tolist(), base[:4] * 5,
            base + base + rng.integers(100, 49000, 6).tolist()]


@pytest.fixture(scope="module")
def tiny_eagle_heads(tiny_engine_models, tmp_path_factory):
    """{arch: directory of an (untrained, seeded) EAGLE head shaped for that tiny model}. Exactness
    does not depend on the head's quality; its drafts are mostly rejected."""
    from spec_decode import EagleConfig, EagleHead

    heads = {}
    for i, (arch, (_, hf)) in enumerate(tiny_engine_models.items()):
        torch.manual_seed(100 + i)
        head = EagleHead(EagleConfig.for_target(hf.config))
        heads[arch] = tmp_path_factory.mktemp(f"eagle-{arch}")
        head.save_pretrained(heads[arch], dtype=torch.float32)
    return heads


def drafter_config(method: str, arch: str, tiny_engine_models, tiny_eagle_heads, **extra) -> dict:
    other = {"llama": "qwen2", "qwen2": "qwen3", "qwen3": "llama"}[arch]
    config = {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": str(tiny_engine_models[other][0])},
        "draft_model_self": {"method": "draft_model", "model": str(tiny_engine_models[arch][0])},
        "eagle": {"method": "eagle", "model": str(tiny_eagle_heads[arch])},
        "layer_skip": {"method": "layer_skip", "num_layers": 1},
    }[method]
    return {**config, "num_speculative_tokens": K, "adaptive": False, **extra}


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
_baseline_cache: dict = {}


def baseline(make_llm, model_dir, key, prompts, params=GREEDY, **config):
    """The same engine without speculation (cached per configuration)."""
    if key not in _baseline_cache:
        _baseline_cache[key] = tokens(make_llm(model_dir, **config).generate(prompts, params, use_tqdm=False))
    return _baseline_cache[key]


# =============================================================================== greedy exactness
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_with_every_drafter(arch, method, tiny_engine_models, tiny_eagle_heads, make_llm, traced):
    model_dir = tiny_engine_models[arch][0]
    prompts = token_prompts()
    ref = baseline(make_llm, model_dir, ("greedy", arch), prompts, block_size=4)
    llm = make_llm(model_dir, block_size=4,
                   speculative_config=drafter_config(method, arch, tiny_engine_models, tiny_eagle_heads))
    outputs, steps = traced(llm, prompts, GREEDY)
    assert tokens(outputs) == ref, f"{arch}/{method}: speculation changed the greedy output"
    stats_ = llm.llm_engine.engine_core.spec_decoding_stats.stats
    assert stats_.num_draft_tokens > 0, "no draft was ever verified: the test would prove nothing"
    # Some step verified drafts for several requests at once, mixed with other work.
    assert any(len(s.scheduler_output.scheduled_spec_decode_tokens) >= 2 for s in steps)
    if method == "draft_model_self":
        # The target drafting for itself: (nearly) every draft accepted, so the bonus-token path runs.
        assert stats_.acceptance_rate > 0.9
        assert stats_.num_accepted_tokens_per_pos[-1] > 0


# =============================================================================== composition
COMPOSED = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=28,
                max_model_len=96, scheduling_policy="priority")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["draft_model_self", "ngram"])
def test_speculation_with_chunking_prefix_caching_preemption(mode, method, tiny_engine_models, tiny_eagle_heads,
                                                             make_llm, traced):
    """Speculation + chunked prefill (16-token budget: prompts split, drafts compete with chunks)
    + prefix caching + a pool of 28 blocks of 4 (preemption) + the priority policy: the tokens
    are those of the same engine without speculation. Then a second turn whose prompts extend the
    first outputs hits blocks whose K/V speculative steps wrote."""
    model_dir = tiny_engine_models["llama"][0]
    config = dict(COMPOSED, preemption_mode=mode, **({"swap_space": 0.01} if mode == "swap" else {}))
    prompts = token_prompts(1) + token_prompts(2)[:2]
    priorities = [2, 0, 1, 0, 2, 1]
    plain = make_llm(model_dir, **config)
    ref, ref_steps = traced(plain, prompts, GREEDY, priorities)
    llm = make_llm(model_dir, **config,
                   speculative_config=drafter_config(method, "llama", tiny_engine_models, tiny_eagle_heads))
    outputs, steps = traced(llm, prompts, GREEDY, priorities)
    assert tokens(outputs) == tokens(ref)
    so = [s.scheduler_output for s in steps]
    assert any(s.preempted_req_ids for s in so), "the tiny pool was supposed to force a preemption"
    if mode == "swap":
        assert any(s.blocks_to_swap_out for s in so) and any(s.blocks_to_swap_in for s in so)
    # Chunked prefill ran while other requests verified drafts.
    assert any(s.scheduled_spec_decode_tokens and any(r.req_id for r in s.scheduled_new_reqs) for s in so) or \
        any(s.scheduled_spec_decode_tokens and len(s.num_scheduled_tokens) > len(s.scheduled_spec_decode_tokens)
            for s in so)
    st = llm.llm_engine.engine_core.spec_decoding_stats.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
    # Second turn: prompt + first output (+ one token): prefix hits on speculatively written blocks.
    second = [p + o[:12] + [7] for p, o in zip(prompts, tokens(outputs))]
    again, _ = traced(llm, second, GREEDY)
    ref_again, _ = traced(plain, second, GREEDY)
    assert tokens(again) == tokens(ref_again)
    assert sum(o.num_cached_tokens for o in again) >= 4 * len(second)


# =============================================================================== sampling
def test_seeded_request_same_tokens_whatever_the_batch(tiny_engine_models, tiny_eagle_heads, make_llm, traced):
    model_dir = tiny_engine_models["qwen3"][0]
    # The target drafting for itself (greedy drafts): drafts in every step, accepted or not.
    llm = make_llm(model_dir, block_size=4,
                   speculative_config=drafter_config("draft_model_self", "qwen3", tiny_engine_models, tiny_eagle_heads))
    prompts = token_prompts(3)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=1234, max_tokens=MAX_NEW, ignore_eos=True)
    alone, _ = traced(llm, prompts[:1], seeded)
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 17, 30)]
    mixed, _ = traced(llm, prompts, [seeded] + others)
    assert alone[0].outputs[0].token_ids == mixed[0].outputs[0].token_ids
    assert mixed[0].metrics.spec_decoding is not None and mixed[0].metrics.spec_decoding.num_draft_tokens > 0
    # ... and it is a draw from its seed, not a constant: another seed gives other tokens.
    other_seed, _ = traced(llm, prompts[:1], SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=MAX_NEW,
                                                           ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def exact_joint(hf_model, prompt, num_tokens, top_k, temperature=1.0):
    """{token tuple: probability} of the first num_tokens sampled tokens under top-k + temperature,
    computed exactly from HF transformers (the oracle)."""
    joint = {(): 1.0}
    for _ in range(num_tokens):
        nxt = {}
        for prefix, p in joint.items():
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + list(prefix)])).logits[0, -1].float() / temperature
            top = logits.topk(top_k)
            probs = torch.softmax(top.values, -1)
            for t, q in zip(top.indices.tolist(), probs.tolist()):
                nxt[prefix + (t,)] = p * q
        joint = nxt
    return joint


def chi_square_pvalue(samples, joint) -> float:
    """Pearson's chi-square of the empirical counts against the exact joint; a sample outside its
    support fails at once (p = 0). Cells expected below 5 are pooled."""
    n = len(samples)
    counts = {}
    for s in samples:
        if s not in joint:
            return 0.0
        counts[s] = counts.get(s, 0) + 1
    cells = sorted(joint, key=joint.get, reverse=True)
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for c in cells:
        if joint[c] * n >= 5:
            observed.append(counts.get(c, 0))
            expected.append(joint[c] * n)
        else:
            pool_o += counts.get(c, 0)
            pool_e += joint[c] * n
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    observed, expected = np.array(observed, dtype=np.float64), np.array(expected) * (n / sum(expected))
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


NUM_SAMPLES = 4000
DIST_TOKENS, DIST_TOP_K = 3, 4


def sample_engine(llm, prompt, n):
    """n samples of the first DIST_TOKENS tokens (max_tokens one more, so that the third token is
    also produced by verification steps with two drafts, not only by a last plain step)."""
    params = SamplingParams(temperature=1.0, top_k=DIST_TOP_K, max_tokens=DIST_TOKENS + 1, ignore_eos=True,
                            detokenize=False)
    return [tuple(t[:DIST_TOKENS]) for t in tokens(llm.generate([prompt] * n, params, use_tqdm=False))]


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, tiny_checkpoint):
    """A tiny Llama with a 512-token vocabulary (sampling thousands of requests stays cheap); ids
    below 512 are SmolLM2 tokens, so the engine runs it with SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("small-vocab")
    return path, tiny_checkpoint(path, "llama", seed=3)


def test_sampled_distribution_through_the_engine(small_vocab_model, smollm2_dir, make_llm, monkeypatch):
    """4000 speculative samples of 3 tokens (temperature 1, top-k 4: 64 joint cells) with the target
    drafting greedily for itself (k = 2: its argmax is accepted with probability p(argmax), so
    accepted drafts, recovered tokens and bonus tokens all occur) follow the exact joint that HF
    transformers computes: Pearson chi-square p > 1e-3 (a correct engine fails 1 run in 1000).
    The same test catches an engine that accepts every draft (p < 1e-6): it has the power to see
    a broken verifier."""
    model_dir, hf = small_vocab_model
    prompt = [5, 77, 130, 402, 9, 77, 130, 311]
    joint = exact_joint(hf, prompt, DIST_TOKENS, DIST_TOP_K)
    config = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 2, "adaptive": False}
    llm = make_llm(model_dir, tokenizer=str(smollm2_dir), max_model_len=64, max_num_seqs=256, max_num_batched_tokens=4096,
                   num_gpu_blocks_override=1024, speculative_config=config)
    samples = sample_engine(llm, prompt, NUM_SAMPLES)
    st = llm.llm_engine.engine_core.spec_decoding_stats.stats
    assert st.num_draft_tokens > NUM_SAMPLES and 0.2 < st.acceptance_rate < 0.9
    assert st.num_accepted_tokens_per_pos[1] > 0                         # bonus tokens were drawn
    p_value = chi_square_pvalue(samples, joint)
    assert p_value > 1e-3, f"speculative samples do not follow the target distribution (p = {p_value:.2e})"

    # Power: accept every draft (the output then follows the drafter wherever it drafted).
    from spec_decode import RejectionSampler

    def accept_all(self, md, draft_probs, target_logits, bonus_token_ids, sampling_metadata, check_values=True):
        out = torch.full((md.batch_size, md.max_spec_len + 1), -1, dtype=torch.int32)
        for i, (k, end) in enumerate(zip(md.num_draft_tokens, md.cu_num_draft_tokens.tolist())):
            out[i, :k] = md.draft_token_ids[end - k:end]
            out[i, k] = bonus_token_ids[i]
        return out
    monkeypatch.setattr(RejectionSampler, "forward", accept_all)
    broken = sample_engine(llm, prompt, NUM_SAMPLES // 4)
    assert chi_square_pvalue(broken, joint) < 1e-6


def test_logprobs_and_stop_strings_as_without_speculation(tiny_engine_models, tiny_eagle_heads, make_llm):
    model_dir = tiny_engine_models["llama"][0]
    prompts = token_prompts(5)
    plain = make_llm(model_dir, block_size=4)
    spec = make_llm(model_dir, block_size=4, speculative_config=drafter_config(
        "draft_model_self", "llama", tiny_engine_models, tiny_eagle_heads))
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    ref, out = plain.generate(prompts, with_logprobs, use_tqdm=False), spec.generate(prompts, with_logprobs,
                                                                                     use_tqdm=False)
    for a, b in zip(ref, out):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].rank == lb[t].rank and math.isclose(la[t].logprob, lb[t].logprob, abs_tol=1e-4)
        assert math.isclose(a.cumulative_logprob, b.cumulative_logprob, abs_tol=1e-3)
    # A stop string completed by a token in the middle of an accepted run of drafts ends the
    # request there, as plain decoding does: same tokens, same text, same reason.
    text = ref[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop])
    a, b = plain.generate(prompts[:1], params, use_tqdm=False)[0], spec.generate(prompts[:1], params,
                                                                                 use_tqdm=False)[0]
    a, b = a.outputs[0], b.outputs[0]
    assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                      b.stop_reason)
    assert a.finish_reason == "stop" and len(a.token_ids) < MAX_NEW


# =============================================================================== metrics, turn-down
def test_metrics_per_request_and_engine(tiny_engine_models, tiny_eagle_heads, make_llm):
    model_dir = tiny_engine_models["qwen2"][0]
    llm = make_llm(model_dir, speculative_config=drafter_config("layer_skip", "qwen2", tiny_engine_models,
                                                                tiny_eagle_heads))
    outputs = llm.generate(token_prompts(6), GREEDY, use_tqdm=False)
    engine = llm.llm_engine.engine_core.spec_decoding_stats
    per_request = [o.metrics.spec_decoding for o in outputs]
    assert all(s is not None for s in per_request)
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(getattr(s, field) for s in per_request) == getattr(engine.stats, field)
    assert [sum(x) for x in zip(*(s.num_accepted_tokens_per_pos for s in per_request))] == \
        engine.stats.num_accepted_tokens_per_pos
    for o in outputs:
        m = o.metrics
        s = m.spec_decoding
        assert m.spec_acceptance_rate == s.num_accepted_tokens / s.num_draft_tokens
        assert math.isclose(m.spec_mean_acceptance_length, 1 + s.num_accepted_tokens / s.num_drafts)
        assert m.spec_drafting_time > 0 and m.spec_verification_time > 0
    assert engine.drafting_time > 0 and engine.verification_time > 0 and engine.num_verification_steps > 0
    assert "acceptance rate" in str(engine)


def test_adaptive_turn_down_and_disable_by_batch_size(tiny_engine_models, tiny_eagle_heads, make_llm):
    """An untrained EAGLE head's drafts are almost never accepted: with the adaptive draft length
    the engine soon stops proposing them (and probes now and then); without it every step
    verifies k drafts. Above disable_by_batch_size running requests nothing is drafted. The
    tokens never change."""
    model_dir = tiny_engine_models["llama"][0]
    prompts = token_prompts(7)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = tokens(make_llm(model_dir).generate(prompts, params, use_tqdm=False))
    runs = {}
    for name, extra in {"fixed": {}, "adaptive": {"adaptive": True},
                        "by-batch": {"disable_by_batch_size": 2}}.items():
        llm = make_llm(model_dir, speculative_config=drafter_config("eagle", "llama", tiny_engine_models,
                                                                    tiny_eagle_heads, **extra))
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == ref
        runs[name] = llm.llm_engine.engine_core.spec_decoding_stats
    fixed, adaptive, by_batch = runs["fixed"], runs["adaptive"], runs["by-batch"]
    assert fixed.stats.acceptance_rate < 0.2
    assert adaptive.stats.num_draft_tokens < fixed.stats.num_draft_tokens / 3
    assert adaptive.stats.num_draft_tokens > 0                      # it probes
    # 4 requests run together until the end: more than 2 running -> no drafts at all.
    assert by_batch.num_disabled_steps > 0 and by_batch.stats.num_draft_tokens == 0


# =============================================================================== bad input
@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/draft"}, "is not a directory"),
    ({"method": "eagle", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "are for method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_layers": 3}, "num_layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_draft_acceptance": 1.5}, "min_draft_acceptance"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def test_ngram_defaults_are_vllms():
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4}).speculative_config
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                         "prompt_lookup_max": 3}).speculative_config
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert EngineConfig(speculative_config=c).scheduler_config(64).num_lookahead_tokens == 4


def test_drafters_that_cannot_serve_the_target_fail_at_construction(tiny_engine_models, tiny_checkpoint,
                                                                    tmp_path, make_llm):
    from mini_vllm import LLM

    llama = tiny_engine_models["llama"][0]
    # Another vocabulary size.
    tiny_checkpoint(tmp_path / "vocab512", "llama")          # vocab 512, no tokenizer
    with pytest.raises(ValueError, match="vocabulary has 512 tokens"):
        LLM(str(llama), max_model_len=64, speculative_config={
            "method": "draft_model", "model": str(tmp_path / "vocab512"), "num_speculative_tokens": 2})
    # Same size, another tokenizer (two tokens' ids swapped).
    other = tmp_path / "other-tokenizer"
    tiny_checkpoint(other, "llama", vocab_size=49152)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(llama)
    tok.save_pretrained(other)
    import json
    path = other / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="maps tokens to different ids"):
        LLM(str(llama), max_model_len=64, speculative_config={
            "method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    # The SmolLM2 EAGLE head (hidden 576) on a hidden-64 model.
    with pytest.raises(ValueError, match="hidden size 576; this model's is 64"):
        LLM(str(llama), max_model_len=64, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="must be fewer than the target's 2 layers"):
        LLM(str(llama), max_model_len=64, speculative_config={"method": "layer_skip", "num_layers": 2,
                                                                "num_speculative_tokens": 2})


@pytest.mark.parametrize("fault", ["out-of-range", "raises"])
def test_a_failing_drafter_costs_only_its_request_its_drafts(fault, tiny_engine_models, tiny_eagle_heads,
                                                            make_llm, traced):
    model_dir = tiny_engine_models["qwen2"][0]
    prompts = token_prompts(8)
    ref = baseline(make_llm, model_dir, ("greedy-qwen2-faults",), prompts, block_size=4)
    llm = make_llm(model_dir, block_size=4, speculative_config=drafter_config(
        "draft_model_self", "qwen2", tiny_engine_models, tiny_eagle_heads))
    worker = llm.llm_engine.engine_core.model_runner.spec_decode
    real_propose = worker.proposer.propose
    victim = "t1"

    def faulty(requests):
        drafts = real_propose(requests)
        if any(r.req_id == victim for r in requests):
            if fault == "raises":
                raise RuntimeError("drafter bug")
            drafts = [[10 ** 9] * len(d) if r.req_id == victim else d for r, d in zip(requests, drafts)]
        return drafts
    worker.proposer.propose = faulty
    outputs, steps = traced(llm, prompts, GREEDY)
    assert tokens(outputs) == ref
    assert llm.llm_engine.engine_core.spec_decoding_stats.num_drafter_faults > 0
    drafted = {r for s in steps for r in s.scheduler_output.scheduled_spec_decode_tokens}
    assert victim not in drafted and {"t0", "t2", "t3"} <= drafted
    assert outputs[1].metrics.spec_decoding is None and outputs[0].metrics.spec_acceptance_rate > 0.9


# =============================================================================== SmolLM2
SMOL_CHATS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Fix the typo and print the code again:\ndef add(a, b):\n    retrun a + b\n",
    "Write one sentence about the sea.",
]


@pytest.fixture(scope="module")
def smol_prompts(smollm2_tokenizer):
    texts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                   add_generation_prompt=True) for c in SMOL_CHATS]
    return [{"prompt_token_ids": smollm2_tokenizer(t, add_special_tokens=False).input_ids} for t in texts]


@pytest.mark.model
@pytest.mark.parametrize("method", ["ngram", "eagle", "layer_skip", "draft_model"])
def test_smollm2_greedy_identical_with_every_drafter(method, smollm2_dir, smol_prompts, tiny_engine_models, make_llm):
    """On the real model: the committed EAGLE head, the 8-layer self-draft, and a tiny random Llama
    with SmolLM2's tokenizer as the draft checkpoint."""
    config = {"ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
              "eagle": {"method": "eagle"},
              "layer_skip": {"method": "layer_skip", "num_layers": 8},
              "draft_model": {"method": "draft_model", "model": str(tiny_engine_models["llama"][0])}}[method]
    params = SamplingParams(temperature=0, max_tokens=32)
    ref = baseline(make_llm, smollm2_dir, ("smollm2",), smol_prompts, params)
    llm = make_llm(smollm2_dir, speculative_config={**config, "num_speculative_tokens": 4, "adaptive": False})
    outputs = llm.generate(smol_prompts, params, use_tqdm=False)
    assert tokens(outputs) == ref
    st = llm.llm_engine.engine_core.spec_decoding_stats.stats
    assert st.num_draft_tokens > 0
    if method == "ngram":
        assert outputs[0].metrics.spec_acceptance_rate > 0.5      # the copy task: drafts are the answer


# =============================================================================== EAGLE-2 trees
TREE = {"tree_depth": 3, "tree_top_k": 3}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_drafts_greedy_identical_and_penalised_requests_get_chains(arch, tiny_engine_models, tiny_eagle_heads,
                                                                         make_llm, traced):
    """EAGLE-2 trees through the engine (positions root + depth, the tree mask, tree verification)
    on the tiny models: the greedy tokens are the plain engine's; a request with a repetition
    penalty in the same batch gets a chain (its draft rows' penalties see a chain's outputs)."""
    model_dir = tiny_engine_models[arch][0]
    prompts = token_prompts(4)
    params = [GREEDY] * 3 + [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3)]
    plain = make_llm(model_dir, block_size=4)
    ref, _ = traced(plain, prompts, params)
    llm = make_llm(model_dir, block_size=4, speculative_config=drafter_config(
        "eagle", arch, tiny_engine_models, tiny_eagle_heads, num_speculative_tokens=6, **TREE))
    outputs, steps = traced(llm, prompts, params)
    assert tokens(outputs) == tokens(ref)
    runner = llm.llm_engine.engine_core.model_runner
    st = llm.llm_engine.engine_core.spec_decoding_stats.stats
    assert st.num_draft_tokens > 0
    penalised = outputs[3].request_id
    spec = [s.scheduler_output.scheduled_spec_decode_tokens for s in steps]
    assert max(len(d.get(penalised, [])) for d in spec) <= 6
    assert any(len(v) > 3 for d in spec for r, v in d.items() if r != penalised), "no tree had more nodes than depth"
    assert runner.spec_decode.adaptive is None                       # a tree's shape is its own adaptive length


@pytest.fixture(scope="module")
def smol_tree_prompts(smollm2_tokenizer):
    chats = ["Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
             "Write a short story about a lighthouse keeper.", "What is the capital of France?",
             "List three colours of the rainbow."]
    texts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                   add_generation_prompt=True) for c in chats]
    return [smollm2_tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@pytest.mark.model
def test_smollm2_tree_greedy_identical_with_chunking_prefix_caching_preemption(smollm2_dir, smol_tree_prompts,
                                                                                make_llm, traced):
    """The shipped head's trees on the real model, composed with chunked prefill (a 16-token budget),
    prefix caching (a second turn over blocks tree steps wrote) and preemption (a pool too small for
    every request): the tokens and their logprobs are the plain engine's, drafts are accepted, and
    some accepted node was not its parent's first child (its K/V moved to the chain slot)."""
    config = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=30,
                  max_model_len=160)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    plain = make_llm(smollm2_dir, **config)
    ref, _ = traced(plain, smol_tree_prompts, params)
    llm = make_llm(smollm2_dir, **config, speculative_config={"method": "eagle", "num_speculative_tokens": 8,
                                                              "tree_depth": 4, "tree_top_k": 3})
    outputs, steps = traced(llm, smol_tree_prompts, params)
    assert tokens(outputs) == tokens(ref)
    for o, r in zip(outputs, ref):
        for got, want in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-3 for t in got)
    assert any(s.scheduler_output.preempted_req_ids for s in steps), "the small pool was to force a preemption"
    st = llm.llm_engine.engine_core.spec_decoding_stats.stats
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens_per_pos[1] > 0
    assert llm.llm_engine.engine_core.model_runner.num_tree_kv_moves > 0
    second = [p + o[:16] for p, o in zip(smol_tree_prompts, tokens(outputs))]
    again, _ = traced(llm, second, params)
    ref_again, _ = traced(plain, second, params)
    assert tokens(again) == tokens(ref_again)
    assert sum(o.num_cached_tokens for o in again) >= 16 * len(second)


def test_tree_sampled_distribution_through_the_engine(small_vocab_model, smollm2_dir, make_llm, monkeypatch,
                                                      tmp_path):
    """Sampled verification of trees (chapter 04's verify_tree_random: siblings tried in turn against
    the residual) keeps the target's exact joint: 2000 samples of 3 tokens, chi-square p > 1e-3. The
    head is trained here (chapter 04's train_eagle, a few seconds) on the target's own samples from
    this prompt, over a draft vocabulary of the tokens the joint can produce, so nodes at both
    depths are accepted; accepting every first child fails the same test."""
    from spec_decode import train_eagle as te

    model_dir, hf = small_vocab_model
    prompt = [5, 77, 130, 402, 9, 77, 130, 311]
    joint = exact_joint(hf, prompt, DIST_TOKENS, DIST_TOP_K)
    vocab = torch.tensor(sorted({t for cell in joint for t in cell}))
    g = torch.Generator().manual_seed(0)
    cells = list(joint)
    draws = torch.multinomial(torch.tensor([joint[c] for c in cells]), 96, replacement=True, generator=g)
    seqs = [prompt + list(cells[i]) for i in draws.tolist()]
    torch.manual_seed(7)
    head = te.head_for_target(hf, 64, vocab)
    te.train(head, hf, seqs, [len(prompt)] * len(seqs), te.features(hf, seqs), steps=150, batch=16, lr=3e-3,
             window=16, unroll=2, ce_weight=1.0, seed=0, log=lambda _: None)
    head.save_pretrained(tmp_path, dtype=torch.float32)
    config = {"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 6, "tree_depth": 2,
              "tree_top_k": 3}
    llm = make_llm(model_dir, tokenizer=str(smollm2_dir), max_model_len=64, max_num_seqs=256,
                   max_num_batched_tokens=4096, num_gpu_blocks_override=1024, speculative_config=config)
    samples = sample_engine(llm, prompt, NUM_SAMPLES // 2)
    st = llm.llm_engine.engine_core.spec_decoding_stats.stats
    assert st.num_accepted_tokens_per_pos[0] > NUM_SAMPLES // 20 and st.num_accepted_tokens_per_pos[1] > 0
    p_value = chi_square_pvalue(samples, joint)
    assert p_value > 1e-3, f"tree-speculative samples do not follow the target distribution (p = {p_value:.2e})"

    import spec_decode.tree as tree_module
    import mini_vllm.spec_decode_worker as worker_module

    def first_child_always(tokens_, parents, target_probs, uniform, inv_exp):
        accepted, node = [], 0
        while (children := [c for c in range(1, len(parents)) if parents[c] == node]):
            accepted.append(children[0])
            node = children[0]
        return accepted, [tokens_[a] for a in accepted] + [tree_module.race(target_probs[node], inv_exp)]
    monkeypatch.setattr(worker_module, "verify_tree_random", first_child_always)
    broken = sample_engine(llm, prompt, NUM_SAMPLES // 8)
    assert chi_square_pvalue(broken, joint) < 1e-6


@pytest.mark.parametrize("config, extra, message", [
    ({"method": "ngram", "num_speculative_tokens": 4, "tree_depth": 3}, {}, "method 'eagle' only"),
    ({"method": "eagle", "num_speculative_tokens": 4, "tree_top_k": 3}, {}, "needs tree_depth"),
    ({"method": "eagle", "num_speculative_tokens": 4, "tree_depth": 0}, {}, "integers >= 1"),
    ({"method": "eagle", "num_speculative_tokens": 4, "tree_depth": 3}, {"async_scheduling": True},
     "synchronous scheduling only"),
    ({"method": "eagle", "num_speculative_tokens": 4, "tree_depth": 3}, {"pipeline_parallel_size": 2},
     "only the last pipeline stage"),
])
def test_bad_tree_configs(config, extra, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=None, speculative_config=config, **extra)
