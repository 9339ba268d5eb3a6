"""Beam search as a front-end loop over one-token requests (beam_search.py), with HF as the oracle.

The truth kept: HF's `generate(num_beams=W, do_sample=False, num_return_sequences=W)` — every
returned beam's tokens and score, not only the best — for each of HF's three early-stopping
rules and several length penalties. Every round re-submits every beam as a request whose prefix
the prefix cache serves: a beam reading one K/V value that is not its own (a cached block of
another beam's tokens) changes its log-probabilities, hence the scores, and almost surely the
tokens. Checked through chunked prefill and a pool small enough to preempt beams mid-round.
To make EOS (and so the early-stopping rules) matter, the tiny model's EOS id is set to a token
it likes to produce. Every block is free after each test (tests/conftest.py).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from mini_vllm import BeamSearchParams, SamplingParams

PROMPTS = ["Beam search keeps the best", "Copy on write shares blocks between beams", "A B C"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def eos_heavy(tiny_engine_models, tmp_path_factory):
    """(checkpoint dir, HF model, eos id): the tiny Llama with its EOS id moved to the token its
    greedy continuations of PROMPTS produce most — so beams end at different lengths."""
    src, hf = tiny_engine_models["llama"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    counts: dict[int, int] = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = hf.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, num_beams=4, num_return_sequences=4,
                          eos_token_id=None, pad_token_id=0)
        for t in out[:, ids.shape[1]:].flatten().tolist():
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    dst = tmp_path_factory.mktemp("eos-heavy") / "llama"
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((dst / name).read_text())
        config["eos_token_id"] = eos
        (dst / name).write_text(json.dumps(config))
    return dst, hf, eos


def hf_beams(hf, prompt_ids: list[int], params: BeamSearchParams, eos: int):
    """HF's W beams for one prompt: [(generated tokens incl. EOS, score)], best first."""
    ids = torch.tensor([prompt_ids])
    out = hf.generate(ids, do_sample=False, num_beams=params.beam_width, num_return_sequences=params.beam_width,
                      max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                      early_stopping=params.early_stopping, eos_token_id=eos, pad_token_id=eos,
                      output_scores=True, return_dict_in_generate=True)
    beams = []
    scores = out.sequences_scores.tolist() if params.beam_width > 1 else [None]   # num_beams=1: greedy search
    for row, score in zip(out.sequences.tolist(), scores):
        generated = row[len(prompt_ids):]
        if eos in generated:                      # cut after the first EOS: the rest is padding
            generated = generated[:generated.index(eos) + 1]
        beams.append((generated, score))
    return beams


def assert_equal_hf(llm, hf, eos, params: BeamSearchParams, prompts=PROMPTS):
    tok = llm.get_tokenizer()
    outputs = llm.beam_search(prompts, params)
    ended = 0
    for prompt, output in zip(prompts, outputs):
        prompt_ids = tok(prompt).input_ids
        ours = [(s.tokens[len(prompt_ids):], s.score) for s in output.sequences]
        theirs = hf_beams(hf, prompt_ids, params, eos)
        assert [t for t, _ in ours] == [t for t, _ in theirs], (prompt, params)
        if params.beam_width > 1:
            assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], rel=1e-6, abs=1e-4)
        ended += sum(s.finish_reason == "stop" for s in output.sequences)
    return ended


@pytest.mark.parametrize("early_stopping, length_penalty", [(False, 1.0), (True, 1.0), ("never", 1.0),
                                                            ("never", 2.0), (False, -1.0), (False, 0.0)])
def test_beams_equal_hf(early_stopping, length_penalty, eos_heavy, make_llm):
    model_dir, hf, eos = eos_heavy
    llm = make_llm(model_dir, block_size=4)
    ended = 0
    for width in (1, 2, 4):
        ended += assert_equal_hf(llm, hf, eos, BeamSearchParams(width, MAX_NEW, length_penalty=length_penalty,
                                                                early_stopping=early_stopping))
    if length_penalty <= 1:   # (a penalty of 2 favours long beams: the best may all run to max_tokens)
        assert ended, "no beam ended in EOS: the early-stopping rule was never exercised"


