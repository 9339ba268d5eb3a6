"""CPU time of one scheduling step with R running requests, R = 1 .. 1024: ours vs the
scheduler of HF transformers' continuous batching (FIFOScheduler), side by side in one run.

Why it matters [Kwon 2025, §4.6]: a decode step takes ~10 ms on a modern GPU, so 1 ms of
scheduler CPU time per step is already a 10% loss; the step must stay O(running).

Workload: R requests with 20-token prompts, all decoding (prefill done before timing),
16-token KV blocks, no prefix caching on either side (ours is also timed with it on).
One "step" = what the engine does around the forward pass:
  ours          Scheduler.schedule() + Scheduler.update_from_output() (the MockModelRunner
                that stands in for the model between them is not timed)
  transformers  FIFOScheduler.schedule_batch() + RequestState.update_and_check_completion()
                + PagedAttentionCache.mark_complete_blocks()   (its ContinuousBatchProcessor.update_batch)
Times are the thread's CPU time (time.thread_time), not wall time: these CPUs are shared,
and a step descheduled by the OS would otherwise count other processes' work.
The `schedule_only` column is our schedule() alone. The contenders' steps are interleaved
(ours, theirs, ours, ...) so both see the same load on this shared CPU; medians of 40 steps
after warm-up, `speedup_vs_transformers` = median of the per-step ratios.

    .venv/bin/python -m benchmarks.bench_scheduler            # -> benchmarks/results/scheduler_cpu.{json,png}
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from benchmarks.common import RESULTS_DIR, environment, write_result
from kvcache import KVCacheManager
from scheduler import MockModelRunner, Request, Scheduler, SchedulerConfig

PROMPT_LEN = 20
BLOCK_SIZE = 16


def interleaved_times(steps: dict[str, Callable[[], float]], iters: int = 40, warmup: int = 5) -> dict[str, list[float]]:
    """Run the contenders alternately, step by step, so both see the same machine load (these
    CPUs are shared): a noisy moment slows both, not one. Each step returns its own CPU time."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            samples[name].append(step())
    return samples


def ours(num_running: int, enable_caching: bool) -> tuple[Callable[[], float], list[float]]:
    """A step function over num_running decoding requests (returns the CPU time of schedule()
    + update_from_output(), not of the mock runner), and the list its schedule() times go to."""
    kv = KVCacheManager(num_running * 16, BLOCK_SIZE, enable_caching=enable_caching)
    config = SchedulerConfig(max_num_seqs=max(num_running, 1), max_num_batched_tokens=max(8192, num_running),
                             max_model_len=8192)
    s = Scheduler(config, kv)
    runner = MockModelRunner()
    for i in range(num_running):
        s.add_request(Request(f"r{i}", list(range(i, i + PROMPT_LEN)), max_tokens=100_000, ignore_eos=True))
    schedule_times: list[float] = []

    def step() -> float:
        t0 = time.thread_time()
        out = s.schedule()
        t1 = time.thread_time()
        model_output = runner.execute(s.requests, out)        # the model's job: not timed
        t2 = time.thread_time()
        s.update_from_output(out, model_output)
        t3 = time.thread_time()
        schedule_times.append(t1 - t0)
        return (t1 - t0) + (t3 - t2)

    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.requests.values()):
        step()                                      # finish every prefill before timing
    schedule_times.clear()
    return step, schedule_times


