"""A stand-in for chapter 07's model runner: answers a `SchedulerOutput` with sampled tokens,
without a model. The simulator, the tests and the notebook drive the scheduler with it.

What it must get right is WHICH requests sample: a request samples a token only when this
step's tokens reach the end of its sequence — after `schedule()` advanced the counter,
`num_computed_tokens >= num_tokens` (a prefill chunk that stops short samples nothing).
With speculative drafts scheduled, the target model verifies them: `num_accepted(request,
drafts)` of them are kept and one more token is sampled after the last accepted one.
"""
from __future__ import annotations

from typing import Callable

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request


class MockModelRunner:
    def __init__(self, next_token: Callable[[Request], int] = lambda request: 1,
                 num_accepted: Callable[[Request, list[int]], int] = lambda request, drafts: len(drafts)) -> None:
        self.next_token = next_token
        self.num_accepted = num_accepted

    def execute(self, requests: dict[str, Request], scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """`requests`: the scheduler's id -> Request map (read after schedule())."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = requests[req_id]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])                     # a prefill chunk: no logits wanted yet
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            accepted = self.num_accepted(request, drafts)
            if not 0 <= accepted <= len(drafts):
                raise ValueError(f"num_accepted returned {accepted} for {len(drafts)} drafts")
            sampled.append(list(drafts[:accepted]) + [self.next_token(request)])
        return ModelRunnerOutput(req_ids, sampled)
