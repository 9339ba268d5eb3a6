"""A request as the scheduler sees it: token ids and TWO counters.

Mirrors `Request` and `RequestStatus` in vLLM's `vllm/v1/request.py`.

The whole scheduling state of a request is two numbers [Kwon 2025, §4.4.2, Table 4.1]:

    num_tokens           = len(prompt) + len(output)      the target: tokens that exist
    num_computed_tokens  = tokens whose KV is in the cache  the progress
    0 <= num_computed_tokens <= num_tokens

Each step the scheduler picks Δ with 0 < Δ <= num_tokens - num_computed_tokens (plus any
speculative drafts) and advances `num_computed_tokens += Δ`; when the request catches up,
the model samples a token and `num_tokens += 1`. Prefill (Δ = prompt), decode (Δ = 1),
chunked prefill (Δ < prompt), prefix-cache hits (start at L_cached), recompute preemption
(reset to 0), remote KV (start at L_prompt), streaming input (num_tokens += L_new) and
speculative decoding (Δ = 1 + drafts, roll back the rejected ones) are all updates of these
two numbers — there is no "prefill mode" and no "decode mode" anywhere in this chapter.

Stop conditions are plain fields (max_tokens, eos_token_id / ignore_eos, stop_token_ids);
`SamplingParams` lives in the engine (chapter 07), which copies them here. The engine's own
sampling parameters may ride along in `sampling_params`; the scheduler never reads them.
"""
from __future__ import annotations

import enum
import time
from typing import Any, Sequence


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Ordered so that `status > PREEMPTED` means finished,
    exactly like vLLM's enum."""

    WAITING = enum.auto()                  # in the waiting queue, owns no KV blocks
    WAITING_FOR_REMOTE_KVS = enum.auto()   # owns blocks that a KV connector is filling (disaggregation)
    RUNNING = enum.auto()                  # owns KV blocks on the device, scheduled every step it can be
    PREEMPTED = enum.auto()                # evicted to the waiting queue (KV dropped, or swapped to CPU)
    FINISHED_STOPPED = enum.auto()         # EOS or a stop token
    FINISHED_LENGTH_CAPPED = enum.auto()   # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()         # abort() / finish_requests() from outside
    FINISHED_IGNORED = enum.auto()         # can never fit in the KV cache: failed with a clear reason
    FINISHED_ERROR = enum.auto()           # the model runner could not run it (a per-request fault)

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> "FinishReason | None":
        return _FINISHED_REASONS.get(status)


class FinishReason(enum.IntEnum):
    """What the user is told (OpenAI's finish_reason): stop, length, abort, or error (vLLM's
    FinishReason.ERROR: the request failed inside the engine; the others went on)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,   # vLLM reports "length" for ignored prompts too
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One generation request. Attributes the KV cache manager reads (its `Protocol`):
    `request_id`, `all_token_ids`, `num_tokens`, `num_computed_tokens`, `cache_salt`, `lora_int_id`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        cache_salt: str | None = None,
        streaming_input: bool = False,
        sampling_params: Any = None,
        kv_transfer_params: dict[str, Any] | None = None,
        skip_reading_prefix_cache: bool = False,
        lora_request: Any = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id}: the prompt is empty; a request needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority          # lower value = served earlier (vLLM's convention)
        self.eos_token_id = eos_token_id
        self.ignore_eos = ignore_eos
        self.stop_token_ids = frozenset(stop_token_ids)
        self.cache_salt = cache_salt      # part of the first block's hash: isolates tenants' prefix caches
        self.sampling_params = sampling_params
        # What a KV connector needs to know about THIS request (vLLM's name, chapter 06): on a
        # prefill node {"do_remote_decode": True}; on a decode node the prefill node's answer
        # (where its K/V is). Opaque to the scheduler: only the connector reads it.
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise ValueError(f"request {request_id}: kv_transfer_params must be a dict or None, "
                             f"got {type(kv_transfer_params).__name__}")
        self.kv_transfer_params = kv_transfer_params
        # Compute every token even where the prefix cache holds it (vLLM's name): the engine sets
        # it for a request that wants its prompt's logprobs, which need the logits of every position.
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        # The adapter this request runs with (chapter 09, vLLM's LoRARequest), or None: the base model.
        # The scheduler reads only its id (at most max_loras distinct ids run at once); the KV cache
        # manager hashes the id into every block (two adapters never share K/V).
        self.lora_request = lora_request

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None   # the stop token id, or a message (FINISHED_IGNORED / _ERROR)
        self._output_token_ids: list[int] = []
        # prompt + output in one list, appended to in place (the KV manager hashes it incrementally).
        self._all_token_ids: list[int] = list(self.prompt_token_ids)

        # ---- the two counters (num_tokens is len(_all_token_ids)) ----
        self.num_computed_tokens = 0
        # Speculative decoding (chapter 04): draft tokens proposed for the next step. They are
        # scheduled as extra tokens (num_tokens_with_spec) but are not part of num_tokens until
        # the target model accepts them; update_from_output rolls back the rejected ones.
        self.spec_token_ids: list[int] = []
        # Async scheduling (chapter 07, vLLM's name): tokens the model is computing right now, in a
        # batch sent before the last one came back. Their positions are scheduled already (the next
        # batch reads them on the device); their values arrive with that batch's output.
        self.num_output_placeholders = 0
        # Streaming input ([Kwon 2025, Table 4.1], "streaming prefills"): while True, more prompt tokens may
        # arrive (append_prompt_tokens) and no output token is sampled yet.
        self.streaming_input = streaming_input

        # ---- bookkeeping the scheduler and the metrics read ----
        self.num_preemptions = 0
        self.num_cached_tokens = -1       # prefix-cache hit length at first scheduling (-1: not yet)
        self.kv_swapped_out = False       # PREEMPTED with its KV on the CPU tier (swap), not dropped

    # ---------------------------------------------------------------- counters
    @property
    def lora_int_id(self) -> int | None:
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._all_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self._output_token_ids

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    # ---------------------------------------------------------------- updates
    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """num_tokens += len(token_ids): the model produced tokens."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def append_prompt_tokens(self, token_ids: Sequence[int], final: bool) -> None:
        """Streaming prefill: num_tokens += L_new while num_computed_tokens stays, so the new
        tokens become schedulable. `final=True` closes the input; from then on the model's
        samples are output tokens."""
        if not self.streaming_input:
            raise ValueError(f"request {self.request_id} does not take streaming input (its prompt is closed)")
        if final and not token_ids and self.num_computed_tokens >= self.num_tokens:
            # Every known token is already computed: nothing left to produce the first output's logits.
            raise ValueError(f"request {self.request_id}: the final input chunk must be non-empty "
                             "once all earlier input is computed")
        self.prompt_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if final:
            self.streaming_input = False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}, "
                f"tokens={self.num_tokens}, prompt={self.num_prompt_tokens})")
