"""prompt_logprobs: every prompt token's log-probability given the tokens before it (and the top
k), against HF's log_softmax over the same prompt — with the prompt split into chunks, with a
prefix that the cache already holds (vLLM's caveat: the request computes its whole prompt instead
of reading cached K/V that comes without logits), and through a recompute preemption."""
from __future__ import annotations

import pytest
import torch

from mini_vllm import SamplingParams
from tolerances import assert_close


def check_prompt_logprobs(out, prompt: list[int], hf_model, k: int) -> None:
    ref = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)          # [L, V]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        token, entry = prompt[i], plp[i]
        want = ref[i - 1]
        assert_close(torch.tensor(entry[token].logprob), want[token], dtype=torch.float32)
        assert entry[token].rank == int((want >= want[token]).sum())
        top = want.topk(k)
        others = [t for t in entry if t != token or entry[t].rank <= k]
        assert set(top.indices.tolist()) <= set(entry) and len(others) <= k + 1
        assert_close(torch.tensor([entry[t].logprob for t in top.indices.tolist()]), top.values, dtype=torch.float32)


@pytest.mark.parametrize("config", [dict(), dict(max_num_batched_tokens=8, max_num_seqs=4),
                                    dict(num_gpu_blocks_override=12, max_model_len=64)])
def test_prompt_logprobs_match_hf_chunked_cached_and_preempted(config, tiny_engine_models, make_llm, traced):
    model_dir, hf = tiny_engine_models["llama"]
    llm = make_llm(model_dir, block_size=4, **config)
    tok = llm.get_tokenizer()
    shared = tok("A shared system prompt that is long enough to fill several KV blocks of four").input_ids
    prompts = [shared + tok(" and one question").input_ids, shared + tok(" and another").input_ids]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompts[0]}, plain, use_tqdm=False)[0]   # fills the prefix cache
    assert first.prompt_logprobs is None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=3)
    outs, steps = traced(llm, [{"prompt_token_ids": p} for p in prompts], params)
    if "num_gpu_blocks_override" in config:
        assert any(s.scheduler_output.preempted_req_ids for s in steps), "the small pool was to force a preemption"
    for prompt, out in zip(prompts, outs):
        assert out.num_cached_tokens == 0, "a prompt_logprobs request must compute its whole prompt"
        check_prompt_logprobs(out, prompt, hf, 3)
    assert outs[0].outputs[0].token_ids == first.outputs[0].token_ids
    # The cache is still filled by such requests: a plain request hits what they computed.
    again = llm.generate({"prompt_token_ids": prompts[1]}, plain, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(shared) // 4 * 4 - 4


def test_prompt_logprobs_zero_gives_the_prompt_tokens_own_logprob(tiny_engine_models, make_llm):
    model_dir, hf = tiny_engine_models["qwen3"]
    llm = make_llm(model_dir)
    prompt = llm.get_tokenizer()("Hello world, this is a test").input_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]     # k = 0: the token alone
    check_prompt_logprobs(out, prompt, hf, 0)


def test_bad_prompt_logprobs(tiny_engine_models, make_llm):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None, -1 \(the whole vocabulary\) or an integer"):
        SamplingParams(prompt_logprobs=-2)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None, -1"):
        SamplingParams(prompt_logprobs=True)
    # vLLM's --max-logprobs: the engine's limit, checked when the request is added.
    llm = make_llm(tiny_engine_models["llama"][0], max_logprobs=3)
    with pytest.raises(ValueError, match="Requested prompt logprobs of 4, which is greater than max allowed: 3"):
        llm.generate("hello", SamplingParams(max_tokens=1, prompt_logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match="Requested sample logprobs of 49152, which is greater than max allowed: 3"):
        llm.generate("hello", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)     # -1: the vocabulary
