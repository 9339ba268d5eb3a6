"""Scheduler traces, step by step: exact Δ per request, exact block ids, exact victims."""
import itertools

import pytest

from kvcache import BlockSpaceManager
from scheduler import (FinishReason, KVConnectorBase, MockModelRunner, ModelRunnerOutput, Request, RequestStatus, Scheduler,
                       SchedulerConfig)


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, caching=True, cpu=0, **config):
    kv = BlockSpaceManager(num_blocks, block_size, enable_caching=caching, num_cpu_blocks=cpu)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                             **config)
    return Scheduler(config, kv), kv


_distinct = itertools.count(1)


def req(rid, prompt_len, max_tokens=8, arrival=0.0, first_token=None, **kw):
    """Prompts are distinct unless first_token says otherwise (no accidental prefix hits)."""
    first = 1000 * next(_distinct) if first_token is None else first_token
    return Request(rid, list(range(first, first + prompt_len)), max_tokens=max_tokens, arrival_time=arrival, **kw)


def step(s, runner=MockModelRunner()):
    out = s.schedule()
    outs = s.update_from_output(out, runner.execute(s.requests, out))
    s.check_invariants()
    s.kv_cache_manager.check_invariants()
    return out, {o.request_id: o for o in outs}


def test_requests_join_and_leave_every_step():
    s, kv = make()
    s.add_request(req("r0", 5, max_tokens=3))
    s.add_request(req("r1", 6, max_tokens=1))
    s.add_request(req("r2", 7, max_tokens=2))
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"r0": 5, "r1": 6, "r2": 7} and out.total_num_scheduled_tokens == 18
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r0", "r1", "r2"]
    assert outs["r1"].finished and outs["r1"].finish_reason == FinishReason.LENGTH
    s.add_request(req("r3", 3, max_tokens=2))            # joins at the very next step
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"r0": 1, "r2": 1, "r3": 3}
    assert out.finished_req_ids == {"r1"}                 # the runner drops r1's state now
    assert out.scheduled_cached_reqs.req_ids == ["r0", "r2"]
    assert outs["r2"].finished
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"r0": 1, "r3": 1} and out.finished_req_ids == {"r2"}
    assert outs["r0"].finished and outs["r3"].finished
    assert not s.has_unfinished_requests() and kv.num_free_blocks == 16


def test_max_num_seqs_caps_the_running_set():
    s, _ = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, max_tokens=2))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 4, "r1": 4}
    assert s.get_request_counts() == (2, 1)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r2": 4}


def test_fcfs_head_of_line_blocking_on_the_token_budget():
    """A prompt that does not fit what is left of the budget is not split (no chunking) and
    nobody behind it jumps the queue."""
    s, _ = make(budget=32, max_model_len=32)
    s.add_request(req("r0", 20, arrival=0))
    s.add_request(req("r1", 20, arrival=1))
    s.add_request(req("r2", 4, arrival=2))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 20}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 20, "r2": 4}


def test_block_ids_new_then_appended():
    s, _ = make(block_size=4)
    s.add_request(req("r0", 6, max_tokens=10))
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("r0", [0, 1], 0)
    assert new.prompt_token_ids == list(s.requests["r0"].prompt_token_ids)
    out, _ = step(s)        # token 7 (position 6) fits in block 1
    assert out.scheduled_cached_reqs.new_block_ids == [[]] and out.scheduled_cached_reqs.num_computed_tokens == [6]
    out, _ = step(s)        # position 7: still block 1
    assert out.scheduled_cached_reqs.new_block_ids == [[]]
    out, _ = step(s)        # position 8: a new block
    assert out.scheduled_cached_reqs.new_block_ids == [[2]] and out.scheduled_cached_reqs.num_computed_tokens == [8]


def test_prefix_cache_hit_starts_at_the_cached_length():
    s, kv = make(block_size=4)
    s.add_request(req("a", 9, max_tokens=4, first_token=0))
    step(s)
    s.add_request(Request("b", list(range(8)) + [99, 98], max_tokens=4))
    out, outs = step(s)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == [0, 1]      # a's first two blocks
    assert out.num_scheduled_tokens["b"] == 2                                # only 10 - 8 tokens computed
    assert outs["b"].num_cached_tokens == 8