@pytest.mark.parametrize("config", ["chunked", "preempt"])
def test_beams_equal_hf_through_chunks_and_preemption(config, eos_heavy, make_llm):
    """Beam search beside two plain requests on a small engine: chunked prompts, or a pool of 9
    blocks of 4 tokens that cannot hold the growing neighbours and the beams' requests (requests are
    preempted and recomputed). The beams are HF's, the neighbours' tokens those they get alone."""
    model_dir, hf, eos = eos_heavy
    kwargs = dict(max_num_batched_tokens=8, max_num_seqs=8) if config == "chunked" else \
        dict(num_gpu_blocks_override=9, max_model_len=32)
    llm = make_llm(model_dir, block_size=4, **kwargs)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    neighbours = {"p0": PROMPTS[2], "p1": "D E F"}
    alone = {rid: o.outputs[0].token_ids for rid, o in zip(neighbours, llm.generate(list(neighbours.values()), plain,
                                                                                     use_tqdm=False))}
    engine = llm.llm_engine
    preemptions, finished = [], {}
    step = engine.step

    def traced_step():
        outputs = step()
        preemptions.append(len(engine.last_step.scheduler_output.preempted_req_ids))
        finished.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.request_id in alone and o.finished})
        engine.engine_core.check_invariants()
        return outputs
    engine.step = traced_step
    for rid, prompt in neighbours.items():
        engine.add_request(rid, prompt, plain)              # they run beside the searches' rounds
    assert_equal_hf(llm, hf, eos, BeamSearchParams(4, MAX_NEW), PROMPTS[:2])
    assert finished == alone
    if config == "preempt":
        assert sum(preemptions), "the pool never ran out: the test would prove little"


def test_beams_share_blocks_through_the_prefix_cache(eos_heavy, make_llm):
    """Each round after the first, every beam's request finds all of its full blocks but the last
    cached (computed in an earlier round by itself or the beam it continues): it computes at most one
    block's tokens; and every block is back in the pool at the end."""
    model_dir, _, _ = eos_heavy
    llm = make_llm(model_dir, block_size=4)
    engine, pool = llm.llm_engine, llm.llm_engine.engine_core.kv_cache_manager.block_pool
    prompt = llm.get_tokenizer()("A long prompt that all beams share " * 4).input_ids
    computed: dict[str, int] = {}
    step = engine.step

    def counting_step():
        outputs = step()
        for req_id, n in engine.last_step.scheduler_output.num_scheduled_tokens.items():
            computed[req_id] = computed.get(req_id, 0) + n
        return outputs
    engine.step = counting_step
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(4, 16, ignore_eos=True))
    assert len(out.sequences) == 4 and all(len(s.tokens) == len(prompt) + 16 for s in out.sequences)
    first_round = max(computed.values())
    assert first_round == len(prompt)                        # the prompt, computed once
    later = sorted(computed.values())[:-1]
    assert len(later) >= 4 * 15 and max(later) <= 4, later   # every later request: at most a block
    assert pool.get_num_free_blocks() == pool.num_blocks


@pytest.mark.model
def test_smollm2_beams_equal_hf(smollm2_dir, smollm2_hf, make_llm):
    """The real model, a chat prompt that ends in EOS within the budget, under HF's default
    early-stopping rule (early_stopping=False: the subtle one; True and "never" are checked on the
    tiny EOS-heavy model above, where they make a difference)."""
    llm = make_llm(smollm2_dir)
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    eos = llm.llm_engine.model_config.eos_token_ids[0]
    assert assert_equal_hf(llm, smollm2_hf, eos, BeamSearchParams(3, 24, early_stopping=False), [prompt])


def test_errors(eos_heavy, make_llm, tiny_engine_models):
    model_dir, _, _ = eos_heavy
    llm = make_llm(model_dir, block_size=4)
    engine = llm.llm_engine
    for bad, match in [(dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
                       (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
                       (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping must be"),
                       (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be"),
                       (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be a bool")]:
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**bad)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search("x", SamplingParams())
    with pytest.raises(TypeError, match="LLM.beam_search"):
        llm.generate("x", BeamSearchParams(2, 4))
    with pytest.raises(TypeError, match="LLM.beam_search or AsyncLLM.beam_search"):
        engine.add_request("x", "hello", BeamSearchParams(2, 4))
    # A prompt longer than the model: the whole batch is refused, nothing queued.
    with pytest.raises(ValueError):
        llm.beam_search(["fine", {"prompt_token_ids": [5] * 600}], BeamSearchParams(2, 4))
    assert not engine.has_unfinished_requests()
