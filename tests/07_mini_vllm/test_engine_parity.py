"""Parity through the whole engine: LLM.generate (scheduler, KV cache manager, model runner,
sampler) against HF transformers' greedy `generate` on the same weights, token for token.

Every configuration that changes the path a token takes is covered: prefix caching on/off,
chunked prefill on/off (and chunks small enough to split every prompt), and forced preemption
through a tiny KV pool, by recompute and by swap, and with async scheduling. The same prompts must give the same tokens in
all of them: a KV write to a wrong slot, a stale prefix hit, a chunk boundary off by one, or a
resumed request missing a token would all change a greedy continuation.

HF runs each prompt alone (batch 1: no padding in the oracle) and stops at EOS; ours runs them
batched with ignore_eos, so ours is compared up to HF's length (`assert_same_greedy`).
"""
from __future__ import annotations

import pytest

from mini_vllm import SamplingParams

MAX_NEW = 12
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "Prefix caching shares the KV cache of a common prompt prefix. Prefix caching shares the KV cache of",
]

# name -> EngineConfig overrides. block_size 4 everywhere: many blocks per prompt, blocks opened mid-step.
CONFIGS = {
    "default": dict(),
    "no-prefix-no-chunk": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    "small-chunks": dict(max_num_batched_tokens=8, max_num_seqs=4),
    "preempt-recompute": dict(num_gpu_blocks_override=14, max_model_len=64),
    "preempt-swap": dict(num_gpu_blocks_override=14, max_model_len=64, preemption_mode="swap", swap_space=0.01),
    # Async scheduling (step N+1 planned while N runs, placeholders for N's tokens), through preemption.
    "preempt-async": dict(num_gpu_blocks_override=14, max_model_len=64, async_scheduling=True),
}


def prompts_for(tokenizer):
    shared = tokenizer(TEXTS[3]).input_ids
    return [tokenizer(t).input_ids for t in TEXTS] + [shared + tokenizer(" the system prompt").input_ids]


def check_engine_matches_hf(make_llm, traced, hf_oracle, model_dir, hf_model, config_name, dtype="float32"):
    hf_greedy, assert_same_greedy = hf_oracle
    llm = make_llm(model_dir, block_size=4, dtype=dtype, **CONFIGS[config_name])
    prompts = prompts_for(llm.get_tokenizer())
    outputs, steps = traced(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    eos = llm.llm_engine.model_config.eos_token_ids
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == MAX_NEW
        assert_same_greedy(out.outputs[0].token_ids, hf_greedy(hf_model, prompt, MAX_NEW), MAX_NEW, eos,
                           f"{config_name}: {prompt[:6]}...")
    so = [s.scheduler_output for s in steps]
    if config_name.startswith("preempt"):
        assert any(s.preempted_req_ids for s in so), "the tiny pool was supposed to force a preemption"
    if config_name == "preempt-async":
        assert llm.llm_engine.engine_core.num_batches_overlapped > 0, "async scheduling never had two batches in flight"
    if config_name == "preempt-swap":
        assert any(s.blocks_to_swap_out for s in so) and any(s.blocks_to_swap_in for s in so)
    if config_name == "small-chunks":
        # Every prompt longer than the budget was split: some step ran part of a prompt without sampling.
        assert max(s.total_num_scheduled_tokens for s in so) <= 8
    if config_name == "default":
        # Prompt 5 starts with prompt 4. Prompt 4 is admitted first; its blocks are cached only once
        # computed, so prompt 5 waits one step for them (instead of computing them again) and hits.
        # A later run hits the cache too.
        assert outputs[4].num_cached_tokens >= 16
        first_step = so[0]
        assert {r.req_id for r in first_step.scheduled_new_reqs} == {"t0", "t1", "t2", "t3"}
        again, _ = traced(llm, prompts[3:], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
        assert again[0].num_cached_tokens >= 16 and again[1].num_cached_tokens >= 16
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs[3:]]
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_tiny_architectures_match_hf(arch, config_name, tiny_engine_models, make_llm, traced, hf_oracle):
    model_dir, hf_model = tiny_engine_models[arch]
    check_engine_matches_hf(make_llm, traced, hf_oracle, model_dir, hf_model, config_name)


@pytest.mark.model
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_smollm2_matches_hf(config_name, smollm2_dir, smollm2_hf, make_llm, traced, hf_oracle):
    check_engine_matches_hf(make_llm, traced, hf_oracle, smollm2_dir, smollm2_hf, config_name)