def test_prefix_hits_on_free_blocks_leave_the_free_pool():
    """A cached block nobody holds is both a prefix hit and a free block: it must not be
    counted twice. Here the only free blocks ARE c's two hits, so c (4 blocks) must wait."""
    s, kv = make(num_blocks=4, block_size=4)
    s.add_request(req("a", 8, max_tokens=1, first_token=0))
    step(s)                                              # a done: its 2 full blocks cached, free
    s.add_request(req("b", 5, max_tokens=3))             # b takes the 2 never-used blocks (8 tokens max)
    step(s)
    s.add_request(Request("c", list(range(8)) + [50] * 5, max_tokens=1))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 1}          # c: 2 hits + 2 new blocks > 2 free: waits
    out, outs = step(s)
    assert outs["b"].finished and "c" not in out.num_scheduled_tokens
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"c": 5} and out.scheduled_new_reqs[0].num_computed_tokens == 8


def _fill_pool_then_grow(mode="recompute", cpu=0, caching=False):
    """4 blocks of 4: r0 and r1 (7-token prompts) take two blocks each; r0 then needs a third."""
    s, kv = make(num_blocks=4, block_size=4, caching=caching, cpu=cpu, preemption_mode=mode)
    s.add_request(req("r0", 7, max_tokens=4, arrival=0))
    s.add_request(req("r1", 7, max_tokens=4, arrival=1, first_token=100))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 7, "r1": 7} and kv.num_free_blocks == 0
    out, _ = step(s)                                     # position 7: both still fit in block 2 of 2
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1}
    return s, kv


def test_recompute_preemption_latest_arrival_all_or_nothing():
    s, kv = _fill_pool_then_grow()
    r1 = s.requests["r1"]
    out, _ = step(s)                                     # r0 needs a 3rd block: r1 (latest) is evicted
    assert out.preempted_req_ids == {"r1"} and out.num_scheduled_tokens == {"r0": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [[3]]            # r1's tail block, freed first
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0 and r1.num_tokens == 9
    assert kv.num_free_blocks == 1 and [r.request_id for r in s.waiting] == ["r1"]
    out, outs = step(s)                                  # r0 finishes; r1 does not fit yet
    assert out.num_scheduled_tokens == {"r0": 1} and outs["r0"].finished
    out, _ = step(s)                                     # r1 resumes: prompt + output in ONE step
    assert out.num_scheduled_tokens == {"r1": 9}
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["r1"] and cached.resumed_from_preemption == [True]
    # LRU: the free queue holds [2] then r0's blocks tail first [3, 1, 0].
    assert cached.new_block_ids == [[2, 3, 1]] and cached.num_computed_tokens == [0]
    assert cached.resumed_token_ids == {"r1": list(range(100, 107)) + [1, 1]}
    assert r1.num_preemptions == 1


def test_recompute_preemption_gets_its_kv_back_from_the_prefix_cache():
    s, kv = _fill_pool_then_grow(caching=True)
    step(s)    # r1 preempted; its 2 full blocks stay cached, freed tail first: r0 takes (evicts) block 3
    step(s)    # r0 finishes
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"r1": 9 - 4}     # its first block survived in the prefix cache
    assert out.scheduled_cached_reqs.num_computed_tokens == [4]
    assert out.scheduled_cached_reqs.new_block_ids[0][0] == 2


def test_swap_preemption_keeps_the_kv_and_swaps_it_back():
    s, kv = _fill_pool_then_grow(mode="swap", cpu=8)
    r1 = s.requests["r1"]
    out, _ = step(s)
    assert out.preempted_req_ids == {"r1"} and out.blocks_to_swap_out == [(2, 0), (3, 1)]
    assert r1.kv_swapped_out and r1.num_computed_tokens == 8 and kv.num_free_cpu_blocks == 6
    out, _ = step(s)                                     # r0 finishes, freeing its 3 blocks
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r1": 1}         # no recompute: only its next token
    assert out.blocks_to_swap_in == [(0, 2), (1, 3)]
    assert out.scheduled_cached_reqs.resumed_from_preemption == [True]
    assert out.scheduled_cached_reqs.new_block_ids == [[2, 3, 1]]   # + a fresh block for position 8
    assert not r1.kv_swapped_out and kv.num_free_cpu_blocks == 8


def test_swap_falls_back_to_recompute_when_the_cpu_tier_cannot_hold_it():
    s, kv = _fill_pool_then_grow(mode="swap", cpu=1)
    out, _ = step(s)
    assert out.preempted_req_ids == {"r1"} and out.blocks_to_swap_out == []
    assert s.requests["r1"].num_computed_tokens == 0 and not s.requests["r1"].kv_swapped_out


def test_a_request_that_can_never_fit_fails_with_a_reason():
    s, kv = make(num_blocks=4, block_size=4)
    s.add_request(req("huge", 20))                      # 5 blocks > 4, even alone
    s.add_request(req("ok", 4, max_tokens=1))
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"ok": 4}
    assert outs["huge"].finish_reason == FinishReason.LENGTH and "the pool has only 4" in outs["huge"].stop_reason
    assert "huge" not in s.requests and out.finished_req_ids == {"huge"}
    assert s.schedule().finished_req_ids == {"ok"}


