"""Parallel sampling (n > 1): n child requests from the front end, the prompt shared by the prefix
cache (parallel_sampling.py).

The truth kept: child i of a request with seed s must produce exactly the tokens of an
independent request with seed s + i (vLLM's seeding of children) — so any K/V a child reads
that is not its own (a cached block of the wrong prompt, a block freed while another child still
holds it) changes its tokens. Checked with the prompt's last block partly filled (the block each
child computes itself), through chunked prefill, a pool small enough to preempt, and max_num_seqs
too small for all children at once. Also: the prompt is computed in full once, the other children
compute only its partial last block, sharing holds fewer blocks than independent requests, every
block is free after each test (tests/conftest.py), and bad n values are refused.
Distributional: unseeded children's first tokens follow the model's distribution, and two
children of one request are independent (their joint distribution is the product).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sampling_oracle import bhc_eps

from mini_vllm import SamplingParams

N, MAX_NEW, SEED = 4, 10, 7
CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=8, max_num_seqs=8),
    "preempt": dict(num_gpu_blocks_override=11, max_model_len=64),
    "few-seqs": dict(max_num_seqs=2),
}


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=1.0, top_k=40, max_tokens=MAX_NEW, ignore_eos=True), **kw})


@pytest.mark.parametrize("config", list(CONFIGS))
def test_children_equal_independent_seeded_requests(config, tiny_engine_models, make_llm, traced):
    model_dir, _ = tiny_engine_models["llama"]
    llm = make_llm(model_dir, block_size=4, **CONFIGS[config])
    prompt = llm.get_tokenizer()("Parallel sampling shares the prompt's blocks between children").input_ids
    assert len(prompt) % 4, "the prompt's last block must be partly filled: the block children copy"
    alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * N,
                                                          [sampled(seed=SEED + i) for i in range(N)], use_tqdm=False)]
    assert len({tuple(t) for t in alone}) == N, "seeds must give different samples: the test would prove little"
    llm.reset_prefix_cache()
    (out,), steps = traced(llm, [{"prompt_token_ids": prompt}], sampled(seed=SEED, n=N))
    assert out.request_id == "t0" and [c.index for c in out.outputs] == list(range(N)) and out.finished
    assert [c.token_ids for c in out.outputs] == alone
    assert all(c.finish_reason == "length" for c in out.outputs)
    so = [s.scheduler_output for s in steps]
    computed = {f"{i}_t0": sum(s.num_scheduled_tokens.get(f"{i}_t0", 0) for s in so) for i in range(N)}
    assert set().union(*(s.num_scheduled_tokens for s in so)) == set(computed), "the core sees the children only"
    if config != "preempt":
        # Child 0 computes the prompt; the others hit its full blocks and compute the partial last block.
        assert computed == {"0_t0": len(prompt) + MAX_NEW - 1,
                            **{f"{i}_t0": len(prompt) % 4 + MAX_NEW - 1 for i in range(1, N)}}, computed
    else:
        assert any(s.preempted_req_ids for s in so)


def test_sharing_holds_fewer_blocks_than_independent_requests(tiny_engine_models, make_llm, traced):
    """Peak blocks in use: an n > 1 request (its children share the prompt's full blocks through the
    prefix cache) against n independent requests on an engine without the prefix cache."""
    model_dir, _ = tiny_engine_models["qwen3"]
    llm = make_llm(model_dir, block_size=4)
    unshared = make_llm(model_dir, block_size=4, enable_prefix_caching=False)
    prompt = llm.get_tokenizer()("A long shared prompt " * 8).input_ids

    def peak(prompts, params, llm=llm):
        engine, used = llm.llm_engine, 0
        pool = engine.engine_core.kv_cache_manager.block_pool
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        while engine.has_unfinished_requests():
            engine.step()
            used = max(used, pool.num_blocks - pool.get_num_free_blocks())
        return used
    shared = peak([prompt], [sampled(seed=1, n=N)])
    independent = peak([prompt] * N, [sampled(seed=1 + i) for i in range(N)], unshared)
    blocks_per_prompt = -(-len(prompt) // 4)
    assert independent - shared >= (N - 1) * (blocks_per_prompt - 1), (shared, independent)


def test_one_token_children_finish_even_when_they_wait_for_room(tiny_engine_models, make_llm):
    """max_tokens=1 with max_num_seqs below the children's count: every child gets its one token."""
    llm = make_llm(tiny_engine_models["llama"][0], max_num_seqs=2)
    outs = llm.generate(["one token each"] * 3, sampled(n=4, max_tokens=1, seed=5), use_tqdm=False)
    assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for o in outs for c in o.outputs)
    assert not llm.llm_engine.engine_core.scheduler.waiting


