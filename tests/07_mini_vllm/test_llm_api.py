"""The user-facing API: LLM.generate / LLM.chat / LLMEngine streaming, outputs and metrics,
logprobs, stop conditions, aborts, and every kind of bad input (clear error, nothing lost, the
engine keeps serving). Tiny random Llama with SmolLM2's tokenizer: real text, fast steps."""
from __future__ import annotations

import math

import pytest
import torch

from mini_vllm import LLMEngine, RequestOutputKind, SamplingParams
from mini_vllm.engine_config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_engine_models):
    return tiny_engine_models["llama"]


@pytest.fixture(scope="module")
def llm(tiny, make_llm):
    return make_llm(tiny[0], block_size=4, max_num_seqs=8, num_gpu_blocks_override=256, max_model_len=128)


def texts(outs):
    return [o.outputs[0].text for o in outs]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------------------ inputs
def test_every_prompt_form_gives_the_same_tokens(llm):
    tok = llm.get_tokenizer()
    a, b = "The capital of France is", "Hello world"
    ref = llm.generate([a, b], GREEDY, use_tqdm=False)
    assert [o.prompt for o in ref] == [a, b] and ref[0].prompt_token_ids == tok(a).input_ids
    same = [llm.generate(a, GREEDY)[0],
            llm.generate(tok(a).input_ids, GREEDY)[0],
            llm.generate({"prompt": a}, GREEDY)[0],
            llm.generate({"prompt_token_ids": tok(a).input_ids}, GREEDY)[0],
            llm.generate([tok(a).input_ids, tok(b).input_ids], GREEDY, use_tqdm=True)[0]]
    assert all(o.outputs[0].token_ids == ref[0].outputs[0].token_ids for o in same)
    assert same[1].prompt is None                                   # token prompts carry no text
    per_request = llm.generate([a, b], [GREEDY, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert [len(t) for t in ids(per_request)] == [8, 3]


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                       add_special_tokens=False).input_ids
    assert len(llm.chat([messages, messages], GREEDY)) == 2


def test_outputs_keep_prompt_order_and_seeded_sampling_is_reproducible(llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in (1, 2, 3)]
    first = llm.generate(["a", "b b b b b b", "c"], params)
    again = llm.generate(["c", "a"], [params[2], params[0]])       # other batch, other order
    assert ids(again) == [ids(first)[2], ids(first)[0]]


# ------------------------------------------------------------------------------ streaming, metrics, logprobs
def test_output_kinds_agree(llm):
    engine = llm.llm_engine
    for kind in RequestOutputKind:
        engine.add_request(kind.name, "Once upon a time", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                                         output_kind=kind))
    seen = {k.name: [] for k in RequestOutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    final = seen["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished and len(final[0].outputs[0].token_ids) == 10
    cumulative, delta = seen["CUMULATIVE"], seen["DELTA"]
    assert len(cumulative) == 10 and [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 11))
    assert cumulative[-1].outputs[0].text == final[0].outputs[0].text
    assert "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text
    assert sum((o.outputs[0].token_ids for o in delta), []) == final[0].outputs[0].token_ids
    assert [o.finished for o in delta][-1] and not any(o.finished for o in delta[:-1])


def test_metrics_are_ordered_and_complete(llm):
    out = llm.generate(["one", "two three four five six seven"], SamplingParams(temperature=0, max_tokens=5,
                                                                                  ignore_eos=True))[1]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert len(m.token_times) == 5 and m.token_times == sorted(m.token_times)
    assert m.time_to_first_token > 0 and len(m.inter_token_latencies) == 4
    assert m.time_per_output_token == pytest.approx(sum(m.inter_token_latencies) / 4)
    assert m.e2e_latency >= m.time_to_first_token


@torch.inference_mode()
def test_logprobs_match_hf(llm, tiny):
    """The sampled token's logprob and the top-3 equal HF's log_softmax (teacher-forced on our
    tokens) within the fp32 tolerance; the greedy token has rank 1; cumulative = the sum."""
    from tolerances import assert_close

    _, hf = tiny
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                             ignore_eos=True))[0].outputs[0]
    prompt = llm.get_tokenizer()("The quick brown fox").input_ids
    seq = torch.tensor([prompt + out.token_ids])
    ref = hf(seq).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)            # [6, vocab]
    assert len(out.logprobs) == 6
    for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token].rank == 1
        top = ref[t].topk(3)
        assert [i for i in entry if i != token or entry[i].rank == 1][:3] == top.indices.tolist()
        got = torch.tensor([entry[i].logprob for i in top.indices.tolist()])
        assert_close(got, top.values, dtype=torch.float32)
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


