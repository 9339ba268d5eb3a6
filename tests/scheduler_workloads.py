"""Random scheduler workloads, checked after every step and against a shadow of every KV slot.

Shared by the chapters' property tests: chapter 03 runs them on its core `Scheduler`, chapter 05
on `ChunkedPrefillScheduler`, and the integration tests on the engine's composed scheduler
(`mini_vllm.engine_scheduler.make_scheduler`) with speculative drafts and a KV connector — the
interactions no single chapter can test. A workload only uses what its scheduler has: drafts when
it has `update_draft_token_ids`, a connector when asked for one (chapter 06's shadow connector).

After EVERY step: sum(Δ) <= max_num_batched_tokens, len(running) <= max_num_seqs, no request
both waiting and running, the scheduler's and the KV manager's invariants; and, through
`ShadowKVRunner`, before every forward pass: every position a scheduled request attends to holds
the K/V of exactly its own prefix (a shadow of every slot, written through the runner's own block
tables, moved by the swap pairs, loaded by the connector). At the end: every admitted request
finished (no deadlock, no livelock) and not one KV block, CPU block or block hash is left behind.

Also the two helpers of the chapters' exact scheduler tests: `req` (a request with a distinct
prompt) and `step` (schedule, run the mock model, update, check every invariant).
"""
from __future__ import annotations

import itertools
import random
from typing import Callable

from scheduler import MockModelRunner, POLICIES, Request, RequestStatus, SchedulerConfig, ShadowKVRunner

EOS = 2
SHARED_PREFIX = list(range(100, 140))    # some prompts share a prefix: prefix-cache hits happen

# factory(config, kv_cache_manager, connector or None) -> a scheduler
SchedulerFactory = Callable

_distinct = itertools.count(1)


def req(rid, prompt_len, max_tokens=8, arrival=0.0, first_token=None, **kw) -> Request:
    """Prompts are distinct unless first_token says otherwise (no accidental prefix hits)."""
    first = 1000 * next(_distinct) if first_token is None else first_token
    return Request(rid, list(range(first, first + prompt_len)), max_tokens=max_tokens, arrival_time=arrival, **kw)


def step(s, runner=MockModelRunner()):
    """One step through the mock model, every invariant checked -> (SchedulerOutput, {id: output})."""
    out = s.schedule()
    outs = s.update_from_output(out, runner.execute(s.requests, out))
    s.check_invariants()
    s.kv_cache_manager.check_invariants()
    return out, {o.request_id: o for o in outs}


def make_runner(num_blocks, block_size, num_cpu_blocks, connector, **kwargs) -> ShadowKVRunner:
    if connector is None:
        return ShadowKVRunner(num_blocks, block_size, num_cpu_blocks, **kwargs)
    from global_prefix_cache.shadow_connector import ShadowKVConnectorRunner
    return ShadowKVConnectorRunner(num_blocks, block_size, num_cpu_blocks, connector=connector, **kwargs)


def make_connector(rng: random.Random):
    from global_prefix_cache.shadow_connector import ShadowKVConnector
    return ShadowKVConnector(rng)


def propose_drafts(s, drafts: dict[str, list[int]]) -> None:
    if hasattr(s, "update_draft_token_ids"):
        s.update_draft_token_ids(drafts)


def check_step(s, kv, out) -> None:
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


def assert_drained(s, kv, admitted, finished, num_blocks) -> None:
    assert not s.has_unfinished_requests(), f"stuck with {s.get_request_counts()} (running, waiting)"
    assert set(finished) == set(admitted)
    assert kv.num_free_blocks == num_blocks and not kv.req_to_blocks
    assert not kv.swapped_out and kv.num_free_cpu_blocks == (kv.cpu_block_pool.num_blocks if kv.cpu_block_pool else 0)
    assert not kv.req_to_block_hashes, "block hashes of finished requests were not dropped"


