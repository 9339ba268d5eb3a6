"""Property tests of chapter 03's core scheduler: random arrivals, aborts, streaming input and a
tiny KV cache that forces preemptions, under every policy and both preemption modes, every step
checked against the invariants and a shadow of every KV slot (tests/scheduler_workloads.py says
what is checked). Drafts and a KV connector on top of this: tests/integration/test_scheduler_properties.py."""
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Scheduler
from scheduler_workloads import random_workload


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_workloads_keep_every_invariant_and_leak_nothing(data):
    random_workload(data, lambda config, kv, connector: Scheduler(config, kv), with_connector=False)
