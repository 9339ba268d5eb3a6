"""The chapter's scheduling experiments, as functions returning rows of numbers: the
notebook plots them small, `benchmarks/sim_*.py` runs them full size and writes JSON.

  batching_sweep     static vs continuous batching vs Orca reservation (Max / Pow2 / Oracle):
                     normalized latency, throughput, TTFT, ITL versus request rate [Kwon 2025, §3.6.2]
  policy_comparison  FCFS / priority / SRTF / two-level on two traces built to expose
                     head-of-line blocking and starvation [Kwon 2025, §4.5]
  preemption_sweep   recompute vs swap across block sizes under memory pressure [Kwon 2025, §3.7.3]
"""
from __future__ import annotations

import numpy as np

from kvcache import BlockSpaceManager
from scheduler.config import POLICIES, SchedulerConfig
from scheduler.cost_model import OPT_13B_A100, OPT_13B_A100_KV_TOKENS, StepCostModel, llama_3_8b_h100, opt_13b_a100
from scheduler.reservation import ReservationKVCacheManager
from scheduler.scheduler import Scheduler
from scheduler.simulator import SimResult, simulate
from scheduler.static_batching import StaticBatchScheduler
from scheduler.traces import SHAREGPT, TraceRequest, Workload, make_trace

BATCHING_KINDS = ("continuous", "orca-oracle", "orca-pow2", "orca-max", "static")


def make_scheduler(kind: str, *, kv_tokens: int = OPT_13B_A100_KV_TOKENS, block_size: int = 16,
                   max_model_len: int = 2048, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                   policy: str = "fcfs", preemption_mode: str = "recompute", enable_caching: bool = False):
    """One of BATCHING_KINDS over a KV cache of `kv_tokens` slots.

    The default token budget is max_model_len + max_num_seqs: without chunked prefill a
    prompt must fit in what the running decodes leave of the budget (they are scheduled
    first, as in vLLM V1), so a budget of exactly max_model_len would make a near-max-length
    prompt wait until almost every running request has finished — head-of-line blocking that
    chapter 05 removes, and that vLLM's first scheduler [Kwon 2023] avoided with prefill-only steps."""
    num_blocks = kv_tokens // block_size
    if kind == "static":
        return StaticBatchScheduler(max_num_seqs, max_model_len, kv_tokens)
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens or max_model_len + max_num_seqs,
                             max_model_len=max_model_len, policy=policy, preemption_mode=preemption_mode)
    if kind == "continuous":
        # Swap tier as large as the device cache: what is swapped out never exceeds it [Kwon 2025, §3.4.5].
        kv = BlockSpaceManager(num_blocks, block_size, enable_caching=enable_caching,
                            num_cpu_blocks=num_blocks if preemption_mode == "swap" else 0)
    elif kind.startswith("orca-"):
        kv = ReservationKVCacheManager(num_blocks, block_size, kind.removeprefix("orca-"), max_model_len)
    else:
        raise ValueError(f"unknown scheduler kind {kind!r}; choose one of {BATCHING_KINDS}")
    return Scheduler(config, kv)


def summarize(result: SimResult) -> dict[str, float]:
    row = result.summary()
    if result.steps:
        row["mean_batched_requests"] = float(np.mean([s.num_running for s in result.steps]))
        row["mean_kv_usage"] = float(np.mean([s.kv_usage for s in result.steps]))
    return row


def batching_sweep(workload: Workload, rates: list[float], num_requests: int, *, seed: int = 0,
                   cost_model: StepCostModel = OPT_13B_A100, kinds: tuple[str, ...] = BATCHING_KINDS,
                   **scheduler_kwargs) -> list[dict]:
    rows = []
    for rate in rates:
        trace = make_trace(workload, rate, num_requests, seed=seed, max_model_len=scheduler_kwargs.get("max_model_len", 2048))
        for kind in kinds:
            result = simulate(make_scheduler(kind, **scheduler_kwargs), trace, cost_model, record_steps=True)
            rows.append({"workload": workload.name, "rate": rate, "kind": kind, **summarize(result)})
    return rows


