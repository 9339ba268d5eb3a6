"""Async scheduling (EngineConfig.async_scheduling, async_scheduler.py, async_output.py): the same
engine run synchronously is the shadow of the truth. For tiny random models, every workload here
runs on a synchronous engine and on an async one built the same way, and must give IDENTICAL
tokens, logprobs and finish reasons — greedy and seeded sampling, max_tokens 1 and 2, stop token
ids, min_tokens, chunked prefill, shared prefixes hitting the prefix cache, preemption (recompute
and swap), an abort while a batch is in flight, a request that fails while the others go on. The
engines' invariants are checked after every step, and after every test every KV block must be free
(tests/conftest.py). What async scheduling cannot do is refused with a clear error."""
from __future__ import annotations

import pytest

from mini_vllm import EngineConfig, SamplingParams
from mini_vllm.async_output import PLACEHOLDER_TOKEN_ID, AsyncModelRunnerOutput
from mini_vllm.step_trace import ModelInputsTrace

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_engine_models):
    return tiny_engine_models["llama"]


ENGINE = dict(block_size=4, max_num_seqs=8, num_gpu_blocks_override=256, max_model_len=128)


@pytest.fixture(scope="module")
def pair(tiny, make_llm):
    """(sync LLM, async LLM), otherwise identical."""
    return make_llm(tiny[0], **ENGINE), make_llm(tiny[0], **ENGINE, async_scheduling=True)


def prompts(n, length=9, start=100):
    return [[start + 31 * i + t for t in range(length)] for i in range(n)]


def run(llm, requests, abort_after: dict[str, int] | None = None):
    """requests: [(request_id, prompt ids, params)] -> ({request_id: (tokens, logprobs, finish_reason,
    stop_reason)}, steps), from each request's last (cumulative) output: an aborted request has no
    final output, its entry is what it had streamed, with finish_reason "abort".
    abort_after: {request_id: step() calls after which it is aborted}. The engine's invariants are
    checked after every step."""
    engine = llm.llm_engine
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    finals, steps = {}, []
    with ModelInputsTrace(engine) as trace:
        for n in range(1, 2000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                finals[out.request_id] = out
            steps.append(engine.last_step)
            engine.engine_core.check_invariants()
            _assert_inputs_are_the_steps(engine.last_step.scheduler_output, trace)
            for rid, at in (abort_after or {}).items():
                if at == n:
                    engine.abort_request(rid)
    assert not engine.has_unfinished_requests(), "the engine stopped making progress"
    engine.engine_core.check_invariants()
    aborted = set(abort_after or ())
    return {rid: _summary(out, rid in aborted) for rid, out in finals.items()}, steps


def _assert_inputs_are_the_steps(so, trace):
    """The traced model inputs are those of the batch whose output this step applied — not those
    of the batch still in flight (same requests, one position further). (Fewer tokens than
    scheduled where the runner dropped a request that failed in the batch before.)"""
    inputs = trace.inputs_of(so)
    if inputs is None:
        assert so.is_empty, "a step that ran the model has no traced inputs"
        return
    cached = so.scheduled_cached_reqs
    ends = {r.num_computed_tokens + so.num_scheduled_tokens[r.req_id] for r in so.scheduled_new_reqs}
    ends |= {c + so.num_scheduled_tokens[r] for r, c in zip(cached.req_ids, cached.num_computed_tokens)}
    positions = inputs.positions.tolist()
    assert len(positions) <= so.total_num_scheduled_tokens
    if any(d and d[0] == PLACEHOLDER_TOKEN_ID for d in so.scheduled_spec_decode_tokens.values()):
        assert max(positions) + 1 <= max(ends)     # drafts: the runner moved back what was rejected in flight
    else:
        assert max(positions) + 1 in ends


def _summary(out, aborted: bool):
    o = out.outputs[0]
    assert out.finished != aborted, f"{out.request_id}: finished={out.finished}, aborted={aborted}"
    return list(o.token_ids), o.logprobs, "abort" if aborted else o.finish_reason, o.stop_reason


def assert_same(pair, requests, abort_after=None):
    """Run `requests` on both engines; identical results, and the async engine really overlapped
    (a batch was sent while another was in flight: without placeholders it would not have been).
    Returns (results, sync steps, async steps)."""
    sync, async_ = pair
    expect, sync_steps = run(sync, requests, abort_after)
    core = async_.llm_engine.engine_core
    overlapped = core.num_batches_overlapped
    got, async_steps = run(async_, requests, abort_after)
    assert core.num_batches_overlapped > overlapped, "the async engine never had two batches in flight"
    assert set(got) == set(expect)
    for rid in expect:
        assert got[rid] == expect[rid], f"{rid}: async {got[rid][0]} ({got[rid][2]}) vs sync {expect[rid][0]} " \
                                        f"({expect[rid][2]})"
    return expect, sync_steps, async_steps


# ------------------------------------------------------------------------------ sampling
def test_greedy_and_seeded_sampling_with_logprobs_match_sync(pair):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.3, top_k=20, seed=5, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.7, seed=3, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
    requests = [(f"r{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts(6, length=10), params))]
    results, _, async_steps = assert_same(pair, requests)
    assert [len(results[f"r{i}"][0]) for i in range(6)] == [12, 9, 14, 1, 2, 2]
    assert results["r0"][1] is not None and len(results["r0"][1]) == 12


def test_max_tokens_1_and_2_waste_no_step_on_a_request_sure_to_stop(pair):
    """A request whose max_tokens is reached by a token in flight is not scheduled again."""
    requests = [("one", prompts(1)[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
                ("two", prompts(1, start=300)[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))]
    _, _, async_steps = assert_same(pair, requests)
    scheduled = [set(s.scheduler_output.num_scheduled_tokens) for s in async_steps]
    assert sum("one" in s for s in scheduled) == 1 and sum("two" in s for s in scheduled) == 2


def test_stop_token_ids_min_tokens_and_eos_match_sync(pair):
    """Stops decided by a token's VALUE: the async engine had already scheduled the next step."""
    base = prompts(4, start=500)
    probe, _ = run(pair[0], [(f"p{i}", ids, GREEDY) for i, ids in enumerate(base)])
    # Stop at the 3rd generated token (a value the scheduler learns one step late), with and
    # without min_tokens keeping it from ending the request early; and an EOS id.
    stop = [probe[f"p{i}"][0][2] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop[0]]),
              SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop[1]], min_tokens=6),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop[3]], logprobs=2)]
    results, _, _ = assert_same(pair, [(f"s{i}", ids, p) for i, (ids, p) in enumerate(zip(base, params))])
    assert results["s0"][2] == "stop" and results["s0"][0][-1] == stop[0]
    assert results["s3"][2] == "stop"
    assert results["s2"][2] == "length"


