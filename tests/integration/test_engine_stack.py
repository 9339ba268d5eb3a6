"""The whole stack under stress: chapters 01-05 composed by chapter 07, on a tiny model.

What only the composition can get wrong: a block freed by one request and written by another in
the same step, a swap that copies the wrong blocks or copies after the forward, a resumed
request whose runner state is stale, a prefix hit on blocks that were since evicted. Every
scenario therefore checks the OUTPUT — greedy tokens equal to an unstressed run — plus the
engine's invariants after every step, and ends with every KV block free.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_vllm import SamplingParams


def workload(seed: int, n: int, prompt_len=(5, 40), output_len=(8, 24), vocab=49152):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(*output_len), ignore_eos=True) for _ in range(n)]
    return prompts, params


def drain(engine, prompts, params, prefix="r"):
    """Add all, step to the end checking invariants; returns ({id: tokens}, [SchedulerOutput])."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{prefix}{i}", p, sp)
    tokens, steps = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        steps.append(engine.last_step.scheduler_output)
        engine.engine_core.check_invariants()
    return [tokens[f"{prefix}{i}"] for i in range(len(prompts))], steps


@pytest.fixture(scope="module")
def reference(make_engine):
    """Greedy tokens of the stress workload on a roomy engine (no preemption possible)."""
    prompts, params = workload(0, 10)
    tokens, steps = drain(make_engine(), prompts, params)
    assert not any(s.preempted_req_ids for s in steps)
    return prompts, params, tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("chunked", [True, False])
def test_tiny_pool_preemption_gives_the_same_tokens(reference, make_engine, mode, chunked):
    prompts, params, expected = reference
    engine = make_engine(num_gpu_blocks_override=20, preemption_mode=mode, swap_space=0.001 if mode == "swap" else 0,
                         enable_chunked_prefill=chunked, max_num_batched_tokens=64 if chunked else 256,
                         max_num_seqs=16)
    tokens, steps = drain(engine, prompts, params)
    assert tokens == expected
    preempted = sum(len(s.preempted_req_ids) for s in steps)
    assert preempted >= 3, f"the 20-block pool was meant to force preemptions, got {preempted}"
    if mode == "swap":
        assert any(s.blocks_to_swap_in for s in steps)
        for s in steps:
            # vLLM v0's rule, relied on by chapter 02: a step never swaps out and in at once (a
            # device block freed by the swap-out could be the target of the swap-in).
            assert not (s.blocks_to_swap_out and s.blocks_to_swap_in)
            outs, ins = {d for d, _ in s.blocks_to_swap_out}, {d for _, d in s.blocks_to_swap_in}
            assert not outs & ins


def test_shared_system_prompt_hits_the_prefix_cache(make_engine):
    system = list(range(1000, 1040))                     # 40 tokens = 10 full blocks of 4
    prompts = [system + [2000 + i, 3000 + i] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 6
    cold, _ = drain(make_engine(enable_prefix_caching=False), prompts, params)
    engine = make_engine()
    first, _ = drain(engine, prompts[:1], params[:1], prefix="first")
    engine.add_request("warm", prompts[1], params[1])
    hits = []
    while engine.has_unfinished_requests():
        hits += [o.num_cached_tokens for o in engine.step() if o.finished]
    rest, _ = drain(engine, prompts[2:], params[2:], prefix="rest")
    assert hits == [40]
    assert first + rest == [cold[0]] + cold[2:]
    stats = engine.engine_core.kv_cache_manager.stats
    assert stats.hits >= 40 * 5


def test_seeded_sampling_survives_preemption(make_engine):
    """The runner keeps a preempted request's random generator: a seeded request samples the same
    tokens whether or not it was preempted and recomputed along the way."""
    prompts, _ = workload(3, 8)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(8)]
    calm, _ = drain(make_engine(), prompts, params)
    squeezed, steps = drain(make_engine(num_gpu_blocks_override=18), prompts, params)
    assert any(s.preempted_req_ids for s in steps)
    assert squeezed == calm


@pytest.fixture(scope="module")
def solo_engine(make_engine):
    return make_engine()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_and_aborts(make_engine, solo_engine, data):
    """Requests arrive between steps, some are aborted at random moments (running, waiting or
    preempted); the survivors produce exactly their solo greedy tokens and nothing leaks."""
    seed = data.draw(st.integers(0, 10**6))
    prompts, params = workload(seed, 8, output_len=(4, 16))
    engine = make_engine(num_gpu_blocks_override=data.draw(st.sampled_from([16, 24, 512])),
                         enable_chunked_prefill=data.draw(st.booleans()), max_num_batched_tokens=256)
    pending, aborted, done = list(range(8)), set(), {}
    while pending or engine.has_unfinished_requests():
        arrivals = data.draw(st.integers(0, 2)) or int(not engine.has_unfinished_requests())
        for _ in range(arrivals):
            if pending:
                i = pending.pop(0)
                engine.add_request(f"q{i}", prompts[i], params[i])
        live = [r for r in engine.output_processor.request_states]
        if live and data.draw(st.integers(0, 5)) == 0:
            victim = data.draw(st.sampled_from(sorted(live)))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.engine_core.check_invariants()
    survivors = sorted(done, key=lambda r: int(r[1:]))
    assert set(done) | aborted == {f"q{i}" for i in range(8)}
    solo, _ = drain(solo_engine, [prompts[int(r[1:])] for r in survivors], [params[int(r[1:])] for r in survivors],
                    prefix=f"solo{seed}-")
    assert [done[r] for r in survivors] == solo
