"""One request cannot hurt the others: a reused request id gets its
NEW sampling settings; bad prompt ids are refused on every path; a fault injected while
preparing, running or sampling ONE request finishes that request with finish_reason "error"
and a message, frees its blocks, and leaves every other request's tokens exactly as they are
without the faulty one; seeded sampling does not depend on the batch; scheduling policies and
priorities work through LLM. Tiny random Llama with SmolLM2's tokenizer; the autouse fixture
checks after every test that every KV block is free again."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mini_vllm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
POISON = 4242          # a token id that makes the injected faults fire


@pytest.fixture(scope="module")
def tiny(tiny_engine_models):
    return tiny_engine_models["llama"]


@pytest.fixture(scope="module")
def llm(tiny, make_llm):
    return make_llm(tiny[0], block_size=4, max_num_seqs=8, num_gpu_blocks_override=256, max_model_len=128)


def prompts(n, length=9, start=100):
    return [[start + 31 * i + t for t in range(length)] for i in range(n)]


def run_engine(engine, requests):
    """requests: [(request_id, prompt ids, params)] -> {request_id: final RequestOutput}."""
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    finals = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the engine stopped making progress"
    return finals


# ------------------------------------------------------------------------------ item 2
def test_a_reused_request_id_samples_with_its_new_settings(llm):
    engine = llm.llm_engine
    ids = prompts(1)[0]
    first = run_engine(engine, [("a", ids, GREEDY)])["a"]
    hot = SamplingParams(temperature=5.0, seed=123, logprobs=2, max_tokens=8, ignore_eos=True)
    again = run_engine(engine, [("a", ids, hot)])["a"]
    fresh = run_engine(engine, [("b", ids, hot)])["b"]          # the same request under a new id
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids != first.outputs[0].token_ids
    assert again.outputs[0].logprobs is not None and len(again.outputs[0].logprobs) == 8
    assert all(len(entry) >= 2 for entry in again.outputs[0].logprobs)


# ------------------------------------------------------------------------------ item 3: validation
def test_bad_prompt_ids_are_refused_on_every_path_and_the_engine_keeps_serving(llm):
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    for bad in ([5, 10**6], [-1, 5], [], [5, "x"]):
        with pytest.raises((ValueError, TypeError)):
            engine.add_request("bad", {"prompt_token_ids": bad}, GREEDY)
        with pytest.raises((ValueError, TypeError)):
            engine.add_request("bad", "ignored text", GREEDY, prompt_token_ids=bad)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("bad", "text", GREEDY, prompt_token_ids=[1, vocab])
    assert not engine.has_unfinished_requests()
    out = run_engine(engine, [("ok", prompts(1)[0], GREEDY)])["ok"]
    assert len(out.outputs[0].token_ids) == 8


# ------------------------------------------------------------------------------ item 3: injected faults
def baseline(llm, batch):
    return {rid: out.outputs[0].token_ids for rid, out in run_engine(llm.llm_engine, batch).items()}


def check_isolated(finals, expect, bad_id, message):
    bad = finals[bad_id].outputs[0]
    assert bad.finish_reason == "error" and message in str(bad.stop_reason), bad
    for rid, tokens in expect.items():
        assert finals[rid].outputs[0].finish_reason == "length"
        assert finals[rid].outputs[0].token_ids == tokens, rid


def test_a_forward_pass_that_raises_for_one_request_fails_only_that_request(llm, monkeypatch):
    good = [(f"g{i}", ids, GREEDY) for i, ids in enumerate(prompts(5))]
    expect = baseline(llm, good)
    model = llm.llm_engine.engine_core.model_runner.model
    real_forward = model.forward

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected fault: poisoned token in the batch")
        return real_forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    bad_prompt = prompts(1, start=900)[0]
    bad_prompt[4] = POISON
    finals = run_engine(llm.llm_engine, good[:3] + [("bad", bad_prompt, GREEDY)] + good[3:])
    check_isolated(finals, expect, "bad", "injected fault: poisoned token")


def test_a_fault_in_the_middle_of_decoding_fails_only_that_request(llm, monkeypatch):
    """The fault fires at the bad request's 4th generated token: earlier steps ran it fine."""
    good = [(f"g{i}", ids, GREEDY) for i, ids in enumerate(prompts(3))]
    expect = baseline(llm, good)
    runner = llm.llm_engine.engine_core.model_runner
    real = runner.input_batch.prepare_inputs

    def prepare_inputs(num_scheduled, block_size, device="cpu", rows=None):
        batch = runner.input_batch
        rows_ = np.arange(batch.num_reqs) if rows is None else rows
        for r in rows_:
            if batch.req_ids[r] == "bad" and batch.num_tokens[r] >= 9 + 4:
                raise IndexError("injected fault while preparing the bad request")
        return real(num_scheduled, block_size, device, rows)

    monkeypatch.setattr(runner.input_batch, "prepare_inputs", prepare_inputs)
    finals = run_engine(llm.llm_engine, good[:1] + [("bad", prompts(1, start=700)[0], GREEDY)] + good[1:])
    check_isolated(finals, expect, "bad", "injected fault while preparing")
    assert len(finals["bad"].outputs[0].token_ids) == 4        # what it produced before the fault is kept


