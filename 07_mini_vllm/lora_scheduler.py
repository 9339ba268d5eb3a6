"""The scheduler's LoRA rule (vLLM: inline in `vllm/v1/core/sched/scheduler.py`, `scheduled_loras`).

One layer of the engine's scheduler (engine_scheduler.py). A step can only use `max_loras` adapters:
that is how many device slots the model runner has (chapter 09's adapter manager). So, as vLLM does,
the scheduler counts the distinct adapters of the running requests it schedules this step, and a
waiting request whose adapter would be one too many is passed over ("skipped": it keeps its place
in the queue, and the requests behind it, of adapters already running or of none, may still go).
It is admitted once a running request of another adapter finishes and a slot frees.

Running requests are never cut to fit: they were admitted under the same rule, so they hold at most
`max_loras` adapters between them. Requests without an adapter (the base model) never count.
Without LoRA (`max_loras` None) every hook is the layer below's.
"""
from __future__ import annotations

from scheduler import Request, Scheduler
from scheduler.scheduled_step import ScheduledStep


class LoRAScheduler(Scheduler):
    max_loras: int | None = None            # set by the engine core when enable_lora (EngineConfig.max_loras)

    def _schedule_waiting(self, step: ScheduledStep) -> None:
        if self.max_loras is not None:
            scheduled = step.num_scheduled_tokens
            self._step_loras = {r.lora_int_id for r in self.running
                                if r.lora_request is not None and r.request_id in scheduled}
        super()._schedule_waiting(step)

    def _try_schedule_waiting(self, request: Request, step: ScheduledStep) -> str:
        """A waiting request of an adapter this step does not run yet, when the step already runs
        max_loras adapters: "skipped". Otherwise the layer below decides; an admitted request's adapter
        counts from then on (`self._step_loras`: the adapters of this step's scheduled requests)."""
        if self.max_loras is None or request.lora_request is None:
            return super()._try_schedule_waiting(request, step)
        lora_id = request.lora_int_id
        ### BEGIN SOLUTION
        if lora_id not in self._step_loras and len(self._step_loras) >= self.max_loras:
            return "skipped"                # one adapter too many this step: wait for a slot
        outcome = super()._try_schedule_waiting(request, step)
        if outcome == "admitted":
            self._step_loras.add(lora_id)
        return outcome
        ### END SOLUTION
