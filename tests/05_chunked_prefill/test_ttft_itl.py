"""[vLLM 2.0 part 2, §10.4.2] in the simulator: chunking bounds the decoders' stall, and does NOT make
the long prompt's own first token come sooner."""
import math

import pytest

from chunked_prefill.experiments import TTFTITLSetup, make_ttft_itl_trace, measure_ttft_itl, sweep_ttft_itl
from scheduler.cost_model import LLAMA_3_8B_H100 as COST
from scheduler.simulator import RequestMetrics


@pytest.fixture(scope="module")
def rows():
    return sweep_ttft_itl([256, 512, 1024, 2048])


def test_without_chunking_every_decoder_waits_for_the_whole_prefill(rows):
    off = rows[0]
    assert not off["chunked"] and off["num_prefill_steps"] == 1
    # the stall is one step carrying the 4096-token prompt and the 8 decodes
    setup = TTFTITLSetup()
    prefill_step = COST.step_time(setup.prompt_len + setup.num_decoders, setup.prompt_len)
    assert off["decoder_max_itl_s"] == pytest.approx(prefill_step, rel=0.02)
    assert off["decoder_max_itl_s"] > 10 * off["decoder_mean_itl_s"]


def test_chunking_bounds_the_stall_and_costs_the_long_prompt_a_little(rows):
    off, chunked = rows[0], rows[1:]
    stalls = [r["decoder_max_itl_s"] for r in chunked]
    assert stalls == sorted(stalls)                                       # smaller chunks, smaller stall
    for r in chunked:
        chunk = r["chunk_size"] - 8                                       # the 8 decodes take their tokens first
        assert r["num_prefill_steps"] == math.ceil(4096 / chunk)
        assert r["decoder_max_itl_s"] == pytest.approx(COST.step_time(r["chunk_size"], 0), rel=0.1)
        assert off["long_ttft_s"] < r["long_ttft_s"]                      # every chunk pays the per-step cost again
    assert chunked[0]["decoder_max_itl_s"] < 0.15 * off["decoder_max_itl_s"]
    assert chunked[0]["long_ttft_s"] < 2 * off["long_ttft_s"]


def test_measure_ttft_itl_reads_only_timestamps():
    reqs = [RequestMetrics("long", 1.0, 10, 2, token_times=[3.0, 3.5]),
            RequestMetrics("d", 0.0, 2, 5, token_times=[0.5, 0.9, 2.9, 3.1, 3.2])]
    m = measure_ttft_itl(reqs)
    assert m["long_ttft_s"] == 2.0 and m["decoder_max_itl_s"] == pytest.approx(2.0)
    assert m["decoder_mean_itl_in_window_s"] == pytest.approx((2.0 + 0.2) / 2)


def test_trace_shape():
    trace = make_ttft_itl_trace(TTFTITLSetup(num_decoders=3))
    assert [t.request_id for t in trace] == ["decoder-0", "decoder-1", "decoder-2", "long"]
    assert trace[-1].prompt_len == 4096 and trace[-1].arrival_time > 0