def transformers_fifo(num_running: int) -> Callable[[], float] | None:
    """A step function of transformers' FIFOScheduler, or None if this transformers lacks it."""
    try:
        import torch
        from transformers import LlamaConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        from transformers.generation.continuous_batching.distributed import DistributedHelper
        from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
        from transformers.generation.continuous_batching.scheduler import FIFOScheduler
    except ImportError:
        return None
    model_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192)
    # Enough blocks for the timed steps; a small batch-token cap keeps its attention-mask reservation small.
    cb_config = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=num_running * 6,
                                         max_batch_tokens=max(2048, num_running), max_requests_per_batch=num_running,
                                         allow_block_sharing=False, max_memory_percent=0.5)
    cache = PagedAttentionCache(model_config, cb_config, "cpu", DistributedHelper(None, None, {}), dtype=torch.float32)
    scheduler = FIFOScheduler(cache, safety_margin=0.0, max_requests_per_batch=num_running)
    for i in range(num_running):
        scheduler.add_waiting_request(RequestState(request_id=f"r{i}", initial_tokens=list(range(i, i + PROMPT_LEN)),
                                                   max_new_tokens=100_000))

    def step() -> float:
        t0 = time.thread_time()
        requests, *_ = scheduler.schedule_batch(cache.max_batch_tokens, cache.max_tokens_read)
        for future in requests:                      # ContinuousBatchProcessor.update_batch, minus the tensors
            if future.has_new_token:
                state = future.state
                if state.generated_len() == 0:
                    state.status = RequestStatus.DECODING
                state.update_and_check_completion(7, None)
                cache.mark_complete_blocks(state, future.complete_blocks)
        elapsed = time.thread_time() - t0
        step.last = len(requests)
        return elapsed

    while any(s.status != RequestStatus.DECODING for s in scheduler.active_requests.values()) or scheduler.waiting_requests:
        step()
    step()
    assert step.last == num_running, f"transformers scheduled {step.last} of {num_running} requests"
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    args = parser.parse_args()
    rows = []
    for r in args.sizes:
        ours_step, schedule_times = ours(r, enable_caching=False)
        cached_step, _ = ours(r, enable_caching=True)
        contenders = {"ours": ours_step, "ours_prefix_caching": cached_step}
        peer = transformers_fifo(r)
        if peer is not None:
            contenders["transformers"] = peer
        t = interleaved_times(contenders)
        med = {name: statistics.median(v) for name, v in t.items()}
        row = {"num_running": r, "ours_step_ms": med["ours"] * 1e3, "ours_step_min_ms": min(t["ours"]) * 1e3,
               "ours_schedule_only_ms": statistics.median(schedule_times) * 1e3,
               "ours_step_prefix_caching_ms": med["ours_prefix_caching"] * 1e3,
               "ours_us_per_request": med["ours"] * 1e6 / r}
        if peer is not None:
            ratios = [p / o for p, o in zip(t["transformers"], t["ours"])]
            row.update({"transformers_fifo_step_ms": med["transformers"] * 1e3,
                        "transformers_fifo_step_min_ms": min(t["transformers"]) * 1e3,
                        "speedup_vs_transformers": statistics.median(ratios)})
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    workload = {"what": "CPU time of one decode step of the scheduler (+ KV bookkeeping) with R running requests",
                "prompt_len": PROMPT_LEN, "block_size": BLOCK_SIZE, "model": "none (scheduler only)",
                "peer": "transformers.generation.continuous_batching.FIFOScheduler",
                "command": "python -m benchmarks.bench_scheduler"}
    path = write_result("scheduler_cpu", workload, rows)
    plot(rows, RESULTS_DIR / "scheduler_cpu.png")
    print(f"wrote {path}")


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = [r["num_running"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(xs, [r["ours_step_ms"] for r in rows], "o-", label="ours: schedule + update")
    ax.loglog(xs, [r["ours_schedule_only_ms"] for r in rows], "s--", label="ours: schedule() only")
    if "transformers_fifo_step_ms" in rows[0]:
        ax.loglog(xs, [r["transformers_fifo_step_ms"] for r in rows], "^-", label="transformers FIFOScheduler")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.text(xs[0], 1.1, "1 ms = 10% of a 10 ms step", fontsize=8, color="gray")
    ax.set_xlabel("running requests")
    ax.set_ylabel("CPU ms per step")
    ax.set_title(f"Scheduler CPU time per decode step ({environment()['device']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
