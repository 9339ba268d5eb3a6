"""The two counters through the real scheduler, as property tests, one row of [Kwon 2025,
Table 4.1] each (num_total_tokens is `Request.num_tokens`):

  Prefill                 Δ = L_prompt
  Decode                  Δ = 1
  Preemption              num_computed_tokens <- 0
  Streaming prefills      num_total_tokens <- num_total_tokens + L_new
  Prefix caching          num_computed_tokens <- L_cached

The table's other rows are the later chapters' own: chunked prefills (tests/05_chunked_prefill),
speculative decoding (tests/04_spec_decode/test_spec_decode_scheduler.py), prefill disaggregation
(tests/06_global_prefix_cache/test_kv_connector_scheduler.py).
"""
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager
from scheduler import MockModelRunner, Request, RequestStatus, Scheduler, SchedulerConfig

MAX_MODEL_LEN = 128


def make(num_blocks=64, block_size=4, caching=True):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=caching))


def counters(request):
    return request.num_computed_tokens, request.num_tokens


def step(s, runner=MockModelRunner()):
    out = s.schedule()
    s.update_from_output(out, runner.execute(s.requests, out))
    return out


prompt_lens = st.integers(1, 60)


@settings(max_examples=30, deadline=None)
@given(prompt_lens, st.integers(1, 10))
def test_prefill_then_decode(L, num_decodes):
    s = make()
    r = Request("a", list(range(L)), max_tokens=100)
    s.add_request(r)
    assert counters(r) == (0, L)
    out = step(s)
    assert out.num_scheduled_tokens == {"a": L}                 # prefill: Δ = L_prompt
    assert counters(r) == (L, L + 1)
    for k in range(1, num_decodes + 1):
        out = step(s)
        assert out.num_scheduled_tokens == {"a": 1}             # decode: Δ = 1
        assert counters(r) == (L + k, L + k + 1)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.integers(1, 4), st.integers(1, 30))
def test_preemption_resets_num_computed_only(block_size, k, L1):
    """r0's prompt fills k blocks exactly, so its first decode needs a new block; the pool has
    none left and r1 (the later arrival) is preempted."""
    L0 = k * block_size
    s = make(num_blocks=k + -(-L1 // block_size), block_size=block_size, caching=False)
    r0 = Request("r0", list(range(L0)), max_tokens=50, arrival_time=0)
    r1 = Request("r1", list(range(1000, 1000 + L1)), max_tokens=50, arrival_time=1)
    s.add_request(r0)
    s.add_request(r1)
    step(s)
    total_before = r1.num_tokens
    out = step(s)
    assert out.preempted_req_ids == {"r1"} and r1.status == RequestStatus.PREEMPTED
    assert counters(r1) == (0, total_before)                     # preemption: computed <- 0, total kept


@settings(max_examples=30, deadline=None)
@given(prompt_lens, st.lists(st.integers(1, 10), min_size=1, max_size=4))
def test_streaming_prefill_grows_num_total(L, chunks):
    s = make()
    r = Request("a", list(range(L)), max_tokens=5, streaming_input=True)
    s.add_request(r)
    step(s)
    for i, n in enumerate(chunks):
        computed, total = counters(r)
        s.add_prompt_tokens("a", [7] * n, final=i == len(chunks) - 1)
        assert counters(r) == (computed, total + n)              # streaming: total += L_new
        out = step(s)
        assert out.num_scheduled_tokens == {"a": n}
    assert r.num_output_tokens == 1                              # only the closed prompt produced a token


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 60), st.integers(0, 60), st.integers(1, 20))
def test_prefix_caching_starts_at_the_cached_length(block_size, L_a, shared, tail):
    s = make(num_blocks=256, block_size=block_size)      # room for a's cached blocks and all of b
    prompt_a = list(range(L_a))
    s.add_request(Request("a", prompt_a, max_tokens=1))
    step(s)                                                      # a computed: its full blocks are cached
    shared = min(shared, L_a)
    prompt_b = prompt_a[:shared] + [999] * tail
    b = Request("b", prompt_b, max_tokens=1)
    s.add_request(b)
    out = s.schedule()
    # the longest run of full blocks shared with a, never the whole prompt (one token must be computed)
    L_cached = min(shared // block_size, (len(prompt_b) - 1) // block_size) * block_size
    assert out.scheduled_new_reqs[0].num_computed_tokens == L_cached        # computed <- L_cached
    assert out.num_scheduled_tokens == {"b": len(prompt_b) - L_cached}      # Δ = L_prompt - L_cached
