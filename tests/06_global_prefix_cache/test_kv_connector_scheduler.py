"""Chapter 06's `KVConnectorScheduler`: K/V computed elsewhere enters a request as a prefix-cache
hit that lives on another machine ([Kwon 2025, §4.4.4, Table 4.1], the prefill-disaggregation
row), exact traces step by step: asynchronous loads wait in WAITING_FOR_REMOTE_KVS without
blocking the queue, the last token is always computed, and idle holders of loaded K/V give their
blocks up when the pool is full."""
from hypothesis import given, settings
from hypothesis import strategies as st

from global_prefix_cache.scheduler import KVConnectorBase, KVConnectorScheduler
from kvcache import BlockSpaceManager, KVCacheManager
from scheduler import MockModelRunner, ModelRunnerOutput, Request, RequestStatus, SchedulerConfig
from scheduler_workloads import req, step

MAX_MODEL_LEN = 128


def test_without_a_connector_it_schedules_exactly_as_chapter_03():
    """The engine composes this layer always; with no connector every step equals the core's."""
    from scheduler import Scheduler
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64)
    traces = []
    for cls, kwargs in ((Scheduler, {}), (KVConnectorScheduler, {"connector": None})):
        s = cls(config, BlockSpaceManager(10, 4), **kwargs)
        for i, n in enumerate((9, 17, 5, 30, 12)):
            s.add_request(req(f"r{i}", n, max_tokens=6, first_token=7 * i + 1))
        trace = []
        while s.has_unfinished_requests():
            out, outs = step(s)
            trace.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids),
                          sorted((k, o.new_token_ids, o.finish_reason) for k, o in outs.items())))
        traces.append(trace)
    assert traces[0] == traces[1] and any(t[1] for t in traces[0]), "the pool must force preemptions"


class AsyncConnector(KVConnectorBase):
    """A remote prefill worker has computed the whole prompt; the KV arrives asynchronously."""

    def __init__(self, num_tokens):
        self.num_tokens, self.allocated = num_tokens, {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (block_ids, num_external_tokens)


def test_remote_kv_load_then_decode():
    """The "disaggregation" row of the two-counter table [Kwon 2025, §4.4.4, Table 4.1]: a remote load
    advances num_computed_tokens by the loaded tokens without a forward pass; decoding follows."""
    kv = BlockSpaceManager(16, 4)
    connector = AsyncConnector(num_tokens=8)
    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
                             connector=connector)
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
    # [Kwon 2025, Table 4.1]: num_computed_tokens <- L_prompt, num_total_tokens <- L_prompt + 1, then decode.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8 and out.num_scheduled_tokens == {"d": 1}
    assert kv.get_computed_blocks(probe)[1] == 8         # now cached
    assert outs["d"].new_token_ids == [1]


def test_remote_kv_still_loading_is_skipped_not_blocking():
    kv = BlockSpaceManager(16, 4)
    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
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
    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
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
    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), kv,
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


class RemotePrefill(KVConnectorBase):
    """The prefill worker computed the whole prompt; its K/V is loaded asynchronously."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 60), st.integers(0, 10**6))
def test_prefill_disaggregation(L, first_token):
    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN,
                                             max_model_len=MAX_MODEL_LEN),
                             KVCacheManager(64, 4), connector=RemotePrefill())
    r = Request("d", list(range(L)), max_tokens=10)
    r.append_output_token_ids(first_token)                       # sampled by the prefill worker
    s.add_request(r)
    out = s.schedule()
    assert out.is_empty and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.update_from_output(out, ModelRunnerOutput([], [], finished_recving={"d"}))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == L    # computed <- L_prompt
    assert r.num_tokens == L + 1                                  # total = L_prompt + 1
    assert out.num_scheduled_tokens == {"d": 1}                  # and it simply decodes
