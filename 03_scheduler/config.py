"""Scheduler knobs, validated once in `__post_init__`.

Mirrors `SchedulerConfig` in vLLM's `vllm/config/scheduler.py` (max_num_seqs,
max_num_batched_tokens, policy, enable_chunked_prefill) plus `max_model_len` from
`ModelConfig`, the preemption mode of vLLM V0 (`PreemptionMode`: recompute | swap) and the
number of speculative lookahead slots (`num_lookahead_tokens`, vLLM's speculative config).

This chapter never splits a prompt. `enable_chunked_prefill` exists so the two chapters share
one config shape, but only chapter 05's `ChunkedPrefillConfig` may turn it on; with it off, a
prompt must fit in one step's token budget, so `max_num_batched_tokens >= max_model_len`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

SchedulingPolicy = Literal["fcfs", "priority", "srtf", "two_level"]
PreemptionMode = Literal["recompute", "swap"]
POLICIES: tuple[str, ...] = ("fcfs", "priority", "srtf", "two_level")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    """At most this many requests hold KV blocks on the device at once (len(running))."""

    max_num_batched_tokens: int = 2048
    """The token budget: at most this many tokens go through one forward pass."""

    max_model_len: int = 2048
    """prompt + output never exceeds this many tokens (the stop check caps it)."""

    policy: SchedulingPolicy = "fcfs"
    """Order of the waiting queue: fcfs (vLLM's default), priority (lower value first, ties by
    arrival), srtf (shortest remaining tokens first, [Kwon 2025, Algorithm 2]) or two_level (FIFO into
    a small staging queue, SRTF inside it, [Kwon 2025, §4.5.3])."""

    staging_size: int = 8
    """two_level only: how many requests the FIFO level moves into the staging queue at once."""

    preemption_mode: PreemptionMode = "recompute"
    """recompute (vLLM V1's only mode): drop the victim's KV, num_computed_tokens <- 0.
    swap: copy its blocks to the KV manager's CPU tier and back later (falls back to
    recompute when the CPU tier is full)."""

    num_lookahead_tokens: int = 0
    """Extra KV slots allocated per running request each step for speculative drafts."""

    enable_chunked_prefill: bool = False
    """May a prompt be split across steps? Only chapter 05's config allows True."""

    CHUNKING_SUPPORTED: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "staging_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.num_lookahead_tokens, int) or self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be an int >= 0, got {self.num_lookahead_tokens!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose one of {POLICIES}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.enable_chunked_prefill and not self.CHUNKING_SUPPORTED:
            raise ValueError("this scheduler never splits a prompt; chunked prefill is chapter 05: "
                             "use chunked_prefill.ChunkedPrefillConfig with ChunkedPrefillScheduler")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len ({self.max_model_len}) "
                "without chunked prefill: a long prompt (or a preempted request being recomputed) could never be "
                "scheduled. Raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running request needs at least one token per step")