def test_a_request_that_outgrows_the_cache_fails_after_its_tokens():
    s, kv = make(num_blocks=4, block_size=4)
    s.add_request(req("grow", 14, max_tokens=10))
    tokens = []
    for _ in range(4):
        _, outs = step(s)
        tokens += outs["grow"].new_token_ids if "grow" in outs else []
        if "grow" in outs and outs["grow"].finished:
            break
    assert tokens == [1, 1, 1]                           # 16 tokens fill all 4 blocks
    assert outs["grow"].finished and "needs 5 blocks" in outs["grow"].stop_reason
    assert kv.num_free_blocks == 4 and not s.has_unfinished_requests()


def test_abort_in_every_state_frees_everything():
    s, kv = _fill_pool_then_grow(mode="swap", cpu=8)
    step(s)                                              # r1 swapped out
    s.add_request(req("w", 3, arrival=5))
    assert s.abort("r1") and s.abort("w") and not s.abort("nope") and not s.abort("r1")
    assert kv.num_free_cpu_blocks == 8
    out = s.schedule()
    assert out.finished_req_ids == {"r1", "w"}
    assert s.abort("r0")                                 # running, and scheduled in this very step
    outs = s.update_from_output(out, ModelRunnerOutput(["r0"], [[5]]))
    assert outs == []                                    # its in-flight token is dropped
    assert kv.num_free_blocks == 4 and not s.has_unfinished_requests()
    kv.check_invariants()


def test_finish_requests_from_outside():
    s, kv = make()
    s.add_request(req("a", 4))
    step(s)
    assert s.finish_requests(["a", "a", "zzz"], RequestStatus.FINISHED_STOPPED) == ["a"]
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_requests("a", RequestStatus.RUNNING)
    assert kv.num_free_blocks == 16


def test_add_request_validation():
    s, _ = make(max_model_len=16, budget=16)
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="duplicate request id"):
        s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="no room to generate"):
        s.add_request(req("b", 16))
    r = req("c", 4)
    r.num_computed_tokens = 2
    with pytest.raises(ValueError, match="already scheduled"):
        s.add_request(r)
    assert list(s.requests) == ["a"]


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
    # Table 4.1: computed += Δ - L_rejected = 4 - 2; total += L_draft - L_rejected + 1 = 3 - 2 + 1
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


class AsyncConnector(KVConnectorBase):
    """A remote prefill worker has computed the whole prompt; the KV arrives asynchronously."""

    def __init__(self, num_tokens):
        self.num_tokens, self.allocated = num_tokens, {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (block_ids, num_external_tokens)


def test_remote_kv_load_then_decode_table_4_1_disaggregation():
    kv = BlockSpaceManager(16, 4)
    connector = AsyncConnector(num_tokens=8)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv, connector=connector)
    r = req("d", 8, first_token=0)
    r.append_output_token_ids(55)                        # the prefill worker's first token
    s.add_request(r)
    out = s.schedule()
    assert out.is_empty and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.allocated == {"d": ([0, 1], 8)}
    probe = Request("probe", list(range(8)) + [55, 56], max_tokens=1)
    assert kv.get_computed_blocks(probe)[1] == 0         # not published before the KV has landed
    s.update_from_output(out, ModelRunnerOutput([], [], finished_recving={"d"}))
    out, outs = step(s)
    # Table 4.1: num_computed_tokens <- L_prompt, num_total_tokens <- L_prompt + 1, then decode.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8 and out.num_scheduled_tokens == {"d": 1}
    assert kv.get_computed_blocks(probe)[1] == 8         # now cached
    assert outs["d"].new_token_ids == [1]


def test_remote_kv_still_loading_is_skipped_not_blocking():
    kv = BlockSpaceManager(16, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
                  connector=AsyncConnector(num_tokens=7))
    s.add_request(req("remote", 8))
    s.schedule()
    s.connector.num_tokens = 0
    s.connector.get_num_new_matched_tokens = lambda request, n: (0, False)
    s.add_request(req("local", 3, first_token=50))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"local": 3}      # behind a loading request, not blocked by it
    assert s.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.abort("remote") and kv.num_free_blocks == 16 - 1