def test_a_state_that_cannot_be_applied_fails_only_that_request(llm, monkeypatch):
    good = [(f"g{i}", ids, GREEDY) for i, ids in enumerate(prompts(3))]
    expect = baseline(llm, good)
    batch = llm.llm_engine.engine_core.model_runner.input_batch
    real_add = batch.add_request

    def add_request(state):
        if state.req_id == "bad":
            raise ValueError("injected fault: this request's state is corrupt")
        return real_add(state)

    monkeypatch.setattr(batch, "add_request", add_request)
    finals = run_engine(llm.llm_engine, good + [("bad", prompts(1, start=800)[0], GREEDY)])
    check_isolated(finals, expect, "bad", "state is corrupt")


def test_a_sampler_fault_for_one_row_fails_only_that_request(llm, monkeypatch):
    sampled = SamplingParams(temperature=0.7, seed=7, max_tokens=8, ignore_eos=True)
    good = [(f"g{i}", ids, sampled if i % 2 else GREEDY) for i, ids in enumerate(prompts(4))]
    expect = baseline(llm, good)
    sampler = llm.llm_engine.engine_core.model_runner.sampler
    real = sampler.forward

    def forward(logits, metadata, *output_tokens):
        if any(rid == "bad" for rid in metadata.req_ids):
            raise RuntimeError("injected fault in the sampler")
        return real(logits, metadata, *output_tokens)

    monkeypatch.setattr(sampler, "forward", forward)
    bad = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=8, ignore_eos=True)
    finals = run_engine(llm.llm_engine, good[:2] + [("bad", prompts(1, start=600)[0], bad)] + good[2:])
    check_isolated(finals, expect, "bad", "injected fault in the sampler")


# ------------------------------------------------------------------------------ item 8 and sampling
TINY_TEMPERATURE_SCRIPT = """
import json, sys
from mini_vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=4)
prompts = ["The capital of France is", "def fibonacci(n):"]
runs = [(0.0, {}), (1e-6, {}), (1e-7, dict(top_p=0.9)), (1.2e-38, {}), (1.2e-38, dict(top_k=5)),
        (1e-39, dict(top_p=0.5, top_k=3))]
out = [[o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=t, max_tokens=6,
        ignore_eos=True, **kw), use_tqdm=False)] for t, kw in runs]
print(json.dumps(out))
"""


@pytest.mark.model
def test_a_tiny_temperature_is_greedy(smollm2_dir):
    """A temperature below 1e-5 acts as greedy (vLLM's _SAMPLING_EPS). On SmolLM2's real logits
    (tens of nats apart) logits / 1.2e-38 overflows fp32 to inf and the softmax to NaN: without
    the rule the "sample" is garbage (all token 0). Run in a fresh interpreter: inside the pytest
    process the old code happened to come out greedy (cause not identified), so a test there
    could not fail."""
    import json
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", TINY_TEMPERATURE_SCRIPT, str(smollm2_dir)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    greedy, *tiny = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(run == greedy for run in tiny), (greedy, tiny)


def test_seeded_sampling_is_the_same_alone_and_inside_a_64_request_batch(tiny, make_llm):
    llm = make_llm(tiny[0], block_size=4, max_num_seqs=64, num_gpu_blocks_override=1024, max_model_len=128)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=2024, max_tokens=10, ignore_eos=True)
    target = prompts(1, start=300)[0]
    alone = baseline(llm, [("x", target, seeded)])["x"]
    crowd = [(f"c{i}", ids, SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True) if i % 3
              else SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True))
             for i, ids in enumerate(prompts(63, length=5, start=1000))]
    finals = run_engine(llm.llm_engine, crowd[:30] + [("x", target, seeded)] + crowd[30:])
    assert finals["x"].outputs[0].token_ids == alone


# ------------------------------------------------------------------------------ policies through LLM
def test_priority_policy_through_llm_serves_lower_priority_values_first(tiny, make_llm):
    llm = make_llm(tiny[0], block_size=4, max_num_seqs=1, num_gpu_blocks_override=64, max_model_len=128,
                   scheduling_policy="priority", enable_chunked_prefill=False, max_num_batched_tokens=128)
    ps = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)] * 4
    outs = llm.generate(prompts(4), ps, use_tqdm=False, priority=[3, 0, 2, 1])
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 3, 2, 0]
    for policy in ("fcfs", "srtf", "two_level"):
        other = make_llm(tiny[0], block_size=4, max_num_seqs=2, num_gpu_blocks_override=64, max_model_len=128,
                         scheduling_policy=policy)
        assert [o.outputs[0].token_ids for o in other.generate(prompts(4), ps, use_tqdm=False)] == \
               [o.outputs[0].token_ids for o in outs]


def test_bf16_end_to_end_matches_hf_bf16_logits(tiny, make_llm):
    """bf16 through the whole engine: KV caches in bf16, and the first token's log-probabilities
    match HF transformers run in bf16 on the same weights within bf16's resolution."""
    from transformers import AutoModelForCausalLM
    llm = make_llm(tiny[0], dtype="bfloat16", block_size=4, max_num_seqs=4, num_gpu_blocks_override=64,
                   max_model_len=128)
    assert llm.llm_engine.engine_core.model_runner.kv_caches[0][0].dtype == torch.bfloat16
    ids = prompts(2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.bfloat16).eval()
    for p, out in zip(ids, outs):
        with torch.inference_mode():
            ref = hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        first = out.outputs[0].logprobs[0]
        for token_id, lp in first.items():
            assert abs(lp.logprob - ref[token_id].item()) < 0.1, (token_id, lp.logprob, ref[token_id].item())
        assert out.outputs[0].token_ids[0] == int(ref.argmax())