def random_workload(data, factory: SchedulerFactory, with_connector: bool) -> None:
    """Random arrivals, aborts, streaming input (and drafts, a connector) on a tiny KV cache
    that forces preemptions, every policy and both preemption modes. `data`: hypothesis' st.data()."""
    from hypothesis import strategies as st

    from kvcache import BlockSpaceManager

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
    connector = make_connector(rng) if with_connector and data.draw(st.booleans(), label="connector") else None
    s = factory(config, kv, connector)
    runner = make_runner(num_blocks, block_size, num_cpu_blocks, connector,
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

    for t in range(data.draw(st.integers(1, 40))):
        for _ in range(data.draw(st.integers(0, 3), label="arrivals")):
            rid = f"r{len(admitted)}"
            prefix = SHARED_PREFIX[:rng.choice([0, 0, 8, 16])]
            prompt = prefix + [rng.randrange(200, 300) for _ in range(rng.randint(1, 40 - len(prefix)))]
            streaming = rng.random() < 0.2
            s.add_request(Request(rid, prompt, max_tokens=rng.randint(1, 16), arrival_time=t + rng.random(),
                                  priority=rng.randint(0, 2), eos_token_id=EOS, streaming_input=streaming))
            admitted.add(rid)
        for r in [r for r in s.requests.values() if r.streaming_input]:
            if rng.random() < 0.5:      # more prompt arrives ([Kwon 2025, Table 4.1], streaming prefill), or it closes
                more = [rng.randrange(200, 300) for _ in range(rng.randint(0, 6))]
                if r.num_tokens + len(more) >= max_model_len - 1:
                    more = []
                if more or r.num_computed_tokens < r.num_tokens:
                    s.add_prompt_tokens(r.request_id, more, final=rng.random() < 0.5)
        if admitted and rng.random() < 0.15:
            victim = rng.choice(sorted(admitted))
            if s.abort(victim):
                finished[victim] = "abort"
        propose_drafts(s, {r.request_id: [rng.randrange(1, 9) for _ in range(rng.randint(0, 3))]
                           for r in s.running if rng.random() < 0.3})
        run_step()

    for r in [r for r in s.requests.values() if r.streaming_input]:   # the inputs close
        s.add_prompt_tokens(r.request_id, [] if r.num_computed_tokens < r.num_tokens else [7], final=True)
    for _ in range(2000):                    # no more arrivals: everything must drain
        if not s.has_unfinished_requests():
            break
        run_step()
    assert_drained(s, kv, admitted, finished, num_blocks)


# ---------------------------------------------------------------- chunked prefill (chapter 05 and later)
def run_chunked_workload(factory: SchedulerFactory, max_num_seqs, budget, policy, preemption_mode, partial,
                         long_partial, threshold, lookahead, num_blocks, block_size, caching, seed, with_connector,
                         num_steps) -> None:
    """One random chunked-prefill workload, checked after every step; raises on any violation.
    `factory` must accept chapter 05's ChunkedPrefillConfig."""
    from chunked_prefill import ChunkedPrefillConfig
    from kvcache import BlockSpaceManager

    max_model_len = 64
    config = ChunkedPrefillConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len, policy=policy,
        preemption_mode=preemption_mode, max_num_partial_prefills=partial, max_long_partial_prefills=long_partial,
        long_prefill_token_threshold=threshold, num_lookahead_tokens=lookahead)
    kv = BlockSpaceManager(num_blocks, block_size, enable_caching=caching, num_cpu_blocks=8)
    rng = random.Random(seed)
    connector = make_connector(rng) if with_connector else None
    s = factory(config, kv, connector)
    runner = make_runner(num_blocks, block_size, 8, connector, next_token=lambda r: rng.choice([1, 3, EOS]),
                         num_accepted=lambda r, drafts: rng.randint(0, len(drafts)))
    admitted, finished = set(), set()

    def run_step():
        out = s.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= config.max_num_batched_tokens
        assert len(s.running) <= config.max_num_seqs
        # max_num_partial_prefills holds for every way into RUNNING, swap-ins included. (A prefill
        # is partial while more than one token is left: one left is a decode, as the scheduler counts.)
        partial_prefills = [r for r in s.running if r.num_tokens - r.num_computed_tokens > 1]
        assert len(partial_prefills) <= config.max_num_partial_prefills, partial_prefills
        s.check_invariants(in_flight=out)
        kv.check_invariants()
        for o in s.update_from_output(out, runner.execute(s.requests, out)):
            if o.finished:
                assert o.request_id not in finished
                finished.add(o.request_id)
        s.check_invariants()

    for t in range(num_steps):
        for _ in range(rng.randint(0, 2)):
            rid = f"r{len(admitted)}"
            shared = list(range(100, 100 + rng.choice([0, 0, 8, 16])))      # prefix-cache hits happen
            prompt = shared + [rng.randrange(3, 40) for _ in range(rng.randint(1, max_model_len - 2 - len(shared)))]
            s.add_request(Request(rid, prompt, max_tokens=rng.randint(1, 12), arrival_time=t, eos_token_id=EOS,
                                  priority=rng.randint(0, 1)))
            admitted.add(rid)
        if admitted and rng.random() < 0.1:
            victim = rng.choice(sorted(admitted))
            if s.abort(victim):
                finished.add(victim)
        propose_drafts(s, {r.request_id: [5] * rng.randint(0, 3) for r in s.running if rng.random() < 0.3})
        run_step()
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        run_step()
    assert not s.has_unfinished_requests(), f"stuck with {s.get_request_counts()} (running, waiting)"
    assert finished == admitted
    assert kv.num_free_blocks == num_blocks and not kv.req_to_blocks and not kv.swapped_out
    assert kv.num_free_cpu_blocks == 8 and not kv.req_to_block_hashes


def draw_chunked_workload(integers, choice, boolean) -> tuple:
    """The arguments of `run_chunked_workload` after `factory`, from the ranges the property tests
    cover. `integers(lo, hi)`, `choice(values)` and `boolean()` are Hypothesis draws in the tests and
    a `random.Random` in tests/integration/search_workloads.py: one distribution, two ways to sample it."""
    max_num_seqs, partial = integers(1, 6), integers(1, 3)
    return (max_num_seqs, integers(max(8, max_num_seqs), 40), choice(POLICIES), choice(["recompute", "swap"]),
            partial, integers(1, partial), choice([0, 4, 12, 30]), integers(0, 2), integers(8, 30),
            choice([2, 4, 8]), boolean(), integers(0, 2**32 - 1), boolean(), integers(1, 30))