# ---------------------------------------------------------------- policies
def hol_blocking_trace(num_long: int = 4, long_len: int = 1900, num_short: int = 32, short_len: int = 40,
                       output_len: int = 32) -> list[TraceRequest]:
    """A burst: a few long prompts queued just ahead of many short ones (all at t=0, in this
    order). Under FCFS each long prompt takes a whole step's budget and every short prompt
    waits behind them (head-of-line blocking)."""
    longs = [TraceRequest(f"long-{i}", 0.0, long_len, output_len) for i in range(num_long)]
    shorts = [TraceRequest(f"short-{i}", 0.0, short_len, output_len) for i in range(num_short)]
    return longs + shorts


def starvation_trace(rate: float = 300.0, num_short: int = 300, short_len: int = 100, long_len: int = 1500,
                     long_arrival: float = 0.2, output_len: int = 8, seed: int = 0) -> list[TraceRequest]:
    """A steady stream of short prompts, faster than they are served, and one long prompt
    arriving in the middle. SRTF always finds a shorter request than the long one."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_short))
    shorts = [TraceRequest(f"short-{i}", float(t), short_len, output_len) for i, t in enumerate(arrivals)]
    return [TraceRequest("long", long_arrival, long_len, output_len)] + shorts


def priority_trace(rate: float = 300.0, num_requests: int = 300, prompt_len: int = 100, output_len: int = 8,
                   seed: int = 0) -> list[TraceRequest]:
    """An overloaded stream where every other request is high priority (0) and the rest low (1)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    return [TraceRequest(f"p{i % 2}-{i}", float(t), prompt_len, output_len, priority=i % 2)
            for i, t in enumerate(arrivals)]


def _ttft_stats(result: SimResult, prefix: str) -> dict[str, float]:
    ttft = [m.ttft for m in result.requests if m.request_id.startswith(prefix)]
    return {"mean": float(np.mean(ttft)), "max": float(np.max(ttft))}


def policy_comparison(policies: tuple[str, ...] = POLICIES, *, cost_model: StepCostModel | None = None,
                      staging_size: int = 8) -> list[dict]:
    """TTFT per policy on the three traces above (Llama-3-8B / H100 cost model, 2048 budget)."""
    cost_model = cost_model or llama_3_8b_h100()
    traces = {"hol_blocking": (hol_blocking_trace(), ("long", "short")),
              "starvation": (starvation_trace(), ("long", "short")),
              "priority": (priority_trace(), ("p0", "p1"))}
    rows = []
    for trace_name, (trace, classes) in traces.items():
        for policy in policies:
            config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048,
                                     policy=policy, staging_size=staging_size)
            result = simulate(Scheduler(config, BlockSpaceManager(2048, 16, enable_caching=False)), trace, cost_model)
            row = {"trace": trace_name, "policy": policy,
                   "ttft_mean_s": float(np.mean([m.ttft for m in result.requests]))}
            for cls in classes:
                stats = _ttft_stats(result, cls)
                row[f"{cls}_ttft_mean_s"], row[f"{cls}_ttft_max_s"] = stats["mean"], stats["max"]
            rows.append(row)
    return rows


# ---------------------------------------------------------------- preemption
def preemption_sweep(block_sizes: tuple[int, ...] = (4, 8, 16, 32, 64), *, rate: float = 4.0, num_requests: int = 300,
                     workload: Workload | None = None, seed: int = 0) -> list[dict]:
    """Recompute vs swap at a load that forces preemptions, OPT-13B / A100, per block size.
    The swap cost per block includes a fixed latency per copy (80 copies per block), which is
    what makes small blocks slow to swap."""
    from scheduler.traces import SHAREGPT
    trace = make_trace(workload or SHAREGPT, rate, num_requests, seed=seed, max_model_len=2048)
    rows = []
    for block_size in block_sizes:
        cost_model = opt_13b_a100(block_size)
        for mode in ("recompute", "swap"):
            scheduler = make_scheduler("continuous", block_size=block_size, preemption_mode=mode)
            result = simulate(scheduler, trace, cost_model, record_steps=True)
            swapped = sum(s.num_swapped_blocks for s in result.steps)
            rows.append({"block_size": block_size, "mode": mode, "swapped_blocks": swapped,
                         "swap_time_s": swapped * cost_model.swap_s_per_block, **summarize(result)})
    return rows


__all__ = ["BATCHING_KINDS", "make_scheduler", "summarize", "batching_sweep", "hol_blocking_trace",
           "starvation_trace", "priority_trace", "policy_comparison", "preemption_sweep"]
