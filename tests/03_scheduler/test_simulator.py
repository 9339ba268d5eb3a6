"""The simulator's parts: cost model arithmetic, traces, one request's exact timeline, and the
static / continuous / reservation comparisons the chapter's claims rest on."""
import math

import numpy as np
import pytest

from kvcache import KVCacheManager
from scheduler import Scheduler, SchedulerConfig
from scheduler.cost_model import LLAMA_3_8B_H100, OPT_13B_A100, StepCostModel
from scheduler.reservation import ReservationKVCacheManager
from scheduler.simulator import simulate
from scheduler.static_batching import StaticBatchScheduler
from scheduler.traces import ALPACA, SHAREGPT, LengthDistribution, TraceRequest, make_trace, poisson_arrivals

UNIT = StepCostModel(a=1.0, b=0.1, c=0.01, swap_s_per_block=0.5)


def test_cost_model_arithmetic():
    assert UNIT.step_time(0, 0) == 0.0
    assert UNIT.step_time(10, 100) == pytest.approx(1.0 + 1.0 + 1.0)
    assert UNIT.step_time(0, 0, num_swapped_blocks=3) == pytest.approx(1.5)      # a swap-only step
    assert UNIT.step_time(1, 10, num_swapped_blocks=2) == pytest.approx(1.0 + 0.1 + 0.1 + 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        StepCostModel(a=-1, b=0, c=0)
    with pytest.raises(ValueError, match="mfu"):
        StepCostModel.from_hardware(num_params=1, kv_bytes_per_token=1, bytes_per_param=1, mem_bandwidth=1,
                                    peak_flops=1, mfu=0, pcie_bandwidth=1, block_size=1)


def test_hardware_presets_follow_from_their_stated_numbers():
    assert OPT_13B_A100.a == pytest.approx(26e9 / 1555e9)                       # weights / HBM bandwidth
    assert OPT_13B_A100.b == pytest.approx(2 * 13e9 / (312e12 * 0.5))           # FLOPs / (peak * MFU)
    assert OPT_13B_A100.c == pytest.approx(800 * 1024 / 1555e9, rel=0.03)       # 800 KB of K/V per token
    assert OPT_13B_A100.swap_s_per_block == pytest.approx(16 * 819200 / 25e9 + 80 * 5e-6)
    assert LLAMA_3_8B_H100.c * 3.35e12 == pytest.approx(128 * 1024)


def test_traces_are_deterministic_and_have_the_stated_shape():
    a = make_trace(SHAREGPT, 2.0, 500, seed=7, max_model_len=2048)
    assert a == make_trace(SHAREGPT, 2.0, 500, seed=7, max_model_len=2048)
    assert a != make_trace(SHAREGPT, 2.0, 500, seed=8, max_model_len=2048)
    assert all(t.prompt_len + t.output_len < 2048 and t.output_len >= 1 for t in a)
    assert [t.arrival_time for t in a] == sorted(t.arrival_time for t in a)
    n = 40_000
    s, al = make_trace(SHAREGPT, 1.0, n, seed=1, max_model_len=2048), make_trace(ALPACA, 1.0, n, seed=1)
    prompt_ratio = np.mean([t.prompt_len for t in s]) / np.mean([t.prompt_len for t in al])
    output_ratio = np.mean([t.output_len for t in s]) / np.mean([t.output_len for t in al])
    assert 7.8 < prompt_ratio < 8.8 and 5.2 < output_ratio < 6.0       # [Kwon 2025, §3.6.1]: 8.4x and 5.8x
    assert np.mean([t.prompt_len for t in al]) == pytest.approx(19.3, rel=0.03)


def test_poisson_arrivals_have_the_requested_rate():
    rng = np.random.default_rng(0)
    t = poisson_arrivals(rng, 4.0, 40_000)
    gaps = np.diff(t)
    assert len(t) / t[-1] == pytest.approx(4.0, rel=0.03)
    assert np.std(gaps) == pytest.approx(np.mean(gaps), rel=0.05)        # exponential: std == mean
    assert (poisson_arrivals(rng, math.inf, 3) == 0).all()
    with pytest.raises(ValueError):
        poisson_arrivals(rng, 0, 3)
    with pytest.raises(ValueError):
        LengthDistribution(10, 1.0, min_len=5, max_len=4)


def make_paged(num_blocks=64, block_size=4, max_model_len=64, **config):
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_model_len,
                                     max_model_len=max_model_len, **config),
                     KVCacheManager(num_blocks, block_size, enable_caching=False))


