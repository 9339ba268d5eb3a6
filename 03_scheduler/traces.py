"""Synthetic request traces: Poisson arrivals, ShareGPT-like and Alpaca-like lengths.

The thesis [Kwon 2025, §3.6.1] synthesizes its workloads the same way: input/output lengths from the
ShareGPT and Alpaca datasets, arrival times from a Poisson process at a given request rate.
We do not ship the datasets; the lengths come from stated log-normal distributions whose
means keep the thesis' ratios — ShareGPT prompts are 8.4x and outputs 5.8x longer than
Alpaca's on average — with ShareGPT's heavier spread:

    ShareGPT-like: prompt mean 161 (sigma 1.0), output mean 338 (sigma 0.9)
    Alpaca-like:   prompt mean 19.3 (sigma 0.6), output mean 58.5 (sigma 0.8)

(means before clipping — ShareGPT-like to [4, 2048], Alpaca-like to [4, 1024]; 161/19.3 = 8.3x,
338/58.5 = 5.8x. Clipping, and fitting prompt + output into max_model_len, shorten the long
tail a little; tests/03_scheduler/test_simulator.py checks the sampled means keep the ratios.)
Everything is drawn from one seeded numpy Generator: a trace is a pure function of its
arguments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal lengths with a given mean (before clipping), clipped to [min_len, max_len]."""

    mean: float
    sigma: float
    min_len: int = 1
    max_len: int = 1024

    def __post_init__(self) -> None:
        if self.mean <= 0 or self.sigma < 0 or not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"bad length distribution {self}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma ** 2 / 2      # E[lognormal(mu, s)] = exp(mu + s^2/2)
        lengths = np.rint(rng.lognormal(mu, self.sigma, size=n))
        return np.clip(lengths, self.min_len, self.max_len).astype(np.int64)


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: LengthDistribution
    output: LengthDistribution


SHAREGPT = Workload("ShareGPT-like", LengthDistribution(161, 1.0, 4, 2048), LengthDistribution(338, 0.9, 4, 2048))
ALPACA = Workload("Alpaca-like", LengthDistribution(19.3, 0.6, 4, 1024), LengthDistribution(58.5, 0.8, 4, 1024))


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int = 0


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int, start: float = 0.0) -> np.ndarray:
    """n arrival times of a Poisson process of `rate` requests/s (exponential gaps).
    rate = inf puts every request at `start` (an offline batch)."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return np.full(n, start)
    return start + np.cumsum(rng.exponential(1.0 / rate, size=n))


def make_trace(workload: Workload, rate: float, num_requests: int, seed: int = 0,
               max_model_len: int | None = None) -> list[TraceRequest]:
    """`num_requests` requests of `workload` arriving at `rate` req/s. With max_model_len,
    outputs are shortened so that prompt + output < max_model_len (the engine would cap them)."""
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, rate, num_requests)
    prompts = workload.prompt.sample(rng, num_requests)
    outputs = workload.output.sample(rng, num_requests)
    trace = []
    for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs)):
        p, o = int(p), int(o)
        if max_model_len is not None:
            p = min(p, max_model_len - 2)
            o = max(1, min(o, max_model_len - 1 - p))
        trace.append(TraceRequest(f"req-{i}", float(t), p, o))
    return trace
