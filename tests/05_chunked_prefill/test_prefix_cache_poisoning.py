"""The review's reproduction (issue 9, item 1), kept as a regression test: a low-priority long
prompt, chunked, is preempted by a high-priority request in a step that had ALREADY scheduled
its next chunk. Its blocks for that chunk were allocated but never computed; when it comes
back, a prefix-cache hit on them would attend to K/V nobody wrote. `ShadowKVRunner` checks
every attended position against the K/V of the request's own prefix."""
from chunked_prefill import ChunkedPrefillConfig, ChunkedPrefillScheduler
from kvcache import KVCacheManager
from scheduler import Request, RequestStatus, ShadowKVRunner


def test_preempted_in_the_step_that_scheduled_it_leaves_no_poisoned_prefix_hit():
    kv = KVCacheManager(7, 4)                     # 7 blocks of 4 tokens
    config = ChunkedPrefillConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                                  policy="priority", long_prefill_token_threshold=8)
    s = ChunkedPrefillScheduler(config, kv)
    runner = ShadowKVRunner(7, 4, next_token=lambda r: 7)
    low = Request("low", list(range(100, 124)), max_tokens=4, arrival_time=0, priority=1)
    s.add_request(low)
    preempted_after_scheduling = False
    for step in range(40):
        if step == 1:      # a short high-priority request joins behind the running long prompt
            s.add_request(Request("high", list(range(300, 304)), max_tokens=2, arrival_time=1, priority=0))
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        if "low" in out.preempted_req_ids:
            preempted_after_scheduling = True
            # Its third chunk (tokens 16..23) had been allocated this step: none of it is hittable.
            assert kv.get_computed_blocks(Request("probe", list(range(100, 124)), max_tokens=1))[1] <= 16
        s.update_from_output(out, runner.execute(s.requests, out))
    assert preempted_after_scheduling, "the scenario no longer reaches the give-back path"
    assert low.status == RequestStatus.FINISHED_LENGTH_CAPPED and low.num_output_tokens == 4
    assert runner.num_checked > 0 and kv.num_free_blocks == 7
