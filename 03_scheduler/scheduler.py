"""The continuous-batching scheduler: every step, decide how many tokens of which requests
go through the model, under a token budget and the KV cache's capacity.

Mirrors vLLM's `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule`,
`update_from_output`, `_preempt_request`, `finish_requests`, `add_request`.

Why iteration-level (continuous) batching (Orca, thesis §3.2.3): requests arrive at different
times and generate different numbers of tokens. A static batch makes early arrivals wait for
the batch to fill and finished requests wait for the slowest; here a request joins the batch
at the next step after it arrives and leaves it the step it finishes.

One step of `schedule()` (thesis Algorithm 1 with vLLM's two phases):
  1. RUNNING requests, in order: each gets Δ = its remaining tokens (+ drafts), if the
     budget allows. When the KV cache has no block for it, preempt the lowest-priority
     running request (the latest arrival under FCFS), all-or-nothing, until it fits — or
     until the request preempted itself.
  2. WAITING requests, in the policy's order, while budget and `max_num_seqs` allow and
     nothing was preempted this step (admitting while evicting would thrash): look up the
     prefix cache, allocate, move to RUNNING. FCFS is strict: when the head does not fit,
     nobody behind it jumps the queue.
  3. `num_computed_tokens += Δ` for every scheduled request right away (so the next step can
     already be planned); `update_from_output` appends the sampled tokens, rolls back rejected
     drafts, and finishes requests that hit a stop condition.

Invariants after every step (checked by `check_invariants` in the property tests):
sum(Δ) <= max_num_batched_tokens, len(running) <= max_num_seqs, no request both waiting and
running, 0 <= num_computed_tokens <= num_tokens_with_spec.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Iterable

from kvcache import KVCacheBlocks, KVCacheManager, RequestTooLargeError
from kvcache.kv_cache_manager import cdiv
from scheduler.config import SchedulerConfig
from scheduler.kv_connector import KVConnector
from scheduler.output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                              SchedulerOutput)
from scheduler.request import Request, RequestStatus
from scheduler.request_queue import create_request_queue


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
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
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
        self.spec_decode_tokens.pop(request.request_id, None)
        self.running_reqs.remove(request)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Did the token just appended end the request? Sets the finished status. (vLLM:
    `vllm/v1/core/sched/utils.py:check_stop`.) EOS and stop tokens are reported as "stop",
    max_tokens / max_model_len as "length"."""
    last_token_id = request.output_token_ids[-1]
    if not request.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def _connector_fault(error: Exception) -> str:
    return f"the KV connector failed on this request's remote KV: {type(error).__name__}: {error}"


