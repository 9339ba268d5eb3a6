"""The TTFT / ITL experiment of [vLLM 2.0 part 2, §10.4.2], in the simulator.

Set-up: `num_decoders` requests with short prompts are decoding; then ONE long prompt
arrives. Measured:
  * the decoders' worst inter-token latency while the long prompt is being prefilled
    (the "dam": without chunking, every decoder waits for the entire prefill step);
  * the long prompt's TTFT.
Swept over the chunk size (= `max_num_batched_tokens` with chunking on; "off" = chunk
prefill disabled, budget = max_model_len).

What to expect, and what that source gets wrong: chunking bounds the decoders' stall to ~one
chunk's step time, roughly chunk/prompt of the unchunked stall. The LONG prompt's own TTFT
does not shrink — it grows a little, because every chunk pays the fixed per-step cost
(reading the weights) again and shares its step with the decodes. Its
"TTFT ≈ chunk/prompt × original TTFT" is the decoders' stall, not the long prompt's TTFT.

`measure_ttft_itl` only reads per-request token timestamps (`RequestMetrics`), so the same
measurement applies to a run of the real engine (chapter 07) that records them.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcache import KVCacheManager
from scheduler import Scheduler, SchedulerConfig
from scheduler.cost_model import LLAMA_3_8B_H100, StepCostModel
from scheduler.simulator import RequestMetrics, simulate
from scheduler.traces import TraceRequest

from chunked_prefill.config import ChunkedPrefillConfig
from chunked_prefill.scheduler import ChunkedPrefillScheduler


@dataclass(frozen=True)
class TTFTITLSetup:
    prompt_len: int = 4096          # the long prompt (source: 4096 tokens)
    num_decoders: int = 8           # concurrent decodes (source: 8)
    decoder_prompt_len: int = 32
    decoder_output_len: int = 256
    long_arrival_s: float = 0.05    # the decoders are mid-generation when it arrives
    long_output_len: int = 8
    max_model_len: int = 8192
    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 64


def make_ttft_itl_trace(setup: TTFTITLSetup) -> list[TraceRequest]:
    trace = [TraceRequest(f"decoder-{i}", 0.0, setup.decoder_prompt_len, setup.decoder_output_len)
             for i in range(setup.num_decoders)]
    trace.append(TraceRequest("long", setup.long_arrival_s, setup.prompt_len, setup.long_output_len))
    return trace


def measure_ttft_itl(requests: list[RequestMetrics], long_id: str = "long") -> dict[str, float]:
    """Long prompt TTFT, and the decoders' inter-token gaps that overlap its prefill window
    [arrival, first token]: their max is the stall the long prompt inflicted."""
    by_id = {r.request_id: r for r in requests}
    long = by_id[long_id]
    window_start, window_end = long.arrival_time, long.token_times[0]
    gaps, all_gaps = [], []
    for r in requests:
        if r.request_id == long_id:
            continue
        for a, b in zip(r.token_times, r.token_times[1:]):
            all_gaps.append(b - a)
            if b > window_start and a < window_end:
                gaps.append(b - a)
    return {
        "long_ttft_s": long.ttft,
        "decoder_max_itl_s": max(gaps, default=0.0),
        "decoder_mean_itl_in_window_s": sum(gaps) / len(gaps) if gaps else 0.0,
        "decoder_mean_itl_s": sum(all_gaps) / len(all_gaps) if all_gaps else 0.0,
    }


def run_ttft_itl(chunk_size: int | None, setup: TTFTITLSetup = TTFTITLSetup(),
                 cost_model: StepCostModel = LLAMA_3_8B_H100) -> dict[str, float]:
    """One point of the sweep. chunk_size=None: chunked prefill off (chapter 03's scheduler)."""
    kv = KVCacheManager(setup.num_blocks, setup.block_size, enable_caching=False)
    if chunk_size is None:
        config = SchedulerConfig(max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_model_len,
                                 max_model_len=setup.max_model_len)
        scheduler = Scheduler(config, kv)
    else:
        config = ChunkedPrefillConfig(max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=chunk_size,
                                      max_model_len=setup.max_model_len)
        scheduler = ChunkedPrefillScheduler(config, kv)
    result = simulate(scheduler, make_ttft_itl_trace(setup), cost_model, record_steps=True)
    long_steps = [s for s in result.steps if "long" in s.num_scheduled_tokens]
    row = {"chunk_size": chunk_size or 0, "chunked": chunk_size is not None,
           "num_prefill_steps": len(long_steps) - (setup.long_output_len - 1)}
    row.update(measure_ttft_itl(result.requests))
    return row


def sweep_ttft_itl(chunk_sizes: list[int], setup: TTFTITLSetup = TTFTITLSetup(),
                   cost_model: StepCostModel = LLAMA_3_8B_H100) -> list[dict[str, float]]:
    """No chunking first, then each chunk size."""
    return [run_ttft_itl(None, setup, cost_model)] + [run_ttft_itl(c, setup, cost_model) for c in chunk_sizes]
