"""Scheduler traces, step by step: exact Δ per request, exact block ids, exact victims."""
import pytest

from kvcache import BlockSpaceManager
from scheduler import FinishReason, ModelRunnerOutput, Request, RequestStatus, Scheduler, SchedulerConfig
from scheduler_workloads import req, step


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, caching=True, cpu=0, **config):
    kv = BlockSpaceManager(num_blocks, block_size, enable_caching=caching, num_cpu_blocks=cpu)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                             **config)
    return Scheduler(config, kv), kv


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


def test_streaming_input_grows_the_prompt_while_it_runs():
    """The "streaming input" row of the two-counter table [Kwon 2025, §4.4.4, Table 4.1]: new prompt
    tokens raise num_tokens, num_computed_tokens catches up, nothing is sampled until the prompt is final."""
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
    with pytest.raises(ValueError, match="2 sampled tokens for one position"):
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
