"""Drive a scheduler with a request trace and a step-cost model: serving experiments on a
laptop CPU, no model, no GPU.

The loop is the engine's loop (chapter 07) with the model runner replaced by arithmetic:

    admit arrivals up to `clock` -> schedule() -> clock += cost(step)
    -> every request whose num_computed_tokens reached num_tokens "samples" one token
    -> update_from_output()

The scheduler and the KV cache manager are the REAL ones, so every scheduling decision —
admission, preemption, prefix hits, policies, chunking — is exactly what the engine would
do; only the duration of each step is modelled (`cost_model.StepCostModel`). Each request
stops after its trace output length (ignore_eos, max_tokens = output_len).

Reported, per request: TTFT (first token - arrival), inter-token latencies, end-to-end
latency and normalized latency (latency / output tokens, the metric of [Kwon 2025, §3.6.1]).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from scheduler.cost_model import StepCostModel
from scheduler.mock_runner import MockModelRunner
from scheduler.output import SchedulerOutput
from scheduler.request import Request
from scheduler.traces import TraceRequest

SAMPLED_TOKEN_ID = 1     # what the "model" always samples (never EOS: the sim uses max_tokens)
VOCAB_SIZE = 32_000


@dataclass
class RequestMetrics:
    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    first_scheduled_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def normalized_latency(self) -> float:
        return self.latency / max(1, len(self.token_times))


@dataclass
class StepRecord:
    start: float
    end: float
    num_scheduled_tokens: dict[str, int]
    num_running: int
    num_waiting: int
    kv_usage: float
    preempted: frozenset[str]
    num_swapped_blocks: int


@dataclass
class SimResult:
    requests: list[RequestMetrics]
    steps: list[StepRecord]
    num_steps: int
    duration: float

    def finished(self) -> list[RequestMetrics]:
        return [r for r in self.requests if r.finish_time is not None]

    def summary(self) -> dict[str, float]:
        done = [r for r in self.finished() if r.token_times]
        if not done:
            return {"num_finished": 0}
        ttft = np.array([r.ttft for r in done])
        itl = np.array([x for r in done for x in r.itls] or [0.0])
        num_out = sum(len(r.token_times) for r in done)
        return {
            "num_finished": len(done),
            "duration_s": self.duration,
            "throughput_req_s": len(done) / self.duration,
            "throughput_tok_s": num_out / self.duration,
            "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.median(ttft)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "ttft_max_s": float(ttft.max()),
            "itl_mean_s": float(itl.mean()), "itl_p99_s": float(np.percentile(itl, 99)), "itl_max_s": float(itl.max()),
            "latency_mean_s": float(np.mean([r.latency for r in done])),
            "normalized_latency_s_per_tok": float(np.mean([r.normalized_latency for r in done])),
            "num_preemptions": int(sum(r.num_preemptions for r in done)),
        }


def make_request(t: TraceRequest, rng: np.random.Generator) -> Request:
    """A Request with random prompt tokens (no accidental prefix sharing between requests)."""
    prompt = rng.integers(2, VOCAB_SIZE, size=t.prompt_len).tolist()
    return Request(t.request_id, prompt, max_tokens=t.output_len, arrival_time=t.arrival_time,
                   priority=t.priority, ignore_eos=True)


def step_work(scheduler, output: SchedulerOutput) -> tuple[int, int]:
    """(tokens through the model, context tokens attended to) for the cost model. A scheduler
    that pads its batch (static batching) says so with `padded_work`."""
    padded = getattr(scheduler, "padded_work", None)
    if padded is not None:
        return padded(output)
    # num_computed_tokens was already advanced by schedule(): it IS this step's seq_len.
    context = sum(scheduler.requests[rid].num_computed_tokens for rid in output.num_scheduled_tokens)
    return output.total_num_scheduled_tokens, context


def simulate(scheduler, trace: Iterable[TraceRequest], cost_model: StepCostModel, *, seed: int = 0,
             record_steps: bool = False, make_request_fn: Callable[[TraceRequest, np.random.Generator], Request] = make_request,
             max_steps: int = 10_000_000) -> SimResult:
    """Serve `trace` with `scheduler` (anything with the Scheduler interface) and return
    per-request timelines; `record_steps` also keeps one StepRecord per step (Gantt charts,
    queue states). `make_request_fn` builds each Request (e.g. to give prompts a shared
    prefix); the default draws distinct random prompts from `seed`. Raises RuntimeError if
    the scheduler stalls with nothing left to wait for (a deadlock)."""
    rng = np.random.default_rng(seed)
    runner = MockModelRunner(next_token=lambda request: SAMPLED_TOKEN_ID)
    pending = deque(sorted(trace, key=lambda t: t.arrival_time))
    metrics = {t.request_id: RequestMetrics(t.request_id, t.arrival_time, t.prompt_len, t.output_len) for t in pending}
    steps: list[StepRecord] = []
    clock = 0.0
    num_steps = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_time <= clock:
            scheduler.add_request(make_request_fn(pending.popleft(), rng))
        if not scheduler.has_unfinished_requests():
            clock = pending[0].arrival_time     # idle until the next arrival
            continue
        output = scheduler.schedule()
        if output.is_empty and not output.preempted_req_ids:
            if not pending:
                raise RuntimeError(f"scheduler stalled at t={clock:.3f}s with {scheduler.get_request_counts()} "
                                   "(running, waiting) requests and no arrival to wait for: a deadlock")
            clock = max(clock, pending[0].arrival_time)
            continue

        ### BEGIN SOLUTION
        num_tokens, context = step_work(scheduler, output)
        num_swapped = len(output.blocks_to_swap_out) + len(output.blocks_to_swap_in)
        start, clock = clock, clock + cost_model.step_time(num_tokens, context, num_swapped)
        model_output = runner.execute(scheduler.requests, output)
        for rid in model_output.req_ids:
            request, m = scheduler.requests[rid], metrics[rid]
            if m.first_scheduled_time is None:
                m.first_scheduled_time = start
            m.num_preemptions = request.num_preemptions
            m.num_cached_tokens = max(request.num_cached_tokens, 0)
        outputs = scheduler.update_from_output(output, model_output)
        for out in outputs:
            m = metrics[out.request_id]
            m.token_times.extend([clock] * len(out.new_token_ids))
            if out.finished:
                m.finish_time, m.finish_reason = clock, str(out.finish_reason)
        ### END SOLUTION
        if record_steps:
            num_running, num_waiting = scheduler.get_request_counts()
            usage = scheduler.kv_cache_manager.usage if getattr(scheduler, "kv_cache_manager", None) else 0.0
            steps.append(StepRecord(start, clock, dict(output.num_scheduled_tokens), num_running, num_waiting,
                                    usage, frozenset(output.preempted_req_ids), num_swapped))
        num_steps += 1
        if num_steps >= max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
    return SimResult(list(metrics.values()), steps, num_steps, clock)
