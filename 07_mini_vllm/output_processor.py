"""OutputProcessor: the engine core's token ids -> RequestOutputs (text, logprobs, metrics).

Mirrors vLLM v1's `vllm/v1/engine/output_processor.py` (`RequestState`,
`OutputProcessor.process_outputs`, `make_request_output`): one RequestState per live request
holds its detokenizer, its tokens, its logprobs and its timestamps. Each step it

  1. stamps the first-scheduled time of requests that started,
  2. appends each request's new tokens (and their logprobs), times them, detokenizes,
  3. looks for stop strings — a request that hit one is finished here and reported back to the
     engine (`reqs_to_stop`), which tells the scheduler (`finish_requests(FINISHED_STOPPED)`),
  4. builds a RequestOutput in the request's output kind (cumulative, delta, or final only).

Finish reasons: chapter 03's FinishReason (stop / length / abort) as vLLM's strings, plus
"error" for the requests the engine core failed (non-finite logits, can never fit).

With speculative decoding a step may bring several tokens for a request. The output must be
the one plain decoding gives, so a request with stop strings is detokenized token by token and
cut at the first token that completes one (the tokens after it were computed, but plain
decoding would never have produced them). Each step's draft counts and times go into the
request's `RequestMetrics.spec_decoding`.

Parallel sampling (n > 1): the front end sent n child requests (parallel_sampling.py); each has
its own RequestState (its own detokenizer, stop strings, logprobs), and its `ParentRequest`
gathers their completions into the parent's RequestOutput (`outputs[i]` is child i), finished when
all n are. The engine core never hears of the parent.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from spec_decode import SpecDecodingStats

from mini_vllm.core import EngineCoreStep
from mini_vllm.detokenizer import IncrementalDetokenizer
from mini_vllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from mini_vllm.parallel_sampling import ParentRequest
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0                 # DELTA: tokens already sent
    # Token ids only, cumulative, one completion: no text, no logprobs, no parent.
    # Such a request's running steps take `_plain_output` (what the general path computes for
    # it, without the branches that cannot apply): the GPU waits for this loop at large batches.
    plain: bool = False
    kv_transfer_params: dict | None = None     # what it produced for another engine, once finished
    lora_request: object = None                # its adapter (chapter 09), or None
    # Parallel sampling: the ParentRequest this state is child `index` of, and child 0's state
    # (the parent's RequestOutput carries its metrics and prompt logprobs).
    parent: ParentRequest | None = None
    index: int = 0
    first: "RequestState | None" = None


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}     # by the engine core's ids (children's for n > 1)
        self.parents: dict[str, ParentRequest] = {}          # parent id -> its ParentRequest, while a child runs

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, parent: ParentRequest | None = None, index: int = 0,
                    lora_request=None) -> None:
        """One request of the engine core: a plain request, or child `index` of `parent` (whose
        params are the child's own: n = 1, its seed). Children are added in index order."""
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already running")
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if params.detokenize else None
        state = RequestState(request_id, prompt, prompt_token_ids, params, detokenizer, RequestMetrics(arrival_time),
                             logprobs=[] if params.logprobs is not None else None,
                             cumulative_logprob=0.0 if params.logprobs is not None else None,
                             plain=self._is_plain(params, detokenizer, parent), parent=parent, index=index,
                             lora_request=lora_request)
        if parent is not None:
            if index == 0:
                self.parents[parent.request_id] = parent
            state.first = state if index == 0 else self.request_states[parent.child_ids[0]]
        self.request_states[request_id] = state

    @staticmethod
    def _is_plain(params: SamplingParams, detokenizer, parent) -> bool:
        """May this request's running steps take `_plain_output`? (See RequestState.plain.)"""
        return (detokenizer is None and parent is None and params.logprobs is None
                and params.output_kind == RequestOutputKind.CUMULATIVE)

    def child_ids(self, request_id: str) -> list[str]:
        """The ids the engine core knows a request by: its own, or its children's when n > 1."""
        parent = self.parents.get(request_id)
        return parent.child_ids if parent is not None else [request_id]

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Forget requests, by the user's ids (a parent's: all its children) or the core's."""
        for request_id in request_ids:
            for child_id in self.child_ids(request_id):
                self.request_states.pop(child_id, None)
            self.parents.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    # ------------------------------------------------------------------ one step
    def process_outputs(self, step: EngineCoreStep, now: float | None = None) -> tuple[list[RequestOutput], list[str]]:
        """-> (RequestOutputs to hand to the caller, ids of requests that hit a stop string)."""
        now = time.monotonic() if now is None else now
        for new in step.scheduler_output.scheduled_new_reqs:
            state = self.request_states.get(new.req_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = step.start_time
        if step.spec_decode is not None:
            self._observe_spec_decode(step)
        request_outputs: list[RequestOutput] = []
        reqs_to_stop: list[str] = []
        # Read once per step, not once per request: at batch 256 this loop is host time the GPU
        # waits for, and most steps have no errors, no prompt logprobs and no logprobs at all.
        states, errors, step_logprobs = self.request_states, step.errors, step.logprobs
        step_prompt_logprobs = step.prompt_logprobs
        for core_output in step.outputs:
            request_id = core_output.request_id
            state = states.get(request_id)
            if state is None or (errors and request_id in errors):
                continue                  # aborted meanwhile; errors are reported below
            new_ids = core_output.new_token_ids
            state.num_cached_tokens = core_output.num_cached_tokens
            if state.plain and new_ids and core_output.finish_reason is None and not (
                    step_prompt_logprobs and request_id in step_prompt_logprobs):
                request_outputs.append(self._plain_output(state, new_ids, core_output.stop_reason, now))
                continue
            if step_prompt_logprobs and request_id in step_prompt_logprobs:
                state.prompt_logprobs = [None] + [self._logprob_entry(state, entry)
                                                  for entry in step_prompt_logprobs[request_id]]
            finish_reason = str(core_output.finish_reason) if core_output.finish_reason is not None else None
            stop_reason = core_output.stop_reason
            stop_str = None
            if new_ids:
                if state.detokenizer is not None:
                    # EOS / a stop token ended it (the scheduler said "stop"): no stop-string search.
                    new_ids, stop_str = self._detokenize(state, new_ids, finish_reason == "stop")
                self._append_tokens(state, new_ids, step_logprobs.get(request_id) if step_logprobs else None, now)
                if state.detokenizer is not None:
                    if stop_str is not None:
                        if finish_reason is None:       # still running in the scheduler: finish it there
                            reqs_to_stop.append(request_id)
                        finish_reason, stop_reason = "stop", stop_str
            if finish_reason is not None:
                state.metrics.finished_time = now
                state.kv_transfer_params = step.kv_transfer_params.get(request_id)
                if state.detokenizer is not None and stop_str is None:
                    # Not cut at a stop string: emit what is held back — which may complete one.
                    stop_str = state.detokenizer.flush()
                    if stop_str is not None:
                        finish_reason, stop_reason = "stop", stop_str
            output = self._make_request_output(state, finish_reason, stop_reason)
            if output is not None:
                request_outputs.append(output)
            if finish_reason is not None:
                del states[request_id]
        for request_id, message in errors.items():
            state = self.request_states.pop(request_id, None)
            if state is not None:
                state.metrics.finished_time = now
                request_outputs.append(self._make_request_output(state, "error", message))
        return request_outputs, reqs_to_stop

    @staticmethod
    def _detokenize(state: RequestState, new_ids: list[int], stop_terminated: bool) -> tuple[list[int], str | None]:
        """Feed the step's tokens to the detokenizer -> (the tokens kept, the stop string hit or None).
        Several tokens at once (speculative decoding) with stop strings go one at a time, so the
        request ends at the token that completes a stop string, exactly as in plain decoding."""
        if len(new_ids) == 1 or not state.detokenizer.stop:
            return new_ids, state.detokenizer.update(new_ids, stop_terminated)
        for n, token_id in enumerate(new_ids, 1):
            stop_str = state.detokenizer.update([token_id], stop_terminated and n == len(new_ids))
            if stop_str is not None:
                return new_ids[:n], stop_str
        return new_ids, None

    def _observe_spec_decode(self, step: EngineCoreStep) -> None:
        """Per request: the drafts verified this step, and the step's drafting / verification
        time for the requests that took part."""
        spec = step.spec_decode
        for req_id, (num_draft, num_accepted) in spec.num_draft_tokens.items():
            state = self.request_states.get(req_id)
            if state is None:
                continue
            metrics = state.metrics
            if metrics.spec_decoding is None:
                metrics.spec_decoding = SpecDecodingStats.new(spec.num_spec_tokens)
            metrics.spec_decoding.observe_draft(num_draft, num_accepted)
            metrics.spec_verification_time += spec.verification_time
        for req_id in spec.drafted_req_ids:
            state = self.request_states.get(req_id)
            if state is not None:
                state.metrics.spec_drafting_time += spec.drafting_time

    @staticmethod
    def _append_token_ids(state: RequestState, new_ids: list[int], now: float) -> None:
        """The step's tokens and their arrival times (what every request records)."""
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.token_times.extend([now] * len(new_ids))
        state.output_token_ids.extend(new_ids)

    def _append_tokens(self, state: RequestState, new_ids: list[int], logprobs, now: float) -> None:
        self._append_token_ids(state, new_ids, now)
        if logprobs is not None and state.logprobs is not None:
            # One entry per emitted token (zip: tokens cut after a stop are dropped with theirs).
            for _, entry in zip(new_ids, logprobs):
                state.logprobs.append(self._logprob_entry(state, entry))
                state.cumulative_logprob += entry[1][0]

    @staticmethod
    def _plain_output(state: RequestState, new_ids: list[int], stop_reason, now: float) -> RequestOutput:
        """A plain request's running step (RequestState.plain): `_append_tokens` and
        `_make_request_output` of the general path, with only the branches that apply to it.
        The tests check both paths give equal RequestOutputs."""
        OutputProcessor._append_token_ids(state, new_ids, now)
        completion = CompletionOutput(0, "", state.output_token_ids[:], None, None, None, stop_reason)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], False,
                             state.metrics, state.num_cached_tokens, prompt_logprobs=state.prompt_logprobs,
                             lora_request=state.lora_request)

    def _logprob_entry(self, state: RequestState, entry: tuple[list[int], list[float], int]) -> dict[int, Logprob]:
        """(ids, logprobs, rank) -> {id: Logprob}: column 0 is the chosen token (sampled, or the
        prompt's own), then the top-k most likely (rank 1..k)."""
        ids, values, chosen_rank = entry
        out = {ids[0]: Logprob(values[0], chosen_rank, self._decode_one(state, ids[0]))}
        for rank, (token_id, value) in enumerate(zip(ids[1:], values[1:]), 1):
            out.setdefault(token_id, Logprob(value, rank, self._decode_one(state, token_id)))
        return out

    def _decode_one(self, state: RequestState, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if state.params.detokenize else None

    def _make_request_output(self, state: RequestState, finish_reason: str | None,
                             stop_reason) -> RequestOutput | None:
        finished = finish_reason is not None
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        text = state.detokenizer.get_next_output_text(finished, delta) if state.detokenizer is not None else ""
        if delta:
            token_ids = state.output_token_ids[state.sent_tokens:]
            logprobs = state.logprobs[state.sent_tokens:] if state.logprobs is not None else None
            state.sent_tokens = len(state.output_token_ids)
            if not token_ids and not text and not finished:
                return None               # nothing new to say this step
        else:
            token_ids, logprobs = state.output_token_ids[:], state.logprobs
        completion = CompletionOutput(state.index, text, token_ids, state.cumulative_logprob,
                                      logprobs[:] if logprobs is not None else None, finish_reason, stop_reason)
        if state.parent is not None:
            return self._parent_output(state, completion)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], finished,
                             state.metrics, state.num_cached_tokens, prompt_logprobs=state.prompt_logprobs,
                             kv_transfer_params=state.kv_transfer_params, lora_request=state.lora_request)

    def _parent_output(self, state: RequestState, completion: CompletionOutput) -> RequestOutput | None:
        """One child's completion -> its parent's RequestOutput (ParentRequest.get_outputs), under the
        parent's id, with child 0's metrics and prompt logprobs."""
        parent = state.parent
        outputs, finished = parent.get_outputs(completion)
        if finished:
            self.parents.pop(parent.request_id, None)
        if outputs is None:
            return None
        first = state.first
        return RequestOutput(parent.request_id, state.prompt, state.prompt_token_ids, outputs, finished,
                             first.metrics, first.num_cached_tokens, prompt_logprobs=first.prompt_logprobs,
                             kv_transfer_params=first.kv_transfer_params if finished else None,
                             lora_request=first.lora_request)