def test_streaming_input_table_4_1_streaming_prefill():
    s, _ = make()
    r = req("live", 4, max_tokens=3, streaming_input=True)
    s.add_request(r)
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"live": 4} and outs == {}   # no token sampled from an open prompt
    out, _ = step(s)
    assert out.num_scheduled_tokens == {}                # caught up: nothing to do, still holds its KV
    s.add_prompt_tokens("live", [9, 9, 9], final=False)
    assert (r.num_computed_tokens, r.num_tokens) == (4, 7)          # total += L_new, computed unchanged
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"live": 3} and outs == {}
    s.add_prompt_tokens("live", [8], final=True)
    out, outs = step(s)
    assert out.num_scheduled_tokens == {"live": 1} and outs["live"].new_token_ids == [1]
    with pytest.raises(KeyError):
        s.add_prompt_tokens("nope", [1], final=True)


def test_update_from_output_rejects_inconsistent_runner_output():
    s, _ = make(block_size=4)
    s.add_request(req("a", 4))
    out = s.schedule()
    with pytest.raises(ValueError, match="returned nothing for scheduled request a"):
        s.update_from_output(out, ModelRunnerOutput([], []))
    with pytest.raises(ValueError, match="2 sampled tokens for 0 drafts"):
        s.update_from_output(out, ModelRunnerOutput(["a"], [[1, 2]]))
    with pytest.raises(ValueError, match="1 req_ids but 0 sampled"):
        ModelRunnerOutput(["a"], [])


def test_priority_policy_serves_and_preempts_by_priority():
    s, kv = make(num_blocks=4, block_size=4, policy="priority", caching=False)
    s.add_request(req("low", 7, arrival=0, priority=5))
    s.add_request(req("high", 7, arrival=1, priority=0))
    out, _ = step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["high", "low"]
    step(s)
    out, _ = step(s)                                     # high needs a block: low is the victim
    assert out.preempted_req_ids == {"low"}


def test_empty_scheduler_schedules_nothing():
    s, _ = make()
    out = s.schedule()
    assert out.is_empty and out.num_scheduled_tokens == {} and not s.has_unfinished_requests()


# ------------------------------------------------------------------------------ caching only what is computed
def test_a_shared_prefix_being_computed_is_waited_for_not_computed_twice():
    """B shares A's 8-token prefix and arrives in the same step. A's blocks are cached only
    after the step computes them, so B cannot hit them in that step: it is skipped (not a
    blocker: C behind it is admitted) and hits them the next step."""
    s, kv = make(num_blocks=16, block_size=4)
    prefix = list(range(500, 508))
    s.add_request(Request("A", prefix + [1, 2], max_tokens=3, arrival_time=0))
    s.add_request(Request("B", prefix + [3, 4], max_tokens=3, arrival_time=1))
    s.add_request(Request("C", [9, 9, 9], max_tokens=3, arrival_time=2))
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"A", "C"}
    assert kv.get_computed_blocks(Request("probe", prefix + [7], max_tokens=1))[1] == 8    # cached after the step
    out, _ = step(s)
    assert out.scheduled_new_reqs[0].req_id == "B" and out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens["B"] == 2


def test_a_request_preempted_in_the_step_that_scheduled_it_leaves_nothing_hittable():
    """Chapter 03's give-back path (no chunking needed): a running streaming request receives
    8 more prompt tokens (two blocks) and is scheduled for them; a higher-priority running
    request then needs a block, and the low one — already scheduled — is preempted. Its two new
    blocks were never computed: after the step nothing about them may be in the prefix cache,
    and the shadow runner checks every position it attends to when it comes back."""
    from scheduler import ShadowKVRunner
    kv = BlockSpaceManager(num_blocks=5, block_size=4)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, policy="priority")
    s = Scheduler(config, kv)
    runner = ShadowKVRunner(5, 4, next_token=lambda r: 7)
    low = Request("low", list(range(100, 108)), max_tokens=3, arrival_time=0, priority=1, streaming_input=True)
    s.add_request(low)
    out = s.schedule()
    s.update_from_output(out, runner.execute(s.requests, out))          # low: 8 tokens, 2 blocks
    s.add_request(Request("high", [300, 301, 302, 303], max_tokens=3, arrival_time=1, priority=0))
    out = s.schedule()
    s.update_from_output(out, runner.execute(s.requests, out))          # high: 1 block; low idle
    s.add_prompt_tokens("low", list(range(108, 116)), final=True)       # low wants 2 more blocks
    out = s.schedule()                                                   # low takes them, high needs 1 more
    assert "low" in out.preempted_req_ids and "low" not in out.num_scheduled_tokens
    probe = Request("probe", list(range(100, 116)) + [0], max_tokens=1)
    assert kv.get_computed_blocks(probe)[1] == 8                         # only what was computed
    s.update_from_output(out, runner.execute(s.requests, out))
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, runner.execute(s.requests, out))
    assert low.num_output_tokens == 3 and runner.num_checked > 0 and kv.num_free_blocks == 5


