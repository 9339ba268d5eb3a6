"""Property tests: random arrivals, aborts, drafts, streaming input, a KV connector and a tiny
KV cache that forces preemptions, under every policy and both preemption modes. After EVERY step:
  sum(Δ) <= max_num_batched_tokens, len(running) <= max_num_seqs, no request both waiting and
  running, 0 <= num_computed_tokens <= num_tokens_with_spec, the KV manager's invariants;
and, through `ShadowKVRunner`, before every forward pass: every position a scheduled request
attends to holds the K/V of exactly its own prefix (a shadow of every slot, written through the
runner's own block tables, moved by the swap pairs, loaded by the connector).
At the end: every admitted request finished (no deadlock, no livelock) and not one KV block,
CPU block or block hash is left behind.
"""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockSpaceManager
from scheduler import POLICIES, Request, RequestStatus, Scheduler, SchedulerConfig, ShadowKVConnector, ShadowKVRunner

EOS = 2
SHARED_PREFIX = list(range(100, 140))    # some prompts share a prefix: prefix-cache hits happen


def check_step(s, kv, out):
    config = s.config
    assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(s.running) <= config.max_num_seqs
    for rid, n in out.num_scheduled_tokens.items():
        assert n > 0 and s.requests[rid].status == RequestStatus.RUNNING
    assert not set(out.num_scheduled_tokens) & out.preempted_req_ids
    new_ids = {r.req_id for r in out.scheduled_new_reqs}
    assert new_ids.isdisjoint(out.scheduled_cached_reqs.req_ids)
    assert new_ids | set(out.scheduled_cached_reqs.req_ids) == set(out.num_scheduled_tokens)
    s.check_invariants(in_flight=out)
    kv.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_workloads_keep_every_invariant_and_leak_nothing(data):
    policy = data.draw(st.sampled_from(POLICIES))
    mode = data.draw(st.sampled_from(["recompute", "swap"]))
    block_size = data.draw(st.sampled_from([2, 4, 8]))
    num_blocks = data.draw(st.integers(6, 24))
    max_model_len = 48
    num_cpu_blocks = data.draw(st.integers(1, 16)) if mode == "swap" else 0
    kv = BlockSpaceManager(num_blocks, block_size, enable_caching=data.draw(st.booleans()),
                           num_cpu_blocks=num_cpu_blocks)
    config = SchedulerConfig(max_num_seqs=data.draw(st.integers(1, 6)),
                             max_num_batched_tokens=data.draw(st.integers(max_model_len, 96)),
                             max_model_len=max_model_len, policy=policy, staging_size=data.draw(st.integers(1, 4)),
                             preemption_mode=mode, num_lookahead_tokens=data.draw(st.integers(0, 2)))
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    connector = ShadowKVConnector(rng) if data.draw(st.booleans(), label="connector") else None
    s = Scheduler(config, kv, connector=connector)
    runner = ShadowKVRunner(num_blocks, block_size, num_cpu_blocks, connector=connector,
                            next_token=lambda r: rng.choice([1, 3, 4, 5, EOS]),
                            num_accepted=lambda r, drafts: rng.randint(0, len(drafts)))
    admitted, finished = set(), {}

    def run_step():
        out = s.schedule()
        check_step(s, kv, out)
        for o in s.update_from_output(out, runner.execute(s.requests, out)):
            if o.finished:
                assert o.request_id not in finished, "a request finished twice"
                finished[o.request_id] = o.finish_reason
        s.check_invariants()
        kv.check_invariants()

    num_steps = data.draw(st.integers(1, 40))
    for t in range(num_steps):
        for _ in range(data.draw(st.integers(0, 3), label="arrivals")):
            rid = f"r{len(admitted)}"
            prefix = SHARED_PREFIX[:rng.choice([0, 0, 8, 16])]
            prompt = prefix + [rng.randrange(200, 300) for _ in range(rng.randint(1, 40 - len(prefix)))]
            streaming = rng.random() < 0.2
            s.add_request(Request(rid, prompt, max_tokens=rng.randint(1, 16), arrival_time=t + rng.random(),
                                  priority=rng.randint(0, 2), eos_token_id=EOS, streaming_input=streaming))
            admitted.add(rid)
        for r in [r for r in s.requests.values() if r.streaming_input]:
            if rng.random() < 0.5:      # more prompt arrives (Table 4.1, streaming prefill), or it closes
                more = [rng.randrange(200, 300) for _ in range(rng.randint(0, 6))]
                if r.num_tokens + len(more) >= max_model_len - 1:
                    more = []
                if more or r.num_computed_tokens < r.num_tokens:
                    s.add_prompt_tokens(r.request_id, more, final=rng.random() < 0.5)
        if admitted and rng.random() < 0.15:
            victim = rng.choice(sorted(admitted))
            if s.abort(victim):
                finished[victim] = "abort"
        drafts = {r.request_id: [rng.randrange(1, 9) for _ in range(rng.randint(0, 3))]
                  for r in s.running if rng.random() < 0.3}
        s.update_draft_token_ids(drafts)
        run_step()

    for r in [r for r in s.requests.values() if r.streaming_input]:   # the inputs close
        s.add_prompt_tokens(r.request_id, [] if r.num_computed_tokens < r.num_tokens else [7], final=True)
    for _ in range(2000):                    # no more arrivals: everything must drain
        if not s.has_unfinished_requests():
            break
        run_step()
    assert not s.has_unfinished_requests(), f"stuck with {s.get_request_counts()} (running, waiting)"
    assert set(finished) == admitted
    assert kv.num_free_blocks == num_blocks and not kv.req_to_blocks
    assert not kv.swapped_out and kv.num_free_cpu_blocks == (kv.cpu_block_pool.num_blocks if kv.cpu_block_pool else 0)
    assert not kv.req_to_block_hashes, "block hashes of finished requests were not dropped"
