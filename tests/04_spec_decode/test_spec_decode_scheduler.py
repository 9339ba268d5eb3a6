"""Chapter 04's `SpecDecodeScheduler`: drafts ride along in Δ, rejected ones are rolled back
([Kwon 2025, Table 4.1], the speculative-decoding row), exact traces step by step."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockSpaceManager, KVCacheManager
from scheduler import MockModelRunner, ModelRunnerOutput, Request, SchedulerConfig
from spec_decode.scheduler import SpecDecodeScheduler

MAX_MODEL_LEN = 128
_distinct = itertools.count(1)


def make(num_blocks=16, block_size=4, budget=64, max_model_len=64, **config):
    kv = BlockSpaceManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len, **config)
    return SpecDecodeScheduler(config, kv), kv


def req(rid, prompt_len, max_tokens=8):
    first = 1000 * next(_distinct)
    return Request(rid, list(range(first, first + prompt_len)), max_tokens=max_tokens)


def step(s, runner=MockModelRunner()):
    out = s.schedule()
    s.check_invariants(in_flight=out)
    outs = s.update_from_output(out, runner.execute(s.requests, out))
    s.check_invariants()
    s.kv_cache_manager.check_invariants()
    return out, {o.request_id: o for o in outs}


def counters(request):
    return request.num_computed_tokens, request.num_tokens


def test_speculative_drafts_are_scheduled_and_rejected_ones_rolled_back():
    runner = MockModelRunner(next_token=lambda r: 7, num_accepted=lambda r, drafts: min(1, len(drafts)))
    s, kv = make(num_lookahead_tokens=3)
    s.add_request(req("a", 5, max_tokens=20))
    s.update_draft_token_ids({"a": [1, 2]})              # ignored: still prefilling
    step(s, runner)
    r = s.requests["a"]
    assert (r.num_computed_tokens, r.num_tokens) == (5, 6)
    s.update_draft_token_ids({"a": [40, 41, 42]})
    out, outs = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {"a": [40, 41, 42]}
    # [Kwon 2025, Table 4.1]: computed += Δ - L_rejected = 4 - 2; total += L_draft - L_rejected + 1 = 3 - 2 + 1
    assert (r.num_computed_tokens, r.num_tokens) == (7, 8)
    assert outs["a"].new_token_ids == [40, 7] and r.spec_token_ids == []
    assert kv.get_block_ids("a") == [0, 1, 2]            # 4 + 3 lookahead slots were reserved


def test_drafts_are_trimmed_to_max_model_len():
    s, _ = make(max_model_len=10, budget=16)
    s.add_request(req("a", 6, max_tokens=20))
    step(s)                                              # 7 tokens now
    s.update_draft_token_ids({"a": [1, 2, 3, 4, 5]})
    out, _ = step(s)
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2]}   # positions up to max_model_len - 2


def test_more_sampled_tokens_than_drafts_is_refused():
    s, _ = make()
    s.add_request(req("a", 4))
    out = s.schedule()
    with pytest.raises(ValueError, match="2 sampled tokens for 0 drafts"):
        s.update_from_output(out, ModelRunnerOutput(["a"], [[1, 2]]))


def test_preemption_drops_the_drafts():
    """A preempted request's drafts are stale (they were proposed for KV that is gone)."""
    s, kv = make(num_blocks=3, block_size=4, num_lookahead_tokens=2)
    s.add_request(req("a", 4, max_tokens=20))
    s.add_request(req("b", 4, max_tokens=20))
    step(s)
    s.update_draft_token_ids({"a": [1, 2], "b": [3, 4]})
    out, _ = step(s)                                     # both want lookahead blocks: b is preempted
    assert "b" in out.preempted_req_ids and s.requests["b"].spec_token_ids == []
    assert "b" not in out.scheduled_spec_decode_tokens


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(0, 4), st.data())
def test_speculative_decoding(L, L_draft, data):
    L_rejected = data.draw(st.integers(0, L_draft))
    runner = MockModelRunner(num_accepted=lambda r, drafts: max(0, len(drafts) - L_rejected))
    s = SpecDecodeScheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN,
                                            max_model_len=MAX_MODEL_LEN, num_lookahead_tokens=4),
                            KVCacheManager(64, 4))
    r = Request("a", list(range(L)), max_tokens=100)
    s.add_request(r)
    step(s, runner)
    s.update_draft_token_ids({"a": list(range(50, 50 + L_draft))})
    computed, total = counters(r)
    out, _ = step(s, runner)
    delta = out.num_scheduled_tokens["a"]
    assert delta == 1 + L_draft
    assert counters(r) == (computed + delta - L_rejected, total + L_draft - L_rejected + 1)
