"""Batches in flight: the engine core schedules the next batch before the last one's output is back.

Mirrors vLLM v1's `vllm/v1/core/sched/async_scheduler.py: AsyncScheduler` (`Request.num_output_placeholders`,
`_update_after_schedule`) and what its base `Scheduler` does for pipeline parallelism
(`EngineCore.step_with_batch_queue`, `max_concurrent_batches`, `CachedRequestData.new_token_ids`).

Why: a synchronous engine does schedule -> forward -> update_from_output, one after the other,
and whatever does not run meanwhile waits. With up to `max_concurrent_batches` batches in flight
(core.py: the batch queue), two things overlap:

  * pipeline micro-batches (`placeholders=False`): while the last stage runs batch A, stage 0 runs
    batch B — of OTHER requests. A request in flight has nothing to compute until its token is back
    (chapter 03 gives it Δ = 0: its counters were advanced when it was scheduled), and each batch
    takes at most a 1 / max_concurrent_batches share of the requests (else the first batch takes
    everyone, the next is empty, and the stages run one at a time again). Only the last stage
    samples; the others learn a request's tokens with its next schedule (`new_token_ids`).
  * async scheduling (`placeholders=True`): batch N+1 holds the SAME requests as batch N, scheduled
    with a *placeholder* for each token N is still computing. The model runner reads that input
    id from N's sampled-token tensor on the device (model_runner.py), so the schedule only needs to
    know that the token exists, not what it is. In the two-counter view ([Kwon 2025, Table 4.1]) a
    placeholder is a token counted in the target before it exists: the scheduler plans as if
    `num_tokens + num_output_placeholders` tokens were known.

What changes, hook by hook (leftmost in the composed class, engine_scheduler.py):

  * `_update_after_schedule`: every scheduled request is one batch more in flight; with
    placeholders, a request whose Δ reaches the end of what it has (it will sample) gets one more;
  * `_num_new_tokens`: Δ counts the placeholders as known tokens — and is 0 for a request that
    is sure to stop at a token in flight (max_tokens, max_model_len: known without the token's
    value), so no step is wasted on it (vLLM does the same); 0 once a micro-batch has its share;
  * `_try_schedule_waiting`: a waiting request with a batch in flight (preempted after it was sent)
    waits for that batch's token before it is recomputed;
  * `update_from_output`: each token that comes back replaces a placeholder. A request stopped
    by a token's VALUE (EOS, a stop id) was already scheduled for one more step: that step's
    work is discarded (its output finds the request finished). Its blocks are freed now, while
    that step may still write them: any new owner is in a later batch, and batches run in the
    order they were sent, so those writes land first. A request preempted after its batch was
    sent gets its token all the same (the batch ran with its K/V intact): it is appended, its stop
    checked, and the request recomputes it when it resumes.

The order between update_from_output's writes and schedule's reads is the engine core's: it
schedules N+1 (reading counters that include N's placeholders), then applies N's output
(replacing them), then schedules N+2 — never two at once.
"""
from __future__ import annotations

import dataclasses

from scheduler import EngineCoreOutput, Request, RequestStatus, SchedulerOutput, SchedulingBudget
from scheduler import ScheduledStep, check_stop

from mini_vllm.async_output import PLACEHOLDER_TOKEN_ID
from mini_vllm.structured_output_scheduler import uses_structured_output
from mini_vllm.engine_scheduler import EngineScheduler


