"""Chunked prefill on chapter 03's scheduler: exact chunk sequences, the partial-prefill knobs,
and the "chunked prefills" row of [Kwon 2025, Table 4.1] (Δ < L_prompt, num_total_tokens fixed until done)."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunked_prefill import ChunkedPrefillConfig, ChunkedPrefillScheduler
from kvcache import KVCacheManager
from scheduler import MockModelRunner, Request, RequestStatus, Scheduler, SchedulerConfig

_distinct = itertools.count(1)


def make(budget=16, max_model_len=128, num_blocks=64, block_size=4, caching=True, **knobs):
    config = ChunkedPrefillConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len, **knobs)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return ChunkedPrefillScheduler(config, kv), kv


def req(rid, prompt_len, max_tokens=4, arrival=0.0, first_token=None):
    first = 1000 * next(_distinct) if first_token is None else first_token
    return Request(rid, list(range(first, first + prompt_len)), max_tokens=max_tokens, arrival_time=arrival)


def step(s, runner=MockModelRunner()):
    out = s.schedule()
    outs = s.update_from_output(out, runner.execute(s.requests, out))
    s.check_invariants()
    s.kv_cache_manager.check_invariants()
    return out.num_scheduled_tokens, {o.request_id: o for o in outs}


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("knobs, message", [
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills must be a positive int"),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "must be <= max_num_partial_prefills"),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False, max_num_batched_tokens=128),
     "needs enable_chunked_prefill"),
    (dict(long_prefill_token_threshold=200), "cannot exceed max_model_len"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=16), "without chunked prefill"),
])
def test_invalid_configs(knobs, message):
    kwargs = dict(max_num_batched_tokens=16, max_model_len=128, max_num_seqs=8)
    kwargs.update(knobs)
    with pytest.raises(ValueError, match=message):
        ChunkedPrefillConfig(**kwargs)


def test_config_defaults_follow_vllm():
    c = ChunkedPrefillConfig(max_num_batched_tokens=512, max_model_len=4096, max_num_seqs=8)
    assert c.enable_chunked_prefill and c.max_num_partial_prefills == 1 and c.long_prefill_token_threshold == 0
    c = ChunkedPrefillConfig(max_num_batched_tokens=512, max_model_len=4096, max_num_seqs=8, max_num_partial_prefills=2)
    assert c.long_prefill_token_threshold == int(0.04 * 4096)            # vLLM's 4% default


def test_chapter_03_scheduler_refuses_to_chunk_and_vice_versa():
    kv = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="never splits a prompt"):
        Scheduler(ChunkedPrefillConfig(max_num_batched_tokens=16, max_model_len=64, max_num_seqs=4), kv)
    with pytest.raises(TypeError, match="needs a ChunkedPrefillConfig"):
        ChunkedPrefillScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, max_num_seqs=4), kv)


# ---------------------------------------------------------------- chunking
def test_a_long_prompt_goes_through_in_budget_sized_chunks():
    s, _ = make(budget=16)
    r = req("long", 40, max_tokens=2)
    s.add_request(r)
    trace = []
    for _ in range(5):
        scheduled, outs = step(s)
        trace.append((scheduled, r.num_computed_tokens, r.num_tokens, "long" in outs))
    assert trace == [({"long": 16}, 16, 40, False),       # no token sampled from a partial prefill
                     ({"long": 16}, 32, 40, False),
                     ({"long": 8}, 40, 41, True),          # the last chunk completes the prompt
                     ({"long": 1}, 41, 42, True),
                     ({}, 41, 42, False)]


def test_chunks_share_the_step_with_running_decodes():
    s, _ = make(budget=16)
    s.add_request(req("d0", 3, max_tokens=20))
    s.add_request(req("d1", 3, max_tokens=20))
    step(s)
    s.add_request(req("long", 40, max_tokens=1))
    steps = [step(s)[0] for _ in range(4)]
    assert steps == [{"d0": 1, "d1": 1, "long": 14},     # decodes first, the chunk takes what is left
                     {"d0": 1, "d1": 1, "long": 14},
                     {"d0": 1, "d1": 1, "long": 12},
                     {"d0": 1, "d1": 1}]


def test_long_prefill_token_threshold_caps_each_step_of_a_long_prompt():
    s, _ = make(budget=64, long_prefill_token_threshold=10)
    s.add_request(req("long", 25))
    s.add_request(req("short", 8))                        # <= threshold: not capped, and not blocked
    assert step(s)[0] == {"long": 10, "short": 8}
    assert step(s)[0] == {"long": 10, "short": 1}
    assert step(s)[0] == {"long": 5, "short": 1}


def test_one_partial_prefill_at_a_time_but_short_prompts_still_get_in():
    s, _ = make(budget=32)                                # max_num_partial_prefills=1 (vLLM default)
    s.add_request(req("a", 50))
    s.add_request(req("b", 50))
    s.add_request(req("c", 6))
    assert step(s)[0] == {"a": 32}                        # a is partial; b and c wait (no budget left)
    # b would start a second partial prefill: deferred. c fits whole: admitted, jumping ahead of b.
    assert step(s)[0] == {"a": 18, "c": 6}
    assert s.requests["b"].status == RequestStatus.WAITING
    assert step(s)[0] == {"a": 1, "c": 1, "b": 30}


def test_long_partial_prefills_are_limited_separately():
    """2 partial prefills allowed, only 1 of them long (> 20 tokens left): the shorter C
    starts before B, and B starts only when A is no longer long; the budget is split between
    the 2 prefill slots (16 tokens each)."""
    s, _ = make(budget=32, max_num_partial_prefills=2, max_long_partial_prefills=1, long_prefill_token_threshold=20)
    s.add_request(req("A", 100))
    s.add_request(req("B", 100))
    s.add_request(req("C", 18, max_tokens=10))
    assert step(s)[0] == {"A": 16, "C": 16}               # B (long) deferred: A already is the long one
    assert step(s)[0] == {"A": 16, "C": 2}                # 2 partial prefills in flight: B still waits
    for _ in range(3):                                    # a slot is free, but A is still long (68, 52, 36 left)
        assert step(s)[0] == {"A": 16, "C": 1}
    assert step(s)[0] == {"A": 16, "C": 1, "B": 15}       # A has 20 left: not long any more, B starts


def test_chunking_composes_with_prefix_caching():
    s, _ = make(budget=8, block_size=4)
    s.add_request(req("a", 20, max_tokens=1, first_token=0))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(Request("b", list(range(16)) + [77] * 10, max_tokens=1))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16 and out.num_scheduled_tokens == {"b": 8}


def test_a_partially_prefilled_request_can_be_preempted():
    s, kv = make(budget=8, num_blocks=6, block_size=4, caching=False)
    s.add_request(req("old", 11, max_tokens=10, arrival=0))
    step(s)
    step(s)                                               # old: 11 computed -> decoding, 3 blocks
    s.add_request(req("new", 16, max_tokens=1, arrival=1))
    step(s)                                               # new: chunk of 7 tokens, 2 blocks: pool full
    scheduled, _ = step(s)
    new = s.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.num_tokens == 16
    assert scheduled == {"old": 1}


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 80), st.integers(8, 40))
def test_chunks_advance_computed_tokens_not_total_tokens(L, budget):
    """The "chunked prefills" row of [Kwon 2025, §4.4.4, Table 4.1]: Δ < L_prompt per step; num_computed_tokens += Δ; num_total_tokens stays L_prompt until
    the prompt is done, then the first token makes it L_prompt + 1."""
    s, _ = make(budget=budget, max_model_len=128, num_blocks=64)
    r = req("a", L, max_tokens=3)
    s.add_request(r)
    computed = 0
    while computed < L:
        scheduled, _ = step(s)
        delta = scheduled["a"]
        assert delta == min(L - computed, budget)
        computed += delta
        assert r.num_computed_tokens == computed
        assert r.num_tokens == (L if computed < L else L + 1)