def test_penalties_see_the_tokens_in_flight(pair):
    """A repetition penalty needs the output so far, including the token still in flight: the
    runner waits for it (a step without overlap), the tokens stay the sync ones."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                            presence_penalty=0.5)
    assert_same(pair, [(f"pen{i}", ids, params) for i, ids in enumerate(prompts(3, start=700))])


# ------------------------------------------------------------------------------ scheduling features
def test_chunked_prefill_matches_sync(tiny, make_llm):
    kw = dict(ENGINE, max_num_batched_tokens=16, max_num_seqs=4)
    pair = make_llm(tiny[0], **kw), make_llm(tiny[0], **kw, async_scheduling=True)
    long = prompts(3, length=45, start=40)
    requests = [(f"c{i}", ids, SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=1))
                for i, ids in enumerate(long)]
    _, _, async_steps = assert_same(pair, requests)
    assert any(0 < n < 45 for s in async_steps for n in s.scheduler_output.num_scheduled_tokens.values())


def test_shared_prefixes_hit_the_prefix_cache_and_match_sync(pair):
    prefix = list(range(200, 232))                        # 8 full blocks of 4
    requests = [(f"x{i}", prefix + [900 + i, 901 + i], GREEDY) for i in range(5)]
    requests.append(("again", prefix + [900, 901], GREEDY))   # the same prompt as x0
    expect, _ = run(pair[0], requests[:1])                  # x0 alone first: its blocks are cached
    got, _ = run(pair[1], requests[:1])
    assert got == expect
    _, _, async_steps = assert_same(pair, requests[1:])
    hits = [new.num_computed_tokens for s in async_steps for new in s.scheduler_output.scheduled_new_reqs]
    assert hits and min(hits) >= 32, hits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches_sync(tiny, make_llm, mode):
    """A KV cache too small for everyone: requests are preempted while their last batch is in
    flight (its token is appended when it comes back) and resumed later."""
    kw = dict(ENGINE, num_gpu_blocks_override=20, max_num_seqs=6)
    if mode == "swap":
        kw.update(preemption_mode="swap", swap_space=0.01)
    pair = make_llm(tiny[0], **kw), make_llm(tiny[0], **kw, async_scheduling=True)
    requests = [(f"q{i}", ids, SamplingParams(temperature=0.9, seed=i, max_tokens=18, ignore_eos=True, logprobs=1))
                for i, ids in enumerate(prompts(6, length=6, start=60))]
    _, sync_steps, async_steps = assert_same(pair, requests)
    assert any(s.scheduler_output.preempted_req_ids for s in async_steps)


# ------------------------------------------------------------------------------ abort and failures
def test_abort_while_a_batch_is_in_flight_matches_sync(pair):
    requests = [(f"a{i}", ids, GREEDY) for i, ids in enumerate(prompts(4, start=800))]
    results, _, _ = assert_same(pair, requests, abort_after={"a1": 4, "a3": 1})
    assert results["a1"][2] == "abort" and results["a3"][2] == "abort"
    assert len(results["a1"][0]) == 4 and len(results["a3"][0]) == 1     # one token a step, then aborted
    assert results["a0"][2] == "length" and len(results["a0"][0]) == 10


def test_a_request_that_fails_mid_decoding_fails_alone(pair, monkeypatch):
    """Non-finite logits for one request at its 4th token, while its next step is already
    scheduled: it fails with the same tokens as in the sync engine; the others go on."""
    for llm in pair:
        runner = llm.llm_engine.engine_core.model_runner
        compute_logits = runner.model.compute_logits

        def poisoned(hidden, runner=runner, compute_logits=compute_logits):
            logits = compute_logits(hidden)
            state = runner.requests.get("bad")
            row = runner.input_batch.req_id_to_index.get("bad")
            if state is not None and row is not None and len(state.output_token_ids) == 3 \
                    and logits.shape[0] == runner.input_batch.num_reqs:
                logits[row] = float("nan")
            return logits
        monkeypatch.setattr(runner.model, "compute_logits", poisoned)
    # The async runner leaves the non-finite flags on the device until the step's output is read
    # (on a GPU, reading them while sampling would wait for the forward pass): no output knows of
    # the failure before get_output().
    known_before = []
    get_output = AsyncModelRunnerOutput.get_output

    def spying(self):
        if not self._done:
            known_before.append("bad" in self._output.failed)
        return get_output(self)
    monkeypatch.setattr(AsyncModelRunnerOutput, "get_output", spying)
    requests = [(f"g{i}", ids, GREEDY) for i, ids in enumerate(prompts(3, start=600))]
    requests.insert(1, ("bad", prompts(1, start=650)[0], GREEDY))
    results, _, _ = assert_same(pair, requests)
    assert known_before and not any(known_before)
    assert results["bad"][2] == "error" and "non-finite" in str(results["bad"][3])
    assert len(results["bad"][0]) == 3
    assert all(results[f"g{i}"][2] == "length" for i in range(3))


def test_the_runner_reads_the_placeholder_from_the_device_tensor(pair):
    """White box: while a decode batch is in flight, the runner's host copy of a request holds the
    placeholder at the token in flight, and the next step's input id there is the sampled token."""
    engine = pair[1].llm_engine
    core = engine.engine_core
    engine.add_request("w", {"prompt_token_ids": prompts(1, start=1000)[0]}, GREEDY)
    with ModelInputsTrace(engine) as trace:
        engine.step()
        engine.step()
        core.model_executor.wait_in_flight()
    state = core.model_runner.requests["w"]
    assert PLACEHOLDER_TOKEN_ID in state.output_token_ids          # the in-flight step's token
    inputs = trace.inputs_of(trace.last_scheduler_output)          # the batch in flight
    assert int(inputs.input_ids.min()) >= 0                        # no placeholder reached the model
    while engine.has_unfinished_requests():
        engine.step()
    core.check_invariants()


