"""What the engine hands back: RequestOutput, CompletionOutput, Logprob, RequestMetrics.

Mirrors vLLM's `vllm/outputs.py` (`RequestOutput`, `CompletionOutput`), `vllm/logprobs.py`
(`Logprob`) and the per-request timestamps of `vllm/v1/metrics/stats.py: RequestStateStats`
(arrival, first scheduled, first token, last token), plus every token's own timestamp so that
inter-token latencies (ITL) can be measured, not only their mean.

`finish_reason` is vLLM's string: "stop" (EOS, a stop token or a stop string), "length"
(max_tokens or max_model_len), "abort" (the caller aborted it), or "error" (this request
failed — its logits were not finite, or it can never fit in the KV cache — while the engine
kept serving the others; `stop_reason` then holds the message). For "stop", `stop_reason` is
the stop token id or stop string that ended it (None for EOS).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spec_decode import SpecDecodingStats


@dataclass
class Logprob:
    """One candidate token's log-probability (the raw model distribution unless EngineConfig.logprobs_mode says otherwise)."""
    logprob: float
    rank: int                          # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token: None for the first (nothing precedes it), then token id -> Logprob (the
# prompt's own token and the top-k), as vLLM's PromptLogprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str                          # CUMULATIVE/FINAL_ONLY: all text so far; DELTA: this step's new text
    token_ids: list[int]               # likewise for tokens
    cumulative_logprob: float | None   # sum of the sampled tokens' logprobs (when logprobs were asked for)
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) of one request's life."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # when each output token reached the engine
    # Speculative decoding (None without it): this request's drafts — acceptance rate, mean
    # acceptance length, per position (vLLM's SpecDecodingStats formulas) — and the wall time of
    # the batched drafting calls and verification steps it took part in.
    spec_decoding: SpecDecodingStats | None = None
    spec_drafting_time: float = 0.0
    spec_verification_time: float = 0.0

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: arrival -> first output token (queueing + prefill)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """ITL: the gap before each output token after the first."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def time_per_output_token(self) -> float | None:
        """Mean ITL (vLLM's TPOT): decode time / (tokens - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted drafts / proposed drafts (None: no drafts were verified)."""
        s = self.spec_decoding
        return None if s is None or not s.num_draft_tokens else s.acceptance_rate

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens per target pass in the steps that verified drafts (accepted drafts + 1)."""
        s = self.spec_decoding
        return None if s is None or not s.num_drafts else s.mean_acceptance_length

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]    # one per child: n with SamplingParams.n (outputs[i].index == i)
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0         # prompt tokens served from the prefix cache
    # KV transfer (chapter 06, vLLM's field): what a finished request hands to another engine —
    # on a prefill node, where its K/V waits for the decode node (pass it as that request's params).
    kv_transfer_params: dict | None = None
    prompt_logprobs: PromptLogprobs | None = None    # SamplingParams.prompt_logprobs; from the first output on
    lora_request: Any = None           # the LoRARequest it ran with (chapter 09), or None: the base model

    def __repr__(self) -> str:
        o = self.outputs[0]
        return (f"RequestOutput(request_id={self.request_id!r}, text={o.text!r}, tokens={len(o.token_ids)}, "
                f"finished={self.finished}, finish_reason={o.finish_reason!r})")
