"""Speculative tokens in the scheduler: chapter 03's `Scheduler`, with drafts riding along in Δ.

In the two-counter view ([Kwon 2025, Table 4.1], speculative decoding) a decoding request with
k drafts is scheduled Δ = 1 + k: its last token plus the k proposals, verified by the target in
one forward pass. `num_computed_tokens` advances by all of them at once (the next step is
planned before this one has run), and when the model answers, the rejected drafts are taken
back: num_computed_tokens -= L_rejected, num_tokens += L_draft - L_rejected + 1.

vLLM: `vllm/v1/core/sched/scheduler.py` (`request.spec_token_ids`, `scheduled_spec_decode_tokens`,
`num_rejected = num_draft_tokens - num_accepted` in `update_from_output`,
`update_draft_token_ids`), with the slots for the drafts reserved by `num_lookahead_tokens`.

The drafts of a step are proposed after it (`update_draft_token_ids`, by the engine) and used
once: the next step schedules them or drops them (finished, preempted, still prefilling).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler import Request, RequestStatus, ScheduledStep, Scheduler, SchedulerOutput, SchedulingBudget


@dataclass
class SpecDecodeStep(ScheduledStep):
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)   # request -> drafts scheduled

    def take_back(self, request: Request) -> None:
        super().take_back(request)
        self.spec_decode_tokens.pop(request.request_id, None)


class SpecDecodeScheduler(Scheduler):
    """Chapter 03's scheduler that also schedules speculative tokens (none: it is chapter 03's)."""

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Drafts proposed for the next step (vLLM's name). Stale ones are dropped."""
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue     # finished or preempted in the meantime: drafts are stale
            if request.num_computed_tokens < request.num_tokens - 1:
                continue     # still prefilling: no drafts (vLLM ignores them for prefill chunks)
            if request.streaming_input:
                continue     # its input is still open: nothing it samples is output yet
            request.spec_token_ids = list(drafts)

    # ---- scheduling: Δ = the known tokens + the drafts the budget allows
    def _new_step(self) -> SpecDecodeStep:
        return SpecDecodeStep(budget=self._new_budget())

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: SchedulingBudget) -> int:
        num_new_tokens = super()._num_new_tokens(request, num_computed_tokens, budget)
        if num_new_tokens and request.spec_token_ids and num_computed_tokens + num_new_tokens == request.num_tokens:
            num_new_tokens += self._num_drafts(request, num_new_tokens, budget)   # caught up: drafts ride along
        return num_new_tokens

    def _num_drafts(self, request: Request, num_new_tokens: int, budget: SchedulingBudget) -> int:
        """How many drafts ride along with a request whose Δ reaches its last known token: as
        many as the budget leaves, and none at a position >= max_model_len - 1 (the accepted
        drafts plus the bonus token must still fit in max_model_len)."""
        return max(0, min(len(request.spec_token_ids), budget.token_budget - num_new_tokens,
                          self.max_model_len - 1 - request.num_tokens))

    def _on_scheduled(self, request: Request, num_new_tokens: int, step: SpecDecodeStep) -> None:
        """Record the drafts inside Δ; they are used once."""
        super()._on_scheduled(request, num_new_tokens, step)
        if request.spec_token_ids:
            num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
            if num_spec > 0:
                step.spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []

    def _on_preempted(self, request: Request) -> None:
        super()._on_preempted(request)
        request.spec_token_ids = []

    def _build_output(self, step: SpecDecodeStep) -> SchedulerOutput:
        output = super()._build_output(step)
        output.scheduled_spec_decode_tokens = step.spec_decode_tokens
        return output

    # ---- after the forward: take back what the target rejected
    def _num_rejected_tokens(self, request: Request, scheduler_output: SchedulerOutput, sampled: list[int]) -> int:
        """The target kept len(sampled) - 1 drafts (+ its own token): num_computed_tokens
        advanced over every draft, and the rejected ones (and their K/V) are not part of the
        sequence."""
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(request.request_id)
        num_drafts = len(drafts) if drafts else 0
        if len(sampled) > num_drafts + 1:
            raise ValueError(f"request {request.request_id}: {len(sampled)} sampled tokens for {num_drafts} drafts")
        return num_drafts + 1 - len(sampled)

    def _max_num_computed_tokens(self, request: Request, in_flight: SchedulerOutput | None) -> int:
        """Drafts count as computed from the step that schedules them until the model answers."""
        drafts = in_flight.scheduled_spec_decode_tokens if in_flight is not None else {}
        return request.num_tokens_with_spec + len(drafts.get(request.request_id, ()))
