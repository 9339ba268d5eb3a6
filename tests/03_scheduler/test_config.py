"""SchedulerConfig validation: bad knobs fail at construction with a message that says why."""
import pytest

from kvcache import BlockSpaceManager
from scheduler import Scheduler, SchedulerConfig


def test_defaults_are_valid():
    c = SchedulerConfig()
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, c.policy) == (128, 2048, 2048, "fcfs")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "max_num_seqs must be a positive int"),
    (dict(max_num_batched_tokens=1024, max_model_len=2048), r"max_num_batched_tokens \(1024\) < max_model_len"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32, max_model_len=32), "must be >= max_num_seqs"),
    (dict(policy="lifo"), "unknown scheduling policy"),
    (dict(preemption_mode="kill"), "preemption_mode"),
    (dict(num_lookahead_tokens=-1), "num_lookahead_tokens"),
    (dict(enable_chunked_prefill=True), "chunked prefill is chapter 05"),
    (dict(staging_size=0), "staging_size"),
])
def test_invalid_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_swap_preemption_needs_a_cpu_tier():
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, max_num_seqs=4, preemption_mode="swap")
    with pytest.raises(ValueError, match="CPU tier"):
        Scheduler(config, BlockSpaceManager(16, 4))
    Scheduler(config, BlockSpaceManager(16, 4, num_cpu_blocks=8))   # fine with one