# ------------------------------------------------------------------------------ stopping
def test_stop_string_and_stop_token(llm):
    base = llm.generate("Count with me:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in base.token_ids]
    # A stop string = the text of tokens 3..4: the output is cut right before it.
    stop = "".join(pieces[3:5])
    assert stop.strip() and stop not in "".join(pieces[:3])[:-1]
    out = llm.generate("Count with me:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == base.text[:base.text.index(stop)] and len(c.token_ids) < 12
    # A stop token: generation ends at it (included in token_ids, not in the text).
    token = base.token_ids[4]
    c = llm.generate("Count with me:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      stop_token_ids=[token]))[0].outputs[0]
    first = base.token_ids.index(token)
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", token, base.token_ids[:first + 1])
    assert c.text == tok.decode(base.token_ids[:first])


def test_eos_ends_a_request_unless_ignored(llm, monkeypatch):
    eos = llm.llm_engine.model_config.eos_token_ids[0]
    compute_logits = llm.llm_engine.engine_core.model_runner.model.compute_logits

    def always_eos(hidden):
        logits = compute_logits(hidden)
        logits[:, eos] = 1e4
        return logits
    monkeypatch.setattr(llm.llm_engine.engine_core.model_runner.model, "compute_logits", always_eos)
    stopped = llm.generate("x", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason, stopped.text) == ([eos], "stop", None, "")
    ignored = llm.generate("x", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert (ignored.token_ids, ignored.finish_reason) == ([eos] * 5, "length")


def test_abort_frees_blocks_mid_flight(llm):
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    for i in range(3):
        engine.add_request(f"ab{i}", "a fairly long prompt " * 6, SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    engine.step()
    held = kv.num_blocks - kv.num_free_blocks
    engine.abort_request("ab1")
    assert kv.num_blocks - kv.num_free_blocks < held and engine.get_num_unfinished_requests() == 2
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["ab0", "ab2"]


# ------------------------------------------------------------------------------ bad input
def test_bad_input_raises_and_changes_nothing(llm):
    engine = llm.llm_engine
    max_len = engine.model_config.max_model_len
    cases = [("", ValueError, "empty"), ([], ValueError, "no prompts"), ([[]], ValueError, "empty"),
             ([1] * max_len, ValueError, "max_model_len"), ([10**6], ValueError, "vocabulary"),
             ([-1], ValueError, "vocabulary"), (3.5, TypeError, "prompt"), ({"text": "x"}, ValueError, "prompt_token_ids")]
    for prompt, error, match in cases:
        with pytest.raises(error, match=match):
            llm.generate(prompt, GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):              # one bad prompt: the batch is refused whole
        llm.generate(["fine", "x " * max_len], GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate("fine", {"temperature": 0})
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("fine", SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate("fine", [GREEDY, GREEDY])
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(stop=[""]), dict(logprobs=-2),
                dict(stop="x", detokenize=False)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="greater than max allowed: 20"):     # the engine's --max-logprobs
        llm.generate("fine", SamplingParams(logprobs=21))
    engine.add_request("dup", "x", GREEDY)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", "y", GREEDY)
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests() and engine.engine_core.kv_cache_manager.usage == 0
    assert len(llm.generate(["still", "serving"], GREEDY)) == 2


def test_bad_engine_config_and_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(model=str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLMEngine(model=str(tmp_path))
    for bad in (dict(block_size=0), dict(max_num_seqs=0), dict(attention_backend="fast"),
                dict(preemption_mode="swap"), dict(gpu_memory_utilization=1.5), dict(scheduling_policy="lifo")):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="not both"):
        LLMEngine(EngineConfig(), max_num_seqs=2)


def test_nonfinite_logits_fail_one_request_and_the_rest_finish(llm, monkeypatch):
    prompts = ["first prompt", "second prompt here", "third"]
    clean = llm.generate(prompts, GREEDY)
    runner = llm.llm_engine.engine_core.model_runner
    compute_logits = runner.model.compute_logits
    calls = []

    def nan_for_second_request(hidden):
        logits = compute_logits(hidden)
        calls.append(1)
        if len(calls) == 3:                       # third step: poison the row of the second request
            logits[runner.input_batch.req_id_to_index[second]] = float("nan")
        return logits
    monkeypatch.setattr(runner.model, "compute_logits", nan_for_second_request)
    second = str(int(clean[-1].request_id) + 2)   # the ids the next generate() call will use
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert "non-finite" in outs[1].outputs[0].stop_reason and len(outs[1].outputs[0].token_ids) == 2
    assert ids([outs[0], outs[2]]) == ids([clean[0], clean[2]])


def test_a_request_that_can_never_fit_fails_alone(tiny, make_llm):
    small = make_llm(tiny[0], block_size=4, num_gpu_blocks_override=6, max_model_len=64)   # 24 KV slots
    outs = small.generate(["short", "x " * 30], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 4
    assert outs[1].outputs[0].finish_reason == "error" and "blocks" in outs[1].outputs[0].stop_reason
    assert math.isclose(small.llm_engine.kv_cache_report.max_concurrency, 6 / 16)