def test_a_connector_claiming_every_token_still_leaves_one_to_compute():
    """Issue 9, item 6: a connector that reports all remaining tokens as external used to make
    Δ = 0, and FCFS stopped at the head forever. The scheduler keeps the last token."""
    class ClaimsEverything(KVConnectorBase):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return request.num_tokens - num_computed_tokens, False
        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            self.claimed = num_external_tokens
    kv = BlockSpaceManager(num_blocks=16, block_size=4)
    connector = ClaimsEverything()
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
                  connector=connector)
    s.add_request(Request("a", list(range(10)), max_tokens=2))
    out, outs = step(s)
    assert connector.claimed == 9 and out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 9 and outs["a"].new_token_ids == [1]


class OneRemoteRequest(KVConnectorBase):
    """A remote prefill worker computed all but the last token of one request; its KV arrives
    asynchronously. Every other request finds nothing remote."""

    def __init__(self, request_id):
        self.request_id = request_id

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id != self.request_id:
            return 0, False
        return request.num_tokens - 1 - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass                                                 # the test reports the load landed


def _idle_holder_while_the_pool_fills(loaded_arrival, other_arrival):
    """max_num_seqs 2, an 8-block pool of 4-token blocks. "run" (arrival 0, 8 tokens) runs;
    "loaded" (16 tokens) starts its remote load into 4 blocks; "other" (3 tokens) takes the
    second seat, so "loaded" waits with its KV landed: an idle holder of 4 blocks. Returns
    the scheduler when the pool is full and "other" is about to need a second block."""
    kv = BlockSpaceManager(8, 4, enable_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), kv,
                  connector=OneRemoteRequest("loaded"))
    s.add_request(req("run", 8, max_tokens=20))
    step(s)                                                  # run: 8 computed, blocks 0-1
    s.add_request(req("loaded", 16, arrival=loaded_arrival))
    step(s)                                                  # run decodes into block 2; loaded's load starts
    assert s.requests["loaded"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.add_request(req("other", 3, max_tokens=20, arrival=other_arrival))
    out = s.schedule()                                       # other takes the last block
    output = MockModelRunner().execute(s.requests, out)
    output.finished_recving = {"loaded"}                     # ... and loaded's KV lands
    s.update_from_output(out, output)
    step(s)                                                  # other decodes its 4th token: block full
    assert [r.request_id for r in s.running] == ["run", "other"] and kv.num_free_blocks == 0
    assert s.requests["loaded"].num_computed_tokens == 15 and len(kv.get_block_ids("loaded")) == 4
    return s, kv


def test_a_full_pool_takes_an_idle_holders_blocks_before_a_running_request_ranked_above_it():
    """Found as a livelock by the chunked-prefill property test: a waiting request whose
    remote KV has landed holds its blocks until it is admitted. When the pool is full, it is
    one more candidate to give blocks up, ranked like the running requests: here it arrived
    last, so its KV is dropped (it starts over) and "other" gets its block and keeps running."""
    s, kv = _idle_holder_while_the_pool_fills(loaded_arrival=2.0, other_arrival=1.0)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"run": 1, "other": 1} and out.preempted_req_ids == set()
    loaded = s.requests["loaded"]
    assert (loaded.status, loaded.num_computed_tokens) == (RequestStatus.WAITING, 0)
    assert "loaded" not in kv.req_to_blocks and "loaded" not in s.finished_recving_kv_req_ids
    assert len(kv.get_block_ids("other")) == 2
    s.connector.request_id = None       # a restarted "loaded" would load again, and nobody here lands it
    while s.has_unfinished_requests():
        step(s)
    assert kv.num_free_blocks == 8


def test_a_full_pool_preempts_a_running_request_ranked_below_an_idle_holder():
    """The same pool, but the holder arrived before "other": "other" is preempted (it is the
    lowest-ranked), and the holder keeps its loaded KV and is admitted with it next step
    (15 tokens computed: nothing is recomputed)."""
    s, kv = _idle_holder_while_the_pool_fills(loaded_arrival=1.0, other_arrival=2.0)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"run": 1} and out.preempted_req_ids == {"other"}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"run": 1, "loaded": 1}
    assert out.scheduled_new_reqs[0].req_id == "loaded" and out.scheduled_new_reqs[0].num_computed_tokens == 15
    s.connector.request_id = None       # a restarted "loaded" would load again, and nobody here lands it
    while s.has_unfinished_requests():
        step(s)
    assert kv.num_free_blocks == 8