def test_one_request_exact_timeline():
    """prefill of 10 tokens: 1 + 10*0.1 + 10*0.01 = 2.1 s; then decodes with context 11, 12."""
    result = simulate(make_paged(), [TraceRequest("a", 5.0, 10, 3)], UNIT)
    (m,) = result.requests
    assert m.token_times == pytest.approx([7.1, 7.1 + 1.21, 7.1 + 1.21 + 1.22])
    assert m.ttft == pytest.approx(2.1) and m.itls == pytest.approx([1.21, 1.22])
    assert m.latency == pytest.approx(4.53) and m.normalized_latency == pytest.approx(4.53 / 3)
    assert m.finish_reason == "length" and result.num_steps == 3 and result.duration == pytest.approx(9.53)


def test_two_requests_share_steps():
    result = simulate(make_paged(), [TraceRequest("a", 0.0, 10, 2), TraceRequest("b", 0.0, 5, 1)], UNIT,
                      record_steps=True)
    assert [s.num_scheduled_tokens for s in result.steps] == [{"a": 10, "b": 5}, {"a": 1}]
    first = 1 + 15 * 0.1 + 15 * 0.01
    assert result.steps[0].end == pytest.approx(first)
    assert result.summary()["ttft_mean_s"] == pytest.approx(first)


def test_static_batching_waits_for_the_whole_batch_and_pays_for_padding():
    s = StaticBatchScheduler(max_batch_size=8, max_model_len=16, kv_capacity_tokens=48)
    assert s.batch_size == 3                                    # 48 slots / 16 reserved per request
    trace = [TraceRequest(f"r{i}", 0.0, p, o) for i, (p, o) in enumerate([(2, 1), (4, 3), (6, 2), (3, 1)])]
    result = simulate(s, trace, UNIT, record_steps=True)
    steps = result.steps
    assert [set(st.num_scheduled_tokens) for st in steps] == [{"r0", "r1", "r2"}, {"r1", "r2"}, {"r1"}, {"r3"}]
    # prefill padded to 6 tokens x 3 rows; decodes keep all 3 rows (finished ones are padding)
    assert steps[0].end == pytest.approx(1 + 18 * 0.1 + 18 * 0.01)
    assert steps[1].end - steps[1].start == pytest.approx(1 + 3 * 0.1 + 3 * 7 * 0.01)
    assert steps[2].end - steps[2].start == pytest.approx(1 + 3 * 0.1 + 3 * 8 * 0.01)
    by_id = {m.request_id: m for m in result.requests}
    assert by_id["r3"].token_times[0] == pytest.approx(steps[3].end)    # r3 waited for the whole batch
    continuous = simulate(make_paged(max_model_len=16), trace, UNIT)
    assert continuous.summary()["latency_mean_s"] < result.summary()["latency_mean_s"]


def test_paged_beats_every_reservation_scheme_under_load():
    """[Kwon 2025, §3.6.2] in miniature: at the same request rate, paged allocation batches more
    requests than Orca (Oracle) > (Pow2) > (Max), and static batching is last."""
    trace = make_trace(SHAREGPT, 2.5, 80, seed=3, max_model_len=2048)
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048)
    norm, batched = {}, {}
    for name in ("paged", "oracle", "pow2", "max", "static"):
        if name == "paged":
            s = Scheduler(config, KVCacheManager(400, 16, enable_caching=False))
        elif name == "static":
            s = StaticBatchScheduler(64, 2048, 400 * 16)
        else:
            s = Scheduler(config, ReservationKVCacheManager(400, 16, name, 2048))
        result = simulate(s, trace, OPT_13B_A100, record_steps=True)
        assert len(result.finished()) == 80
        norm[name] = result.summary()["normalized_latency_s_per_tok"]
        batched[name] = np.mean([st.num_running for st in result.steps])
    assert norm["paged"] < norm["oracle"] < norm["pow2"] < norm["max"] < norm["static"]
    assert batched["paged"] > 1.5 * batched["oracle"] and batched["oracle"] > batched["pow2"] > batched["max"]


def test_simulate_reports_a_deadlock_instead_of_spinning():
    class Stuck:
        requests, kv_cache_manager = {}, None

        def add_request(self, r):
            self.requests[r.request_id] = r

        def has_unfinished_requests(self):
            return True

        def get_request_counts(self):
            return 0, len(self.requests)

        def schedule(self):
            from scheduler import CachedRequestData, SchedulerOutput
            return SchedulerOutput([], CachedRequestData(), {}, 0)

    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(Stuck(), [TraceRequest("a", 0.0, 4, 1)], UNIT)
