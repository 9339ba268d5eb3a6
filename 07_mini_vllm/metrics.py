"""Serving metrics: Prometheus counters/gauges/histograms under vLLM's names, and vLLM's
periodic one-line log.

Mirrors vLLM v1's `vllm/v1/metrics/loggers.py` (`PrometheusStatLogger`, `LoggingStatLogger`)
and `vllm/v1/metrics/stats.py` (`IterationStats`, `SchedulerStats`). Why two kinds of number:
the core knows the scheduler's state (running, waiting, KV usage, prefix-cache lookups,
preemptions) and sends it with every output message (engine_messages.SchedulerStats); only the
front end knows when a token reached the user, so TTFT, inter-token latency and end-to-end
latency are observed here, from the OutputProcessor's per-request timestamps.

Each AsyncLLM has its own CollectorRegistry: two servers in one process (tests) never share or
double-register a metric.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mini_vllm.engine_messages import SchedulerStats

logger = logging.getLogger("mini_vllm.metrics")

# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


@dataclass
class IterationStats:
    """What one output message meant for the users (vLLM: IterationStats)."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)


class PrometheusStatLogger:
    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        """num_engines: data-parallel engine cores feeding this logger; the gauges are their sums
        and the counters their total, and each core's routed requests are counted apart."""
        self.registry = CollectorRegistry()
        labels, values = ["model_name"], [model_name]
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             E2E_BUCKETS)
        # Per engine core: its counters are cumulative (export the increase), its gauges the latest.
        self._last = {i: SchedulerStats() for i in range(num_engines)}
        # Data parallelism (vLLM labels its metrics with the engine index the same way): which core
        # the router sent each request to.
        self.dp_requests_routed = Counter("mini_vllm:dp_requests_routed", "Requests the router sent to each "
                                          "data-parallel engine core.", ["model_name", "engine"], registry=r)
        for i in range(num_engines):
            self.dp_requests_routed.labels(model_name, str(i))

    def record_routed(self, engine: int) -> None:
        self.dp_requests_routed.labels(self.model_name, str(engine)).inc()

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None,
               engine: int = 0) -> None:
        if scheduler_stats is not None:
            s, last = scheduler_stats, self._last.get(engine, SchedulerStats())
            self.prefix_cache_queries.inc(max(0, s.prefix_cache_queries - last.prefix_cache_queries))
            self.prefix_cache_hits.inc(max(0, s.prefix_cache_hits - last.prefix_cache_hits))
            self.num_preemptions.inc(max(0, s.num_preemptions - last.num_preemptions))
            self._last[engine] = s
            latest = self._last.values()
            self.num_requests_running.set(sum(x.num_running_reqs for x in latest))
            self.num_requests_waiting.set(sum(x.num_waiting_reqs for x in latest))
            self.kv_cache_usage.set(sum(x.kv_cache_usage for x in latest) / len(self._last))
        if iteration is not None:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
            self.generation_tokens.inc(iteration.num_generation_tokens)
            for v in iteration.time_to_first_tokens:
                self.ttft.observe(v)
            for v in iteration.inter_token_latencies:
                self.itl.observe(v)
            for v in iteration.e2e_latencies:
                self.e2e.observe(v)
            for reason in iteration.finished_reasons:
                self.request_success.labels(self.model_name, reason).inc()


class LoggingStatLogger:
    """vLLM's periodic line: throughput since the last line, the scheduler's gauges, hit rate."""

    def __init__(self) -> None:
        self.last_log_time = time.monotonic()
        self.prompt_tokens = self.generation_tokens = 0
        self.queries = self.hits = 0
        self.scheduler_stats = SchedulerStats()
        self._last_cumulative = SchedulerStats()
        self._logged_idle = False

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.scheduler_stats = scheduler_stats
        if iteration is not None:
            self.prompt_tokens += iteration.num_prompt_tokens
            self.generation_tokens += iteration.num_generation_tokens

    def log(self) -> str | None:
        """The line (also logged), or None when nothing happened since an idle line (no spam while idle)."""
        now = time.monotonic()
        s = self.scheduler_stats
        idle = not (self.prompt_tokens or self.generation_tokens or s.num_running_reqs or s.num_waiting_reqs)
        if idle and self._logged_idle:
            self.last_log_time = now
            return None
        self._logged_idle = idle
        elapsed = max(now - self.last_log_time, 1e-9)
        s, last = self.scheduler_stats, self._last_cumulative
        queries, hits = s.prefix_cache_queries - last.prefix_cache_queries, s.prefix_cache_hits - last.prefix_cache_hits
        line = (f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
                f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
        logger.info("%s", line)
        self.last_log_time, self.prompt_tokens, self.generation_tokens = now, 0, 0
        self._last_cumulative = s
        return line