class Scheduler:
    # Chapter 05's subclass sets this: only it may split a prompt across steps.
    splits_prompts: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, *,
                 connector: KVConnector | None = None) -> None:
        if config.enable_chunked_prefill and not self.splits_prompts:
            raise ValueError(f"{type(self).__name__} never splits a prompt, but the config enables chunked prefill; "
                             "use chunked_prefill.ChunkedPrefillScheduler")
        if config.preemption_mode == "swap" and getattr(kv_cache_manager, "cpu_block_pool", None) is None:
            raise ValueError("preemption_mode='swap' needs a KV cache manager with a CPU tier (num_cpu_blocks > 0)")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_size: int = kv_cache_manager.block_size
        self.connector = connector
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.num_lookahead_tokens = config.num_lookahead_tokens

        self.requests: dict[str, Request] = {}     # every unfinished request, by id
        self.waiting = create_request_queue(config.policy, self._remaining_tokens, config.staging_size)
        self.running: list[Request] = []           # admission order (the persistent batch's order)
        # Finished since the last schedule(): sent to the runner so it drops their state.
        self.finished_req_ids: set[str] = set()
        # Requests finished INSIDE schedule() (can never fit): reported by the next update_from_output.
        self._ignored_outputs: list[EngineCoreOutput] = []
        # KV connector: requests whose remote KV finished loading (reported by the model runner),
        # and finished requests whose blocks a connector is still sending (freed when it is done).
        self.finished_recving_kv_req_ids: set[str] = set()
        self._delayed_free: dict[str, Request] = {}

    # ================================================================== public API
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id} was already scheduled somewhere "
                             f"({request.status.name}, num_computed_tokens={request.num_computed_tokens})")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id}: {request.num_tokens} tokens leave no room to generate "
                             f"within max_model_len={self.max_model_len}")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> bool:
        """Abort one request (client went away). Returns False if it was unknown/finished."""
        return bool(self.finish_requests(request_id, RequestStatus.FINISHED_ABORTED))

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> list[str]:
        """Finish requests from outside the scheduler (abort, stop strings found by the
        detokenizer). Unknown or already finished ids are ignored. Returns those finished."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        for req_id in dict.fromkeys(request_ids):     # de-duplicated, order kept
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                finished.append(request)
        running = {id(r) for r in finished if r.status == RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        self.waiting.remove_requests([r for r in finished if r.status != RequestStatus.RUNNING])
        for request in finished:
            self._free_request(request, finished_status, self._owns_kv(request))
        return [r.request_id for r in finished]

    def add_prompt_tokens(self, request_id: str, token_ids: list[int], final: bool) -> None:
        """Streaming input (Table 4.1, streaming prefills): more prompt arrives for a request
        that is already queued or running; its new tokens become schedulable next step."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown or finished request {request_id!r}")
        if request.num_tokens + len(token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id}: {request.num_tokens + len(token_ids)} tokens leave no room "
                             f"to generate within max_model_len={self.max_model_len}")
        request.append_prompt_tokens(token_ids, final)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Speculative decoding (chapter 04): drafts proposed for the next step."""
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue     # finished or preempted in the meantime: drafts are stale
            if request.num_computed_tokens < request.num_tokens - 1:
                continue     # still prefilling: no drafts (vLLM ignores them for prefill chunks)
            if request.streaming_input:
                continue     # its input is still open: nothing it samples is output yet
            request.spec_token_ids = list(drafts)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting)."""
        return len(self.running), len(self.waiting)

    # ================================================================== schedule
    def schedule(self) -> SchedulerOutput:
        # NOTE (as in vLLM): there is no prefill phase and no decode phase. Each request has
        # num_computed_tokens and num_tokens_with_spec; each step the scheduler gives requests
        # tokens so that the first catches up with the second, within the budget.
        step = ScheduledStep(budget=self._new_budget())
        self._schedule_running(step)
        if not step.preempted_reqs:       # admitting while evicting would thrash
            self._schedule_waiting(step)
        return self._make_output(step)

    # ---- 1. RUNNING requests -------------------------------------------------------------
    def _schedule_running(self, step: ScheduledStep) -> None:
        """Give every running request its Δ, in order, preempting the lowest-priority running
        request (all of its blocks at once) whenever the KV cache has no room. (`_allocate_slots`
        says when that is: it first takes back blocks that idle waiting requests hold.)"""
        req_index = 0
        while req_index < len(self.running) and step.budget.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, step.budget)
            if num_new_tokens == 0:
                # Nothing to do now (e.g. streaming input caught up, or no budget for a whole
                # chunk). `continue`, not `break`: later requests may still fit.
                req_index += 1
                continue
            ### BEGIN SOLUTION
            while True:
                try:
                    new_blocks = self._allocate_slots(request, num_new_tokens)
                except RequestTooLargeError as e:     # raised before any change, and before any preemption
                    new_blocks = e
                    break
                if new_blocks is not None:
                    break
                # Out of KV blocks: preempt the lowest-priority running request.
                victim = self._select_victim()
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                if victim_index < req_index:      # it was handled earlier in this loop
                    req_index -= 1
                if victim.request_id in step.num_scheduled_tokens:   # ... and scheduled: take it back
                    step.take_back(victim)
                step.blocks_to_swap_out += self._preempt_request(victim)
                step.preempted_reqs.append(victim)
                if victim is request:             # nothing lower left to preempt
                    break
            if new_blocks is None:
                break
            ### END SOLUTION
            if isinstance(new_blocks, RequestTooLargeError):
                # Even alone in the cache it would not fit: fail it with the reason, never loop on it.
                self.running.pop(req_index)
                self._ignore_request(request, str(new_blocks))
                continue
            step.add(request, num_new_tokens, new_blocks.get_block_ids(), step.running_reqs)
            self._schedule_drafts(request, num_new_tokens, step)
            req_index += 1

    def _schedule_drafts(self, request: Request, num_new_tokens: int, step: ScheduledStep) -> None:
        """Speculative drafts that ride along in Δ (chapter 04); they are used once."""
        if request.spec_token_ids:
            num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
            if num_spec > 0:
                step.spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []

    # ---- 2. WAITING requests -------------------------------------------------------------
    def _schedule_waiting(self, step: ScheduledStep) -> None:
        """Admit waiting requests in the policy's order while the budget, max_num_seqs and
        the KV cache allow. FCFS is strict: when the head does not fit, nobody behind it
        jumps the queue (only requests that are skipped on purpose are passed over)."""
        # Requests whose remote KV has landed go first: they already hold their blocks, and
        # idle blocks behind a head that needs them would deadlock the queue.
        if self.finished_recving_kv_req_ids:
            for request in [r for r in self.waiting if r.request_id in self.finished_recving_kv_req_ids]:
                if not self._has_room(step):
                    break
                if self._try_admit(request, step) in ("admitted", "ignored"):
                    self.waiting.remove_request(request)
        ### BEGIN SOLUTION
        skipped: list[Request] = []
        while self.waiting and self._has_room(step):
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                outcome = "skipped"                          # remote KV still loading
            elif request.kv_swapped_out:
                outcome = self._try_swap_in(request, step)   # KV lives on the CPU tier: bring it back
            else:
                outcome = self._try_admit(request, step)
            if outcome == "blocked":
                break
            popped = self.waiting.pop_request()
            if outcome == "skipped":
                skipped.append(popped)
        if skipped:
            self.waiting.prepend_requests(skipped)
        ### END SOLUTION
        if not step.num_scheduled_tokens and not self.running and self.waiting:
            self._release_idle_remote_blocks()

    def _has_room(self, step: ScheduledStep) -> bool:
        return step.budget.token_budget > 0 and len(self.running) < self.max_num_running_reqs

    def _allocate_slots(self, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
        """`allocate_slots` for a running request. When the pool is full, the lowest-ranked of
        the running requests and the idle holders (waiting requests whose remote KV has landed
        in their blocks) gives its blocks up: a holder ranked at or below the running victim is
        released here (its KV dropped, it recomputes) and the allocation retried; None when
        the victim is a running request, which the caller then preempts.

        Why holders count: a waiting request that cannot be admitted yet (max_num_seqs, the
        budget, a partial-prefill limit) keeps its loaded blocks and makes no progress. Left
        out of the choice, they livelock the pool — found by the chunked-prefill property
        test: with one long partial prefill allowed, the one running request grew until no
        block was free, preempted itself, the next did the same, and so on forever, while
        deferred holders kept a third of the pool."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks
            victim_rank = self._preemption_rank(self._select_victim())
            holders = [r for r in self.waiting if r.request_id in self.finished_recving_kv_req_ids
                       and self._preemption_rank(r) >= victim_rank]
            if not holders:
                return None
            self._drop_loaded_kv(max(reversed(holders), key=self._preemption_rank))

    def _release_idle_remote_blocks(self) -> None:
        """Nothing runs, nothing could be admitted, and waiting requests hold device blocks
        their remote KV was loaded into (WAITING_FOR_REMOTE_KVS, load finished): no one will
        ever free a block for the head of the queue. Drop the loaded KV of the last such
        request (it recomputes) so the queue moves. (With requests running, `_allocate_slots`
        makes the same choice when the pool is full.) Loads still in flight are never
        touched: the connector is writing their blocks."""
        holders = [r for r in self.waiting if r.request_id in self.finished_recving_kv_req_ids]
        if holders:
            self._drop_loaded_kv(holders[-1])

    def _drop_loaded_kv(self, request: Request) -> None:
        """An idle holder gives its blocks back and starts over (as after a recompute preemption)."""
        self.kv_cache_manager.free(request)
        self.finished_recving_kv_req_ids.discard(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING

    def _try_swap_in(self, request: Request, step: ScheduledStep) -> str:
        """A swapped-out request comes back with its KV copied from the CPU tier.
        Returns "admitted", "skipped" (deferred by a policy), "ignored" or "blocked"."""
        budget = step.budget
        num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, budget)
        if num_new_tokens == 0:
            return "blocked"
        needed = cdiv(request.num_computed_tokens + num_new_tokens + self.num_lookahead_tokens, self.block_size)
        if needed > self.kv_cache_manager.num_blocks:
            self._ignore_request(request, f"request {request.request_id} needs {needed} blocks, "
                                          f"the pool has {self.kv_cache_manager.num_blocks}")
            return "ignored"
        if self._defer_admission(request, request.num_computed_tokens, num_new_tokens, budget):
            return "skipped"
        swap_in = self._swap_in(request, num_new_tokens)
        if swap_in is None:
            return "blocked"
        step.blocks_to_swap_in += swap_in
        self._admit(request, request.num_computed_tokens, num_new_tokens, step)
        return "admitted"

    def _try_admit(self, request: Request, step: ScheduledStep) -> str:
        """A new or recompute-preempted request, or one whose remote KV has landed: find its
        already-computed tokens (local prefix cache, then a KV connector), allocate, admit.
        Returns "admitted", "skipped", "ignored" or "blocked" (the caller moves it in the queue)."""
        budget = step.budget
        if request.num_computed_tokens == 0:
            new_computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
            if self.kv_cache_manager.num_pending_tokens(request, num_local):
                # Requests running this step are computing more of its prefix: wait one step and
                # hit them, rather than compute the same K/V twice.
                return "skipped"
            try:
                external = self._external_tokens(request, num_local)
            except Exception as e:        # a fault in THIS request's remote KV: it fails alone
                self._finish_unscheduled(request, RequestStatus.FINISHED_ERROR, _connector_fault(e), owns_kv=False)
                return "ignored"
            if external is None:
                return "skipped"          # the connector cannot tell yet: ask again next step
            num_external, load_kv_async = external
        else:   # remote KV finished loading into blocks the request already owns
            new_computed_blocks, num_local, num_external, load_kv_async = None, 0, 0, False
        num_computed_tokens = request.num_computed_tokens + num_local + num_external

        if load_kv_async:
            num_new_tokens = 0       # nothing to compute until the KV has arrived
        else:
            num_new_tokens = self._num_new_tokens(request, num_computed_tokens, budget)
            if num_new_tokens == 0:
                return "blocked"     # it does not fit this step
            if self._defer_admission(request, num_computed_tokens, num_new_tokens, budget):
                return "skipped"

        # (No lookahead slots yet: a request gets drafts only once it decodes.)
        try:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_external + num_new_tokens, num_new_computed_tokens=num_local,
                new_computed_blocks=new_computed_blocks)
        except RequestTooLargeError as e:
            self._ignore_request(request, str(e))
            return "ignored"
        if new_blocks is None:
            return "blocked"         # no room in the KV cache; the running requests will free some
        if num_external:
            try:
                self.connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_block_ids(request.request_id), num_external)
            except Exception as e:
                self._finish_unscheduled(request, RequestStatus.FINISHED_ERROR, _connector_fault(e), owns_kv=True)
                return "ignored"
        if load_kv_async:
            # It owns its blocks now and waits, in its place in the queue, for the load to land.
            request.num_computed_tokens = num_computed_tokens
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return "skipped"
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        self._admit(request, num_computed_tokens, num_new_tokens, step)
        return "admitted"

    def _external_tokens(self, request: Request, num_local: int) -> tuple[int, bool] | None:
        """(tokens a KV connector can load after the local hit, load asynchronously?), or None
        when the connector cannot tell yet. At least one token is always left to compute: its
        logits are the request's next token (vLLM recomputes the last prompt token the same way)."""
        if self.connector is None:
            return 0, False
        answer = self.connector.get_num_new_matched_tokens(request, num_local)
        if answer[0] is None:
            return None
        num_external, load_kv_async = answer
        if num_external < 0:
            raise ValueError(f"KV connector returned {num_external} external tokens for request {request.request_id}")
        num_external = min(num_external, request.num_tokens - 1 - num_local)
        return num_external, load_kv_async and num_external > 0

    def _admit(self, request: Request, num_computed_tokens: int, num_new_tokens: int, step: ScheduledStep) -> None:
        """WAITING / PREEMPTED / remote KV loaded -> RUNNING with Δ = num_new_tokens this step."""
        self.finished_recving_kv_req_ids.discard(request.request_id)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        request.kv_swapped_out = False
        self._on_admitted(request, num_computed_tokens, num_new_tokens, step.budget)
        # New and resumed requests send their WHOLE block table (the runner has none for them);
        # a request the runner dropped at preemption is resent in full too.
        kind = step.resumed_reqs if request.num_preemptions else step.new_reqs
        step.add(request, num_new_tokens, self.kv_cache_manager.get_block_ids(request.request_id), kind)

    # ---- 3. the output, then advance the counters ------------------------------------------
    def _make_output(self, step: ScheduledStep) -> SchedulerOutput:
        total_num_scheduled_tokens = sum(step.num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs
        cached = CachedRequestData()
        for request, resumed in [(r, False) for r in step.running_reqs] + [(r, True) for r in step.resumed_reqs]:
            cached.req_ids.append(request.request_id)
            cached.resumed_from_preemption.append(resumed)
            cached.new_block_ids.append(step.req_to_new_block_ids[request.request_id])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            if resumed:
                cached.resumed_token_ids[request.request_id] = list(request.all_token_ids)
        output = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(r, step.req_to_new_block_ids[r.request_id])
                                for r in step.new_reqs],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=step.spec_decode_tokens,
            preempted_req_ids={r.request_id for r in step.preempted_reqs},
            finished_req_ids=self.finished_req_ids,
            blocks_to_swap_out=step.blocks_to_swap_out,
            blocks_to_swap_in=step.blocks_to_swap_in,
        )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self.finished_req_ids = set()
        # Advance now (vLLM's _update_after_schedule): the output above carries the values
        # BEFORE this step; update_from_output corrects for rejected drafts.
        for req_id, n in step.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        return output

    # ================================================================== policy hooks
    def _new_budget(self) -> SchedulingBudget:
        return SchedulingBudget(token_budget=self.max_num_scheduled_tokens)

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: SchedulingBudget) -> int:
        """Δ for this step, given what is already computed; 0 = not this step.

        This chapter never splits: the request's known tokens go in whole or not at all.
        Only speculative drafts may be trimmed — to the budget, and so that no position
        reaches max_model_len. Chapter 05 overrides this to cut chunks."""
        ### BEGIN SOLUTION
        num_new_tokens = request.num_tokens - num_computed_tokens
        if num_new_tokens <= 0 or num_new_tokens > budget.token_budget:
            return 0
        if request.spec_token_ids:
            num_new_tokens += self._num_drafts(request, num_new_tokens, budget)
        return num_new_tokens
        ### END SOLUTION

    def _num_drafts(self, request: Request, num_new_tokens: int, budget: SchedulingBudget) -> int:
        """How many speculative drafts ride along with a request whose Δ reaches its last
        known token: as many as the budget leaves, and none at a position >= max_model_len - 1
        (the accepted drafts plus the bonus token must still fit in max_model_len)."""
        return max(0, min(len(request.spec_token_ids), budget.token_budget - num_new_tokens,
                          self.max_model_len - 1 - request.num_tokens))

    def _defer_admission(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                         budget: SchedulingBudget) -> bool:
        """Should this waiting request wait although it fits? (Chapter 05: limits on concurrent
        partial prefills.) A deferred request is skipped, not a blocker: requests behind it
        may still be admitted this step."""
        return False

    def _on_admitted(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                     budget: SchedulingBudget) -> None:
        """Bookkeeping hook when a waiting request starts running with Δ = num_new_tokens
        (chapter 05 counts the partial prefills it starts)."""

    def _select_victim(self) -> Request:
        """Who is preempted when the KV cache is full: the lowest priority, i.e. the latest
        arrival under FCFS (thesis §3.4.5: "the latest requests are preempted first"); under
        the priority policy the largest (priority, arrival_time). Ties: the later admitted."""
        return max(reversed(self.running), key=self._preemption_rank)

    def _preemption_rank(self, request: Request) -> tuple:
        """Higher = given up first when the KV cache is full."""
        if self.config.policy == "priority":
            return request.priority, request.arrival_time
        return (request.arrival_time,)

    def _remaining_tokens(self, request: Request) -> int:
        """SRTF's key for a waiting request: tokens it still has to compute, counting a
        prefix-cache hit it would get right now (thesis Algorithm 2, line 5)."""
        if request.num_computed_tokens > 0 or request.kv_swapped_out:
            return request.num_tokens - request.num_computed_tokens
        _, num_cached = self.kv_cache_manager.get_computed_blocks(request)
        return request.num_tokens - num_cached

    # ================================================================== preemption
    def _preempt_request(self, request: Request) -> list[tuple[int, int]]:
        """RUNNING -> PREEMPTED, back to the front of the waiting queue. Returns the
        (device, cpu) block pairs to copy if its KV was swapped out instead of dropped.

        recompute (Table 4.1: num_computed_tokens <- 0): free the blocks; when resumed, prompt
        AND generated tokens are recomputed in one prefill-like step, and blocks that are still
        in the prefix cache come back for free.
        swap (thesis §3.4.5): move the blocks to the CPU tier; num_computed_tokens is kept."""
        assert request.status == RequestStatus.RUNNING, f"only running requests can be preempted: {request}"
        ### BEGIN SOLUTION
        mapping = None
        if self.config.preemption_mode == "swap":
            try:
                mapping = self.kv_cache_manager.swap_out(request)   # None: the CPU tier is full now
            except RequestTooLargeError:
                mapping = None                                      # ... or can never hold this request
        if mapping is None:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        request.kv_swapped_out = mapping is not None
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.prepend_request(request)
        ### END SOLUTION
        return mapping or []

    def _swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request's blocks back, plus room for its next Δ tokens; None
        (and no state change) if the device does not have the room."""
        needed = cdiv(request.num_computed_tokens + num_new_tokens + self.num_lookahead_tokens, self.block_size)
        if needed > self.kv_cache_manager.num_free_blocks:
            return None
        mapping = self.kv_cache_manager.swap_in(request)
        if mapping is None:
            return None
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)
        assert new_blocks is not None, "room was checked before the swap-in"
        return mapping

    # ================================================================== capacity
    def _ignore_request(self, request: Request, message: str) -> None:
        """Fail a request that can never fit (the KV manager said so: RequestTooLargeError),
        with the reason, instead of preempting everyone or retrying it forever."""
        self._finish_unscheduled(request, RequestStatus.FINISHED_IGNORED, message, self._owns_kv(request))

    def _finish_unscheduled(self, request: Request, status: RequestStatus, message: str, owns_kv: bool) -> None:
        """Finish a request inside schedule() (not scheduled this step) with the reason; its
        output is reported by the next update_from_output."""
        request.stop_reason = message
        self._free_request(request, status, owns_kv)
        self._ignored_outputs.append(EngineCoreOutput(request.request_id, [], request.get_finished_reason(),
                                                      message, max(request.num_cached_tokens, 0)))

    # ================================================================== after the forward pass
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """After the forward pass: fail the requests the runner could not run, roll back
        rejected drafts, register the blocks whose K/V is now written in the prefix cache,
        append the sampled tokens, check stop conditions, free finished requests. Returns one
        output per request that produced tokens or finished."""
        outputs, self._ignored_outputs = self._ignored_outputs, []
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        failed = model_runner_output.failed
        stopped_running: set[int] = set()
        for req_id, num_tokens_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue     # aborted while the model was running: drop its tokens
            if req_id in failed:
                # Its K/V may be half written: freed, never cached. The others go on.
                self._free_request(request, RequestStatus.FINISHED_ERROR, owns_kv=True, message=failed[req_id])
                stopped_running.add(id(request))
                outputs.append(EngineCoreOutput(req_id, [], request.get_finished_reason(), failed[req_id],
                                                max(request.num_cached_tokens, 0)))
                continue
            if req_id not in index:
                raise ValueError(f"the model runner returned nothing for scheduled request {req_id}")
            generated = sampled[index[req_id]]

            ### BEGIN SOLUTION
            if generated:
                drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
                num_drafts = len(drafts) if drafts else 0
                if len(generated) > num_drafts + 1:
                    raise ValueError(f"request {req_id}: {len(generated)} sampled tokens for {num_drafts} drafts")
                # Speculative decoding: num_computed_tokens advanced over every draft; the rejected
                # ones (and their KV) are not part of the sequence.
                request.num_computed_tokens -= num_drafts + 1 - len(generated)
                if request.num_computed_tokens < request.num_tokens:
                    raise ValueError(f"request {req_id}: a token was sampled for a partial prefill "
                                     f"({request.num_computed_tokens} of {request.num_tokens} tokens computed)")
                if request.streaming_input:
                    generated = []    # the input is still open: those logits belong to an unfinished prompt
            # The forward pass wrote the K/V of every computed token: full blocks may now be hit.
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            stopped = False
            for n, token_id in enumerate(generated, 1):
                request.append_output_token_ids(token_id)
                if check_stop(request, self.max_model_len):
                    generated = generated[:n]       # tokens after the stop are dropped
                    stopped = True
                    break
            ### END SOLUTION

            if stopped:    # check_stop set the finished status; it was RUNNING, so it holds blocks
                self._free_request(request, request.status, owns_kv=True)
                stopped_running.add(id(request))
                outputs.append(EngineCoreOutput(req_id, generated, request.get_finished_reason(),
                                                request.stop_reason, max(request.num_cached_tokens, 0)))
            elif generated:
                outputs.append(EngineCoreOutput(req_id, generated, num_cached_tokens=max(request.num_cached_tokens, 0)))
        if stopped_running:
            self.running = [r for r in self.running if id(r) not in stopped_running]
        outputs += self._update_requests_with_invalid_blocks(model_runner_output.invalid_block_ids)
        self.finished_recving_kv_req_ids |= {r for r in model_runner_output.finished_recving if r in self.requests}
        for req_id in model_runner_output.finished_sending:
            self._free_delayed(req_id)
        return outputs

    def _update_requests_with_invalid_blocks(self, invalid_block_ids: set[int]) -> list[EngineCoreOutput]:
        """Asynchronous loads that failed (vLLM: `_update_requests_with_invalid_blocks` under
        `kv_load_failure_policy`). For each request waiting for remote KV that owns an invalid
        block — its K/V there is missing or wrong — either:
          "recompute": num_computed_tokens <- the tokens before its first invalid block (its local
                       prefix hit, for a connector that reports all of a failed load's blocks).
                       With some left, it keeps its blocks and is admitted next step to compute
                       the rest into them; with none, it gives them back and starts over as a new
                       request (finding its local prefix hit again). Nothing is uncached: blocks
                       enter the prefix cache only after a step computed them.
          "fail":      finished with FINISHED_ERROR and the reason; its blocks freed.
        Returns the outputs of failed requests. (Only asynchronous loads are reported here: a
        synchronous one would have fed its step's forward pass wrong K/V already.)"""
        if not invalid_block_ids:
            return []
        outputs: list[EngineCoreOutput] = []
        for request in [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            first_invalid = next((i for i, b in enumerate(block_ids) if b in invalid_block_ids), None)
            if first_invalid is None:
                continue
            ### BEGIN SOLUTION
            if self.connector.kv_load_failure_policy == "fail":
                message = (f"loading remote KV failed (block {block_ids[first_invalid]}) and "
                           "kv_load_failure_policy='fail'")
                self.waiting.remove_request(request)
                self._free_request(request, RequestStatus.FINISHED_ERROR, owns_kv=True, message=message)
                outputs.append(EngineCoreOutput(request.request_id, [], request.get_finished_reason(), message,
                                                max(request.num_cached_tokens, 0)))
                continue
            request.num_computed_tokens = min(request.num_computed_tokens, first_invalid * self.block_size)
            if request.num_computed_tokens > 0:
                # It holds its blocks and has nothing left to wait for: admitted first next step.
                self.finished_recving_kv_req_ids.add(request.request_id)
            else:
                self.kv_cache_manager.free(request)
                self.finished_recving_kv_req_ids.discard(request.request_id)
                request.status = RequestStatus.WAITING
            self.connector.request_load_failed(request)
            ### END SOLUTION
        return outputs

    # ================================================================== freeing
    def _owns_kv(self, request: Request) -> bool:
        """Does the KV manager hold blocks for this unfinished request (device or CPU)?"""
        return (request.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)
                or request.kv_swapped_out)

    def _free_request(self, request: Request, finished_status: RequestStatus, owns_kv: bool,
                      message: str | None = None) -> None:
        """The one place a request leaves the scheduler: free its KV exactly once (device or
        CPU tier), and let the manager forget its block hashes (kept across preemptions).

        A KV connector may still be reading the request's blocks (a prefill node pushing its
        K/V to a decode node): if `request_finished` says so, the blocks are freed only when
        the model runner reports the send finished (vLLM: `finished_sending`)."""
        request.status = finished_status
        if message is not None:
            request.stop_reason = message
        delay_free = False
        if self.connector is not None:     # told of every finished request, holding blocks or not
            on_device = owns_kv and not request.kv_swapped_out
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id) if on_device else []
            delay_free = self.connector.request_finished(request, block_ids) and on_device
        if delay_free:
            self._delayed_free[request.request_id] = request
        elif owns_kv:
            self.kv_cache_manager.free(request)
        if not delay_free:
            self.kv_cache_manager.free_block_hashes(request)
        request.kv_swapped_out = False
        self.finished_recving_kv_req_ids.discard(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _free_delayed(self, req_id: str) -> None:
        request = self._delayed_free.pop(req_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)
            self.kv_cache_manager.free_block_hashes(request)

    # ================================================================== invariants
    def check_invariants(self, in_flight: SchedulerOutput | None = None) -> None:
        """Raise AssertionError if the queues/counters are inconsistent (used by tests).
        Between schedule() and update_from_output() pass the step's output: its scheduled
        drafts are counted as computed until the rejected ones are rolled back."""
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is twice in running"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is twice in waiting"
        assert not set(running_ids) & set(waiting_ids), "a request is both waiting and running"
        assert set(running_ids) | set(waiting_ids) == set(self.requests), "requests lost or leaked from the queues"
        assert len(self.running) <= self.max_num_running_reqs
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, request
            assert not request.kv_swapped_out, request
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                      RequestStatus.WAITING_FOR_REMOTE_KVS), request
        drafts = in_flight.scheduled_spec_decode_tokens if in_flight is not None else {}
        for request in self.requests.values():
            in_flight_drafts = len(drafts.get(request.request_id, ()))
            assert 0 <= request.num_computed_tokens <= request.num_tokens_with_spec + in_flight_drafts, request
            assert request.num_tokens < self.max_model_len, request
