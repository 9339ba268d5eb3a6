"""A remote KV load that fails (vLLM's kv_load_failure_policy): the worker reports the blocks
it could not fill in `ModelRunnerOutput.invalid_block_ids`; under "recompute" the request
computes from its first invalid block on (its local prefix hit kept), under "fail" it finishes
with an error. Exact traces first, then the shadow-KV property test with failures injected."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockSpaceManager
from global_prefix_cache.scheduler import KVConnectorBase, KVConnectorScheduler
from global_prefix_cache.shadow_connector import ShadowKVConnector, ShadowKVConnectorRunner
from scheduler import FinishReason, MockModelRunner, ModelRunnerOutput, Request, RequestStatus, SchedulerConfig

PREFIX = list(range(100, 108))          # 2 blocks of 4: the local prefix hit


class Remote(KVConnectorBase):
    """Claims `num_tokens` after the local hit, asynchronously; records what the scheduler says."""

    def __init__(self, num_tokens, policy="recompute"):
        self.num_tokens, self.kv_load_failure_policy = num_tokens, policy
        self.asked, self.allocated, self.failed = [], {}, []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asked.append((request.request_id, num_computed_tokens))
        if request.request_id in self.failed:
            return 0, False
        return self.num_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)

    def request_load_failed(self, request):
        self.failed.append(request.request_id)


def make(connector, num_blocks=16):
    kv = BlockSpaceManager(num_blocks, 4)
    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
                             connector=connector)
    return s, kv


def run(s, out, **runner_fields):
    """Answer `out` like a runner whose connector reports `runner_fields`."""
    base = MockModelRunner().execute(s.requests, out)
    for name, value in runner_fields.items():
        setattr(base, name, value)
    outs = s.update_from_output(out, base)
    s.check_invariants()
    s.kv_cache_manager.check_invariants()
    return {o.request_id: o for o in outs}


def drain(s, max_steps=100):
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return
        run(s, s.schedule())
    raise AssertionError(f"not drained in {max_steps} steps: {s.requests}")


class NothingRemote(KVConnectorBase):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False


def warm_prefix(s):
    """A first request computes PREFIX locally (its 2 full blocks enter the prefix cache)."""
    connector, s.connector = s.connector, NothingRemote()
    s.add_request(Request("warm", PREFIX + [1], max_tokens=1))
    run(s, s.schedule())
    s.connector = connector


def test_recompute_rewinds_to_the_local_hit_and_keeps_the_blocks():
    connector = Remote(num_tokens=8)
    s, kv = make(connector)
    warm_prefix(s)
    r = Request("r", PREFIX + list(range(200, 209)), max_tokens=2)     # 17 tokens: 8 local + 8 remote + 1
    s.add_request(r)
    out = s.schedule()
    assert out.is_empty and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r.num_computed_tokens == 16
    blocks, n = connector.allocated["r"]
    assert n == 8 and len(blocks) == 4                  # 2 local-hit blocks + 2 being loaded
    # The load fails: every block it was filling is invalid.
    outs = run(s, out, invalid_block_ids=set(blocks[2:4]))
    assert outs == {} and connector.failed == ["r"]
    assert r.num_computed_tokens == 8 and kv.get_block_ids("r") == blocks       # rewound to the local hit
    probe = Request("probe", PREFIX + list(range(200, 209)), max_tokens=1)
    assert kv.get_computed_blocks(probe)[1] == 8                               # the failed blocks: not cached
    out = s.schedule()
    new, = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"r": 9}   # computes the rest itself
    assert new.block_ids[:4] == blocks and len(new.block_ids) == 5            # ... into the blocks it holds
    run(s, out)
    assert kv.get_computed_blocks(probe)[1] == 16                              # now computed, now cached
    drain(s)
    assert kv.num_free_blocks == 16 and not kv.req_to_blocks


def test_only_the_blocks_from_the_first_invalid_one_are_recomputed():
    connector = Remote(num_tokens=8)
    s, kv = make(connector)
    warm_prefix(s)
    r = Request("r", PREFIX + list(range(300, 309)), max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    blocks, _ = connector.allocated["r"]
    run(s, out, invalid_block_ids={blocks[3], 999})         # block 2 landed, block 3 did not; 999: nobody's
    assert r.num_computed_tokens == 12
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12 and out.num_scheduled_tokens == {"r": 5}
    run(s, out)
    assert not s.has_unfinished_requests() and kv.num_free_blocks == 16


def test_nothing_valid_left_starts_over_and_the_connector_is_not_asked_to_load_again():
    connector = Remote(num_tokens=8)
    s, kv = make(connector)
    r = Request("r", list(range(400, 410)), max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    blocks, _ = connector.allocated["r"]
    run(s, out, invalid_block_ids={blocks[0]})
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0 and "r" not in kv.req_to_blocks
    out = s.schedule()
    assert connector.asked == [("r", 0), ("r", 0)]          # asked again, answered 0: computed here
    assert out.num_scheduled_tokens == {"r": 10}
    run(s, out)
    assert not s.has_unfinished_requests() and kv.num_free_blocks == 16


def test_policy_fail_finishes_the_request_with_an_error():
    connector = Remote(num_tokens=8, policy="fail")
    s, kv = make(connector)
    s.add_request(Request("r", list(range(500, 510)), max_tokens=1))
    out = s.schedule()
    blocks, _ = connector.allocated["r"]
    outs = run(s, out, invalid_block_ids={blocks[1]})
    assert outs["r"].finish_reason == FinishReason.ERROR and "kv_load_failure_policy='fail'" in outs["r"].stop_reason
    assert "r" not in s.requests and "r" not in kv.req_to_blocks and connector.failed == []
    drain(s)
    assert kv.num_free_blocks == 16


def test_a_request_that_loaded_fine_is_not_touched():
    connector = Remote(num_tokens=8)
    s, kv = make(connector)
    s.add_request(Request("ok", list(range(700, 710)), max_tokens=1))
    s.add_request(Request("bad", list(range(800, 810)), max_tokens=1))
    out = s.schedule()
    bad_blocks, _ = connector.allocated["bad"]
    run(s, out, finished_recving={"ok"}, invalid_block_ids=set(bad_blocks))
    out = s.schedule()
    news = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    assert news == {"ok": 8, "bad": 0}                      # bad: asked again, answered 0
    run(s, out)
    assert kv.num_free_blocks == 16 and connector.failed == ["bad"]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_failed_loads_under_random_workloads_never_feed_wrong_kv_and_leak_nothing(data):
    """ShadowKVRunner poisons the invalid blocks: any position the scheduler lets a request
    attend to after a failure must hold the K/V of exactly its own prefix."""
    block_size = data.draw(st.sampled_from([2, 4]))
    num_blocks = data.draw(st.integers(8, 24))
    mode = data.draw(st.sampled_from(["recompute", "swap"]))
    num_cpu_blocks = 8 if mode == "swap" else 0
    kv = BlockSpaceManager(num_blocks, block_size, enable_caching=data.draw(st.booleans()),
                           num_cpu_blocks=num_cpu_blocks)
    config = SchedulerConfig(max_num_seqs=data.draw(st.integers(1, 4)), max_num_batched_tokens=64, max_model_len=48,
                             policy=data.draw(st.sampled_from(["fcfs", "priority", "srtf"])), preemption_mode=mode)
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    connector = ShadowKVConnector(rng, p_external=0.8, p_async=0.8, p_fail=data.draw(st.sampled_from([0.3, 0.7])))
    s = KVConnectorScheduler(config, kv, connector=connector)
    runner = ShadowKVConnectorRunner(num_blocks, block_size, num_cpu_blocks, connector=connector,
                                     next_token=lambda r: rng.choice([1, 3, 4]))
    prefix = list(range(100, 116))
    admitted = set()
    for t in range(data.draw(st.integers(1, 25))):
        for _ in range(rng.randint(0, 2)):
            rid = f"r{len(admitted)}"
            head = prefix[:rng.choice([0, 8, 16])]
            prompt = head + [rng.randrange(200, 300) for _ in range(rng.randint(1, 40 - len(head)))]
            s.add_request(Request(rid, prompt, max_tokens=rng.randint(1, 6), arrival_time=t + rng.random(),
                                  priority=rng.randint(0, 2)))
            admitted.add(rid)
        if admitted and rng.random() < 0.1:
            s.abort(rng.choice(sorted(admitted)))
        out = s.schedule()
        s.update_from_output(out, runner.execute(s.requests, out))
        s.check_invariants()
        kv.check_invariants()
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.update_from_output(out, runner.execute(s.requests, out))
        s.check_invariants()
    assert not s.has_unfinished_requests(), f"stuck with {s.get_request_counts()} (running, waiting)"
    assert kv.num_free_blocks == num_blocks and not kv.req_to_blocks and not kv.req_to_block_hashes
    assert connector.failed <= admitted


def test_the_property_test_injects_failures():
    """The harness really fails loads and the scheduler really recovers (guards the test above)."""
    rng = random.Random(5)
    kv = BlockSpaceManager(32, 4)
    connector = ShadowKVConnector(rng, p_external=1.0, p_async=1.0, p_fail=0.7)
    s = KVConnectorScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48), kv,
                  connector=connector)
    runner = ShadowKVConnectorRunner(32, 4, connector=connector)
    for i in range(12):
        s.add_request(Request(f"r{i}", [rng.randrange(200, 300) for _ in range(rng.randint(6, 30))], max_tokens=3))
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.update_from_output(out, runner.execute(s.requests, out))
    assert not s.has_unfinished_requests() and kv.num_free_blocks == 32
    assert connector.num_failed_loads >= 3 and connector.failed and runner.num_checked > 0
