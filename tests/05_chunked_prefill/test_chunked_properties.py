"""Chunked prefill under random load: random arrivals, aborts, chunk sizes, partial prefill
limits, every policy, both preemption modes, prefix caching on and off and a small KV cache.
After every step: the budget, max_num_seqs, no request both waiting and running, the counters
and the KV manager's invariants; before every forward pass (through `ShadowKVRunner`): every
position a scheduled request attends to holds the K/V of exactly its own prefix. At the end:
all finished, nothing leaked (tests/scheduler_workloads.py). With drafts and a KV connector on
top (the engine's composed scheduler): tests/integration/test_scheduler_properties.py."""
from hypothesis import given, settings
from hypothesis import strategies as st

from chunked_prefill import ChunkedPrefillScheduler
from scheduler_workloads import draw_chunked_workload, run_chunked_workload


def chunked(config, kv, connector):
    assert connector is None
    return ChunkedPrefillScheduler(config, kv)


# derandomize: the same 50 workloads on every run, so CI is reproducible; what a random run
# finds becomes a test of its own.
@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.data())
def test_random_chunked_workloads(data):
    workload = draw_chunked_workload(lambda lo, hi: data.draw(st.integers(lo, hi)),
                                     lambda values: data.draw(st.sampled_from(values)),
                                     lambda: data.draw(st.booleans()))
    run_chunked_workload(chunked, *workload[:-2], False, workload[-1])       # no connector in this chapter


def test_swap_ins_respect_max_num_partial_prefills():
    """Issue 9, item 7, a workload found by the random search on the old code: swap-ins bypassed
    `_defer_admission`, and 4 prompts were partway through their prefill with
    max_num_partial_prefills=3. (SRTF, swap preemption, a 10-block pool.)"""
    run_chunked_workload(chunked, 5, 14, "srtf", "swap", 3, 1, 30, 0, 10, 4, False, 3384934383, False, 27)
