"""Chunked-prefill knobs: chapter 03's `SchedulerConfig` plus the three that split prompts.

Mirrors vLLM's `vllm/config/scheduler.py` [vLLM 2.0 part 2, §10.3]: `enable_chunked_prefill`,
`max_num_partial_prefills`, `max_long_partial_prefills`, `long_prefill_token_threshold`,
validated as vLLM's `SchedulerConfig.__post_init__` / `verify_max_model_len` do.

With chunking on, `max_num_batched_tokens` IS the chunk size knob: a prompt longer than
what is left of the step's budget is cut there, and the rest waits for the next step. That
is why the chapter 03 rule `max_num_batched_tokens >= max_model_len` no longer applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from scheduler import SchedulerConfig


@dataclass
class ChunkedPrefillConfig(SchedulerConfig):
    enable_chunked_prefill: bool = True

    max_num_partial_prefills: int = 1
    """At most this many requests may be partway through their prefill at once (a prefill is
    "partial" while it spans steps). A waiting prompt that would start a new partial prefill
    beyond this is deferred; one that fits entirely in this step never counts."""

    max_long_partial_prefills: int = 1
    """Of those, at most this many may be LONG (more than long_prefill_token_threshold tokens
    left). Setting it below max_num_partial_prefills lets shorter prompts jump the queue in
    front of long ones instead of waiting behind them."""

    long_prefill_token_threshold: int = 0
    """A prefill with more tokens left than this is "long", and advances at most this many
    tokens per step (vLLM V1) so it never takes the whole budget. 0 = no cap; with
    max_num_partial_prefills > 1 it defaults to 4% of max_model_len, as in vLLM."""

    CHUNKING_SUPPORTED: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0, got {self.long_prefill_token_threshold!r}")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.max_num_partial_prefills > 1:
            if not self.enable_chunked_prefill:
                raise ValueError("max_num_partial_prefills > 1 needs enable_chunked_prefill=True")
            if self.long_prefill_token_threshold == 0:
                self.long_prefill_token_threshold = max(1, int(self.max_model_len * 0.04))
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot exceed "
                             f"max_model_len ({self.max_model_len})")
        super().__post_init__()
