"""The scheduler's structured-output hooks (vLLM: inline in `vllm/v1/core/sched/scheduler.py`).

One layer of the engine's scheduler (engine_scheduler.py). It holds the core's
`StructuredOutputManager` and, for requests whose params carry `structured_outputs`:
  * add_request       starts compiling the grammar; the request waits (vLLM's
                      WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR) and is passed over, not a blocker,
                      until it is ready — or finished with the compile error;
  * update_from_output advances the grammar over the tokens each request kept (accepted drafts
                      included: the rejected ones never reach it);
  * update_draft_token_ids cuts each proposal at the first draft the grammar refuses;
  * get_grammar_bitmask  (the core calls it after schedule) starts the masks of the requests that
                      sample this step — a prefill chunk samples nothing and gets none.
Without a manager (no structured request ever arrives) every hook is chapter 03's.
"""
from __future__ import annotations

import logging

from scheduler import EngineCoreOutput, FinishReason, Request, RequestStatus, Scheduler, SchedulerOutput
from scheduler.scheduled_step import ScheduledStep

from mini_vllm.async_output import PLACEHOLDER_TOKEN_ID

logger = logging.getLogger(__name__)


def uses_structured_output(request: Request) -> bool:
    params = request.sampling_params
    return params is not None and getattr(params, "structured_outputs", None) is not None


class StructuredOutputScheduler(Scheduler):
    structured_output_manager = None      # set by the engine core (structured_output_manager.py)

    def add_request(self, request: Request) -> None:
        if uses_structured_output(request):
            if self.structured_output_manager is None:
                raise ValueError("this engine has no structured output manager")
            self.structured_output_manager.grammar_init(request)
        super().add_request(request)

    def _try_schedule_waiting(self, request: Request, step: ScheduledStep) -> str:
        so = getattr(request, "structured_output_request", None)
        if so is not None:
            if not so.ready:
                return "skipped"                       # still compiling: the others go first
            if so.error is not None:
                self._finish_unscheduled(request, RequestStatus.FINISHED_ERROR, so.error, self._owns_kv(request))
                return "ignored"
        return super()._try_schedule_waiting(request, step)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> list[EngineCoreOutput]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        manager = self.structured_output_manager
        if manager is None or not manager.in_use:
            return outputs
        for i, out in enumerate(outputs):
            request = self.requests.get(out.request_id)
            if request is None or not out.new_token_ids or not manager.should_advance(request):
                continue                               # finished (grammar dropped with it), or unconstrained
            if not manager.accept_tokens(request, out.new_token_ids):
                message = f"structured output: the grammar refused tokens {out.new_token_ids} its own mask allowed"
                logger.error("request %s: %s", out.request_id, message)
                self.finish_requests(out.request_id, RequestStatus.FINISHED_ERROR)
                outputs[i] = EngineCoreOutput(out.request_id, out.new_token_ids, FinishReason.ERROR, message,
                                              out.num_cached_tokens)
        return outputs

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        manager = self.structured_output_manager
        if manager is not None and manager.in_use:
            draft_token_ids = {r: (manager.validate_tokens(req, d) if (req := self.requests.get(r)) is not None
                                   and PLACEHOLDER_TOKEN_ID not in d else d)
                               for r, d in draft_token_ids.items()}
        super().update_draft_token_ids(draft_token_ids)

    def get_num_waiting_for_grammar(self) -> int:
        """Grammars still compiling (their requests cannot be scheduled yet); the manager counts them,
        so an unconstrained step does not walk every request to find none."""
        manager = self.structured_output_manager
        return 0 if manager is None else manager.num_compiling

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput):
        """The masks of this step's constrained requests that sample (vLLM's name), started on the
        manager's thread; None when there are none."""
        manager = self.structured_output_manager
        if manager is None or not manager.in_use:
            return None
        req_ids = [r for r in scheduler_output.num_scheduled_tokens
                   if (req := self.requests.get(r)) is not None and manager.should_advance(req)
                   and not req.streaming_input and req.num_computed_tokens >= req.num_tokens]
        return manager.grammar_bitmask(self.requests, req_ids, scheduler_output.scheduled_spec_decode_tokens)
