"""Async scheduling's scheduler layer: plan step N+1 while step N is still running.

Mirrors vLLM v1's `vllm/v1/core/sched/async_scheduler.py: AsyncScheduler` and
`Request.num_output_placeholders`.

Why: a synchronous engine does schedule -> forward -> update_from_output -> output processing,
one after the other, and the device waits during the host's parts. With async scheduling the
engine core schedules step N+1 BEFORE step N's tokens are back (core.py: a queue of two
batches). For a request that samples in step N, step N+1 must compute the position of a token
whose value nobody on the host knows yet: a *placeholder*. The model runner reads that input id
from step N's sampled-token tensor on the device (model_runner.py), so the schedule only needs
to know that the token exists, not what it is.

In the two-counter view ([Kwon 2025, Table 4.1]) a placeholder is a token counted in the target
before it exists: the scheduler plans as if `num_tokens + num_output_placeholders` tokens were
known. What it changes, hook by hook (the chain of engine_scheduler.py, leftmost):

  * `_update_after_schedule`: a request whose Δ reaches the end of what it has (it will sample)
    gets one more placeholder;
  * `_num_new_tokens`: Δ counts the placeholders as known tokens — and is 0 for a request that
    is sure to stop at a token in flight (max_tokens, max_model_len: known without the token's
    value), so no step is wasted on it (vLLM does the same);
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

from scheduler import EngineCoreOutput, Request, RequestStatus, Scheduler, SchedulerOutput, SchedulingBudget
from scheduler import ScheduledStep, check_stop


class AsyncScheduler(Scheduler):
    """The engine's scheduler with placeholders for in-flight tokens (leftmost in the composed class)."""

    # ---- scheduling: the tokens in flight count as known ------------------------------------
    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: SchedulingBudget) -> int:
        placeholders = request.num_output_placeholders
        if placeholders == 0:
            return super()._num_new_tokens(request, num_computed_tokens, budget)
        if self._stops_in_flight(request):
            return 0
        # The layers below compute Δ from num_tokens - num_computed_tokens: shift the computed count.
        return super()._num_new_tokens(request, num_computed_tokens - placeholders, budget)

    def _stops_in_flight(self, request: Request) -> bool:
        """Will the request stop at a token in flight whatever its value? (check_stop's length limits)."""
        placeholders = request.num_output_placeholders
        return (request.num_output_tokens + placeholders >= request.max_tokens
                or request.num_tokens + placeholders >= self.max_model_len)

    def _try_schedule_waiting(self, request: Request, step: ScheduledStep) -> str:
        """A request preempted while its last batch was in flight cannot be recomputed (or swapped
        in) before that token's value is known. It never is: chapter 03 admits nothing in a step
        that preempts, and the engine core applies the in-flight batch's output before the next
        schedule. Asserted, because a silent skip would hide a broken order."""
        assert request.num_output_placeholders == 0, \
            f"{request.request_id} is waiting with a token in flight: its batch's output was not applied first"
        return super()._try_schedule_waiting(request, step)

    def _update_after_schedule(self, step: ScheduledStep) -> None:
        """Before the counters advance: every scheduled request whose Δ reaches the end of its
        tokens (placeholders included) will sample one token — one more placeholder."""
        requests = self.requests
        for req_id, num_new_tokens in step.num_scheduled_tokens.items():
            request = requests[req_id]
            if request.num_computed_tokens + num_new_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        super()._update_after_schedule(step)

    # ---- a batch's output comes back ----------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> list[EngineCoreOutput]:
        """Chapter 03's update for the requests still running; the ones preempted since this batch
        was sent are handled here (chapter 03 expects a running request's blocks). Every token that
        came back replaces one placeholder."""
        late = [r for r in scheduler_output.num_scheduled_tokens
                if (req := self.requests.get(r)) is not None and req.status == RequestStatus.PREEMPTED]
        outputs = [out for out in (self._update_preempted(self.requests[r], model_runner_output) for r in late)
                   if out is not None]
        if late:
            scheduler_output = dataclasses.replace(scheduler_output, num_scheduled_tokens={
                r: n for r, n in scheduler_output.num_scheduled_tokens.items() if r not in late})
        self._release_placeholders(scheduler_output, model_runner_output)
        return super().update_from_output(scheduler_output, model_runner_output) + outputs

    def _release_placeholders(self, scheduler_output: SchedulerOutput, model_runner_output) -> None:
        """The batch's tokens are no longer in flight. (Taken off before chapter 03 appends them:
        a request it finishes is gone after, and nothing in between reads the count.)"""
        index, sampled = model_runner_output.req_id_to_index, model_runner_output.sampled_token_ids
        requests = self.requests
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is not None and req_id in index:
                request.num_output_placeholders -= min(len(sampled[index[req_id]]), request.num_output_placeholders)

    def _update_preempted(self, request: Request, model_runner_output) -> EngineCoreOutput | None:
        """A request preempted after this batch was sent: its token is real — the batch computed it
        from K/V that was intact then. Append it (a sync engine would have, before preempting) and
        check its stop; a stopped request leaves the waiting queue."""
        req_id = request.request_id
        request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
        if req_id in model_runner_output.failed:
            message = model_runner_output.failed[req_id]
            self.waiting.remove_requests([request])
            self._free_request(request, RequestStatus.FINISHED_ERROR, self._owns_kv(request), message=message)
            return EngineCoreOutput(req_id, [], request.get_finished_reason(), message,
                                    max(request.num_cached_tokens, 0))
        index = model_runner_output.req_id_to_index
        tokens = list(model_runner_output.sampled_token_ids[index[req_id]]) if req_id in index else []
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
