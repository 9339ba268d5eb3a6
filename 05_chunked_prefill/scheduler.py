"""Chunked prefill: chapter 03's scheduler, allowed to cut a prompt into chunks.

Why ([vLLM 2.0 part 2, §10.1]; Sarathi [Agrawal 2023]): without chunking, a long prompt is one huge step. Every
running request waits for it: its next token is delayed by the whole prefill (the "dam").
With chunking, the prompt goes through in budget-sized pieces, each batched with the
decodes of the other requests, so no step is longer than the budget allows — decoders'
inter-token latency stays bounded, and the GPU mixes compute-bound prefill tokens with
memory-bound decode tokens in one pass.

In the two-counter view [Kwon 2025, Table 4.1] chunking is nothing more than choosing
Δ < L_prompt: num_computed_tokens advances by a chunk per step, no token is sampled until
it reaches num_tokens. So this is NOT a separate scheduler: it is chapter 03's `Scheduler`
with one decision changed (`_num_new_tokens`: how big is Δ) and one admission rule added
(`_defer_admission`: how many prompts may be partway through at once).

vLLM: `vllm/v1/core/sched/scheduler.py` (`num_new_tokens = min(num_new_tokens,
token_budget)` when `enable_chunked_prefill`, the `long_prefill_token_threshold` cap) and
vLLM V0's `PartialPrefillMetadata` / `_chunk_new_tokens_to_schedule` in
`vllm/core/scheduler.py` (max_num_partial_prefills, max_long_partial_prefills, the per-slot
budget `max_num_batched_tokens // max_num_partial_prefills`).
"""
from __future__ import annotations

from dataclasses import dataclass

from chunked_prefill.config import ChunkedPrefillConfig
from scheduler import Request, Scheduler, SchedulingBudget


@dataclass
class PartialPrefillBudget(SchedulingBudget):
    num_partial_prefills: int = 0        # requests partway through their prefill this step
    num_long_partial_prefills: int = 0   # ... of which long (more than the threshold left)
    prefill_slot_budget: int = 0         # most tokens one prefill may take this step


class ChunkedPrefillScheduler(Scheduler):
    splits_prompts = True

    def __init__(self, config: ChunkedPrefillConfig, kv_cache_manager, **kwargs) -> None:
        if not isinstance(config, ChunkedPrefillConfig):
            raise TypeError(f"ChunkedPrefillScheduler needs a ChunkedPrefillConfig, got {type(config).__name__}")
        super().__init__(config, kv_cache_manager, **kwargs)
        self.config: ChunkedPrefillConfig = config

    def _is_long(self, num_remaining_tokens: int) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return 0 < threshold < num_remaining_tokens

    def _new_budget(self) -> PartialPrefillBudget:
        # Prefills already in flight (admitted earlier, not finished): a decode has 1 token left.
        budget = PartialPrefillBudget(self.max_num_scheduled_tokens)
        for request in self.running:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1:
                budget.num_partial_prefills += 1
                budget.num_long_partial_prefills += self._is_long(remaining)
        # vLLM V0's prefill slots: the prefills that can be served this step (in flight +
        # waiting, at most max_num_partial_prefills) split the budget evenly.
        num_slots = min(self.config.max_num_partial_prefills, budget.num_partial_prefills + len(self.waiting))
        budget.prefill_slot_budget = max(1, self.max_num_scheduled_tokens // max(1, num_slots))
        return budget

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: PartialPrefillBudget) -> int:
        if not self.config.enable_chunked_prefill:
            return super()._num_new_tokens(request, num_computed_tokens, budget)
        remaining = request.num_tokens - num_computed_tokens
        if remaining <= 0:
            return 0
        ### BEGIN SOLUTION
        num_new_tokens = remaining
        if self._is_long(remaining):
            # A long prefill advances at most `threshold` tokens a step: it never eats the whole budget.
            num_new_tokens = self.config.long_prefill_token_threshold
        if remaining > 1:
            # Concurrent prefills share the budget (one "slot" each).
            num_new_tokens = min(num_new_tokens, budget.prefill_slot_budget)
        num_new_tokens = min(num_new_tokens, budget.token_budget)     # the chunk: cut at the budget
        ### END SOLUTION
        return num_new_tokens

    def _defer_admission(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                         budget: PartialPrefillBudget) -> bool:
        remaining = request.num_tokens - num_computed_tokens
        if num_new_tokens >= remaining:
            return False          # completes its prefill in this step: never a partial prefill
        ### BEGIN SOLUTION
        if budget.num_partial_prefills >= self.config.max_num_partial_prefills:
            return True
        return self._is_long(remaining) and budget.num_long_partial_prefills >= self.config.max_long_partial_prefills
        ### END SOLUTION

    def _on_admitted(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                     budget: PartialPrefillBudget) -> None:
        remaining = request.num_tokens - num_computed_tokens
        if num_new_tokens < remaining:        # it starts a partial prefill
            budget.num_partial_prefills += 1
            budget.num_long_partial_prefills += self._is_long(remaining)
