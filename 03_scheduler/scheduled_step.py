"""The step being planned by `Scheduler.schedule()`: the budget left and every decision so far.

Kept in one object, changed only through `add` / `take_back`, so that the budget and the
per-request maps can never disagree — a running request preempted later in the same step is
taken back whole. Later chapters extend both: chapter 05's budget counts partial prefills,
chapter 04's step carries the speculative tokens it scheduled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass
class SchedulingBudget:
    """What is left of this step's budget. Chapter 05 extends it with partial-prefill counts."""

    token_budget: int


@dataclass
class ScheduledStep:
    """The step being planned: what `schedule()` has decided so far. Every decision goes
    through `add` / `take_back`, so the budget and the per-request maps never disagree."""

    budget: SchedulingBudget
    new_reqs: list[Request] = field(default_factory=list)          # first time scheduled
    resumed_reqs: list[Request] = field(default_factory=list)      # back after a preemption
    running_reqs: list[Request] = field(default_factory=list)      # were running already
    preempted_reqs: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)          # Δ per request
    req_to_new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int, block_ids: list[int], kind: list[Request]) -> None:
        kind.append(request)
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.req_to_new_block_ids[request.request_id] = block_ids
        self.budget.token_budget -= num_tokens

    def take_back(self, request: Request) -> None:
        """Un-schedule a running request planned earlier in this step (it is being preempted)."""
        self.budget.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.req_to_new_block_ids.pop(request.request_id)
        self.running_reqs.remove(request)