class AsyncScheduler(EngineScheduler):
    """The engine's scheduler with batches in flight (see the module docstring)."""

    def __init__(self, config, kv_cache_manager, *, connector=None, placeholders: bool = True,
                 max_concurrent_batches: int = 2) -> None:
        super().__init__(config, kv_cache_manager, connector=connector)
        self.placeholders = placeholders
        self.max_concurrent_batches = max_concurrent_batches
        self._in_flight: dict[str, int] = {}       # request id -> batches in flight that schedule it
        self._share_left: int | None = None        # micro-batches: requests this batch may still take
        self._num_tokens_sent: dict[str, int] = {}  # micro-batches: num_tokens when last scheduled

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if not self.placeholders:                  # a micro-batch: its share of the requests
            self._share_left = -(-len(self.requests) // self.max_concurrent_batches)
        return super().schedule()

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: SchedulingBudget) -> int:
        if self._share_left == 0:
            return 0
        placeholders = request.num_output_placeholders
        if placeholders == 0:
            return super()._num_new_tokens(request, num_computed_tokens, budget)
        if self._stops_in_flight(request) or uses_structured_output(request):
            # A constrained request's next mask needs the token in flight: it waits for it (vLLM
            # schedules it and defers only the sampling; here the others fill the batch meanwhile).
            return 0
        # The layers below compute Δ from num_tokens - num_computed_tokens: shift the computed count.
        return super()._num_new_tokens(request, num_computed_tokens - placeholders, budget)

    def _stops_in_flight(self, request: Request) -> bool:
        """Will the request stop at a token in flight whatever its value? (check_stop's length limits)."""
        placeholders = request.num_output_placeholders
        return (request.num_output_tokens + placeholders >= request.max_tokens
                or request.num_tokens + placeholders >= self.max_model_len)

    def _on_scheduled(self, request: Request, num_new_tokens: int, step: ScheduledStep) -> None:
        super()._on_scheduled(request, num_new_tokens, step)
        self._take_share()

    def _on_admitted(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                     budget: SchedulingBudget) -> None:
        super()._on_admitted(request, num_computed_tokens, num_new_tokens, budget)
        self._take_share()

    def _take_share(self) -> None:
        if self._share_left is not None:
            self._share_left -= 1

    def _try_schedule_waiting(self, request: Request, step: ScheduledStep) -> str:
        """A request preempted after a batch that schedules it was sent is recomputed (or swapped in)
        only once that batch's token is known: until then it is passed over, not a blocker."""
        if self._in_flight.get(request.request_id):
            return "skipped"
        return super()._try_schedule_waiting(request, step)

    def _update_after_schedule(self, step: ScheduledStep) -> None:
        """Before the counters advance: every scheduled request is in one more batch; with
        placeholders, one whose Δ reaches the end of its tokens (placeholders included) will emit
        a token and, with speculative decoding, up to one per draft — that many placeholders — and
        its next step gets k placeholder drafts: the model runner fills them with what its drafter
        proposes after this step (vLLM: AsyncScheduler._spec_token_placeholders)."""
        requests, in_flight = self.requests, self._in_flight
        drafts = getattr(step, "spec_decode_tokens", {})
        for req_id, num_new_tokens in step.num_scheduled_tokens.items():
            in_flight[req_id] = in_flight.get(req_id, 0) + 1
            request = requests[req_id]
            if self.placeholders and (request.num_computed_tokens + num_new_tokens
                                      >= request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1 + len(drafts.get(req_id, ()))
                if self.num_lookahead_tokens and not uses_structured_output(request):
                    request.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * self.num_lookahead_tokens
        self._share_left = None
        super()._update_after_schedule(step)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """With placeholders the drafts never come through the scheduler: the next step was scheduled
        with placeholder drafts before these were proposed, and the runner fills those in itself."""
        if not self.placeholders:
            super().update_draft_token_ids(draft_token_ids)

    def _num_drafts(self, request: Request, num_new_tokens: int, budget: SchedulingBudget) -> int:
        """Chapter 04's room for drafts, counting the tokens in flight as the request's."""
        room = self.max_model_len - 1 - request.num_tokens - request.num_output_placeholders
        return max(0, min(super()._num_drafts(request, num_new_tokens, budget), room))

    def _build_output(self, step: ScheduledStep) -> SchedulerOutput:
        """Micro-batches: the stages that do not sample learn a running request's tokens sampled
        since it was last scheduled (vLLM: CachedRequestData.new_token_ids, "used in PP only"); a
        new or resumed request carries all of its tokens already."""
        output = super()._build_output(step)
        if not self.placeholders:
            sent, requests = self._num_tokens_sent, self.requests
            for new in output.scheduled_new_reqs:
                sent[new.req_id] = requests[new.req_id].num_tokens
            cached = output.scheduled_cached_reqs
            for req_id, resumed in zip(cached.req_ids, cached.resumed_from_preemption):
                request = requests[req_id]
                if not resumed and request.num_tokens > sent[req_id]:
                    cached.new_token_ids[req_id] = list(request.all_token_ids[sent[req_id]:])
                sent[req_id] = request.num_tokens
        return output

    def _free_request(self, request: Request, finished_status: RequestStatus, owns_kv: bool,
                      message: str | None = None) -> None:
        self._num_tokens_sent.pop(request.request_id, None)
        super()._free_request(request, finished_status, owns_kv, message)

    # ---- a batch's output comes back -------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> list[EngineCoreOutput]:
        """Chapter 03's update for the requests still running; the ones preempted since this batch
        was sent are handled here (chapter 03 expects a running request's blocks). Every token that
        came back replaces one placeholder."""
        for req_id in scheduler_output.num_scheduled_tokens:
            left = self._in_flight.pop(req_id, 1) - 1
            if left:
                self._in_flight[req_id] = left
        late = [r for r in scheduler_output.num_scheduled_tokens
                if (req := self.requests.get(r)) is not None and req.status == RequestStatus.PREEMPTED]
        outputs = [out for out in (self._update_preempted(self.requests[r], scheduler_output, model_runner_output)
                                   for r in late) if out is not None]
        if late:
            scheduler_output = dataclasses.replace(scheduler_output, num_scheduled_tokens={
                r: n for r, n in scheduler_output.num_scheduled_tokens.items() if r not in late})
        self._release_placeholders(scheduler_output, model_runner_output)
        return super().update_from_output(scheduler_output, model_runner_output) + outputs

    def _release_placeholders(self, scheduler_output: SchedulerOutput, model_runner_output) -> None:
        """The batch's tokens are no longer in flight: a request that emitted tokens (or failed)
        had 1 + its scheduled drafts placeholders; chapter 04 takes its rejected drafts back from
        num_computed_tokens. (Taken off before chapter 03 appends the tokens: a request it finishes
        is gone after, and nothing in between reads the count.)"""
        index, sampled = model_runner_output.req_id_to_index, model_runner_output.sampled_token_ids
        requests, drafts = self.requests, scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is not None and req_id in index and (sampled[index[req_id]]
                                                            or req_id in model_runner_output.failed):
                released = 1 + len(drafts.get(req_id, ()))
                request.num_output_placeholders -= min(released, request.num_output_placeholders)

    def _update_preempted(self, request: Request, scheduler_output: SchedulerOutput,
                          model_runner_output) -> EngineCoreOutput | None:
        """A request preempted after this batch was sent: its tokens are real — the batch computed
        them from K/V that was intact then. Append them (a sync engine would have, before
        preempting) and check its stop; a stopped request leaves the waiting queue."""
        req_id = request.request_id
        released = 1 + len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
        request.num_output_placeholders = max(0, request.num_output_placeholders - released)
        if req_id in model_runner_output.failed:
            message = model_runner_output.failed[req_id]
            self.waiting.remove_requests([request])
            self._free_request(request, RequestStatus.FINISHED_ERROR, self._owns_kv(request), message=message)
            return EngineCoreOutput(req_id, [], request.get_finished_reason(), message,
                                    max(request.num_cached_tokens, 0))
        index = model_runner_output.req_id_to_index
        tokens = list(model_runner_output.sampled_token_ids[index[req_id]]) if req_id in index else []
        if tokens and request.num_computed_tokens:   # swapped out with its counters: drafts it rejected go
            request.num_computed_tokens -= released - len(tokens)
        for n, token_id in enumerate(tokens, 1):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len):
                self.waiting.remove_requests([request])
                self._free_request(request, request.status, self._owns_kv(request))
                return EngineCoreOutput(req_id, tokens[:n], request.get_finished_reason(), request.stop_reason,
                                        max(request.num_cached_tokens, 0))
        return EngineCoreOutput(req_id, tokens, num_cached_tokens=max(request.num_cached_tokens, 0)) if tokens else None

    # ---- invariants ---------------------------------------------------------------------------
    def _max_num_computed_tokens(self, request: Request, in_flight: SchedulerOutput | None) -> int:
        """Positions of tokens in flight are scheduled (computed or being computed) already."""
        return super()._max_num_computed_tokens(request, in_flight) + request.num_output_placeholders


__all__ = ["AsyncScheduler"]