def test_children_sample_the_model_and_are_independent(tiny_engine_models, make_llm):
    """4000 first tokens (500 requests, n = 8, temperature 1, top-k 4 so there are 4 outcomes)
    against the model's own top-4 distribution q; the 2000 disjoint child pairs (0, 1), (2, 3), ...
    against q ⊗ q. Bound: Bretagnolle–Huber–Carol at a false-failure probability of 10⁻⁶, as the
    sampler's tests; the power checks say a sampler that gave children the same token, or sampled
    greedily, would be far outside it."""
    model_dir, hf = tiny_engine_models["llama"]
    llm = make_llm(model_dir, max_num_seqs=128)
    prompt = llm.get_tokenizer()("Independent children").input_ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double()
    top = torch.topk(logits, 4)
    q = torch.softmax(top.values, -1).numpy()                                       # [4]
    index = {t: i for i, t in enumerate(top.indices.tolist())}
    params = SamplingParams(n=8, temperature=1.0, top_k=4, max_tokens=1)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 500, params, use_tqdm=False)
    first = np.array([[index[c.token_ids[0]] for c in o.outputs] for o in outs])    # [500, 8]
    marginal = np.bincount(first.ravel(), minlength=4) / first.size
    pairs = first.reshape(-1, 2)                                                    # [2000, 2]
    joint = np.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16) / len(pairs)
    product = np.outer(q, q).ravel()
    eps_marginal, eps_joint = bhc_eps(4, first.size), bhc_eps(16, len(pairs))
    assert np.abs(marginal - q).sum() < eps_marginal, (marginal, q)
    assert np.abs(joint - product).sum() < eps_joint, (joint.reshape(4, 4), np.outer(q, q))
    same_token = np.diag(q).ravel()                      # children that copied each other
    assert np.abs(same_token - product).sum() > 2 * eps_joint
    greedy = np.eye(4)[0]
    assert np.abs(greedy - q).sum() > 2 * eps_marginal


def test_logprobs_stop_and_abort_per_child(tiny_engine_models, make_llm):
    model_dir, _ = tiny_engine_models["llama"]
    llm = make_llm(model_dir, block_size=4)
    engine = llm.llm_engine
    out = llm.generate("Hello there", sampled(seed=3, n=3, logprobs=2), use_tqdm=False)[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == MAX_NEW
        assert all(t in entry for t, entry in zip(c.token_ids, c.logprobs))
    # A stop token that child 1 produces first ends child 1 alone.
    stop = out.outputs[1].token_ids[0]
    again = llm.generate("Hello there", sampled(seed=3, n=3, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert again.outputs[1].token_ids == [stop] and again.outputs[1].finish_reason == "stop"
    for c, before in zip(again.outputs, out.outputs):
        assert c.token_ids == before.token_ids[:len(c.token_ids)]
    # Aborting the parent mid-flight aborts every child (tests/conftest.py checks every block is free).
    engine.add_request("p", "Hello there", sampled(seed=3, n=3, max_tokens=50))
    for _ in range(3):
        engine.step()
    engine.abort_request("p")
    assert not engine.has_unfinished_requests()


def test_bad_n(tiny_engine_models, make_llm):
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0)
    llm = make_llm(tiny_engine_models["llama"][0])
    llm.llm_engine.add_request("1_x", "taken", sampled())
    with pytest.raises(ValueError, match=r"its children's ids \['1_x'\] are in use"):
        llm.llm_engine.add_request("x", "hello", sampled(n=2))
    llm.llm_engine.abort_request("1_x")