def test_staged_input_copies_change_nothing(tiny, make_llm, pair):
    """On a GPU each step's inputs reach the device through pinned buffers used in turn, without
    waiting for the step in flight (input_staging.py). Forced onto a CPU engine (plain copies into
    separate buffers, made too small so that they must grow): the sync engine's tokens and logprobs,
    and every traced step's inputs are its own although the next step was prepared after it (one
    buffer set would fail that: the trace would show the next step's positions)."""
    from mini_vllm.input_staging import InputStaging

    staged = make_llm(tiny[0], **ENGINE, async_scheduling=True)
    batch = staged.llm_engine.engine_core.model_runner.input_batch
    batch.staging = InputStaging("cpu", max_num_tokens=2, max_num_reqs=1, max_num_blocks_per_req=1, pin_memory=False)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    requests = [(f"st{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts(3, length=11, start=1100), params))]
    assert_same((pair[0], staged), requests)
    assert batch.staging.num_staged > 10
    assert all(s.int64.size > 3 * 2 + 1 and s.block_table.size > 1 for s in batch.staging.sets)    # they grew


@pytest.mark.gpu
def test_staged_input_copies_do_not_wait_for_the_gpu(offline_engine_models, make_llm, monkeypatch):
    """On CUDA with async scheduling, preparing a step's inputs (while the previous step may still
    run) makes no synchronizing CUDA call: every prepare_inputs runs under torch's sync debug mode
    "error", which raises on one (a copy from pageable memory is one) — the runner would then fail
    the request. The tokens are those of the synchronous engine."""
    import torch

    model_dir, _ = offline_engine_models["llama"]
    kw = dict(device="cuda", max_num_seqs=4, kv_cache_memory=64 << 20)
    sync, async_ = make_llm(model_dir, **kw), make_llm(model_dir, **kw, async_scheduling=True)
    batch = async_.llm_engine.engine_core.model_runner.input_batch
    assert batch.staging is not None
    prepare, placeholders = batch.prepare_inputs, []

    def without_syncs(*args, **kwargs):
        placeholders.append(bool(batch.prev_sampled_token_ids))
        torch.cuda.set_sync_debug_mode("error")
        try:
            return prepare(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(batch, "prepare_inputs", without_syncs)
    requests = [(f"g{i}", ids, GREEDY) for i, ids in enumerate(prompts(3, length=7, start=40))]
    assert_same((sync, async_), requests)
    assert any(placeholders), "no step was prepared with a token in flight"


# ------------------------------------------------------------------------------ what is refused
def test_what_vllm_refuses_with_async_scheduling_is_refused_with_its_reason(pair):
    for bad, reason in ((dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                         "only supported with EAGLE/MTP/Draft Model"),
                        (dict(pipeline_parallel_size=2), "Model Runner V1 does not support: pipeline parallelism"),
                        (dict(tensor_parallel_size=2, distributed_executor_backend="ray"),
                         "`ray` does not support async scheduling"),
                        (dict(async_scheduling="yes"), "must be True or False")):
        with pytest.raises(ValueError, match=reason):
            EngineConfig(async_scheduling=bad.pop("async_scheduling", True), **bad)


@pytest.mark.parametrize("method", ["draft_model", "eagle", "layer_skip"])
def test_model_drafters_match_sync(method, tiny, make_llm, tmp_path):
    """Async scheduling with drafts (vLLM composes it with its model drafters): each step is
    scheduled with k placeholder drafts before they exist, on counters that assume the drafts in
    flight are all accepted; the runner puts in its own proposals and moves each request back by
    the drafts rejected in the step before. Greedy and seeded tokens, and logprobs, are the
    synchronous speculative engine's; drafts were verified in steps that overlapped."""
    import torch
    from transformers import AutoConfig

    from spec_decode import EagleConfig, EagleHead
    spec = {"draft_model": {"method": "draft_model", "model": str(tiny[0])},
            "eagle": {"method": "eagle", "model": str(tmp_path)},
            "layer_skip": {"method": "layer_skip", "num_layers": 1}}[method]
    if method == "eagle":
        torch.manual_seed(0)
        EagleHead(EagleConfig.for_target(AutoConfig.from_pretrained(tiny[0]))).save_pretrained(tmp_path)
    kw = dict(ENGINE, speculative_config={**spec, "num_speculative_tokens": 3, "adaptive": False})
    spec_pair = make_llm(tiny[0], **kw), make_llm(tiny[0], **kw, async_scheduling=True)
    repeats = [ids * 3 for ids in prompts(3, length=5, start=60)]        # drafts get accepted
    params = [GREEDY, SamplingParams(temperature=0.9, seed=4, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=1)]
    assert_same(spec_pair, [(f"d{i}", ids, p) for i, (ids, p) in enumerate(zip(repeats, params))])
    assert spec_pair[1].llm_engine.engine_core.spec_decoding_stats.stats.num_draft_tokens > 0


def test_parallel_sampling_and_beam_search_run_as_on_the_sync_engine(pair):
    """n > 1 and beam search are the front end's (ordinary requests to the core): async scheduling
    gives the synchronous engine's children and beams."""
    from mini_vllm.beam_search import BeamSearchParams
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": prompts(1, length=7)[0]}
    sync, async_ = ([c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs] for llm in pair)
    assert sync == async_ and len({tuple(t) for t in sync}) > 1
    beams = [[s.tokens for s in llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5))[0].sequences]
             for llm in pair]
    assert beams[0] == beams[1] and len(beams[0]) == 3

