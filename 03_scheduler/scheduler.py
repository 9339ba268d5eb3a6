"""The continuous-batching scheduler: every step, decide how many tokens of which requests
go through the model, under a token budget and the KV cache's capacity.

Mirrors vLLM's `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule`,
`update_from_output`, `_preempt_request`, `finish_requests`, `add_request`.

Why iteration-level (continuous) batching ([Yu 2022], [Kwon 2025, §3.2.3]): requests arrive at
different times and generate different numbers of tokens. A static batch makes early arrivals
wait for the batch to fill and finished requests wait for the slowest; here a request joins the
batch at the next step after it arrives and leaves it the step it finishes.

One step of `schedule()` ([Kwon 2025, Algorithm 1] with vLLM's two phases):
  1. RUNNING requests, in order: each gets Δ = its remaining tokens, if the budget allows.
     When the KV cache has no block for it, preempt the lowest-priority running request
     (the latest arrival under FCFS), all-or-nothing, until it fits — or until the request
     preempted itself.
  2. WAITING requests, in the policy's order, while budget and `max_num_seqs` allow and
     nothing was preempted this step (admitting while evicting would thrash): look up the
     prefix cache, allocate, move to RUNNING. FCFS is strict: when the head does not fit,
     nobody behind it jumps the queue.
  3. `num_computed_tokens += Δ` for every scheduled request right away (so the next step can
     already be planned); `update_from_output` appends the sampled tokens and finishes
     requests that hit a stop condition.

This is the core. Later chapters add to it by overriding its hooks (the methods whose
docstrings say "Hook"), never by editing it: chapter 04 lets speculative tokens ride along,
chapter 05 cuts prompts into chunks, chapter 06 loads K/V computed on other machines, and
chapter 07's engine composes all three (`mini_vllm/engine_scheduler.py`).

Invariants after every step (checked by `check_invariants` in the property tests):
sum(Δ) <= max_num_batched_tokens, len(running) <= max_num_seqs, no request both waiting and
running, 0 <= num_computed_tokens <= num_tokens.
"""
from __future__ import annotations

from typing import ClassVar, Iterable

from kvcache import KVCacheBlocks, KVCacheManager, RequestTooLargeError
from paged_attention import cdiv
from scheduler.config import SchedulerConfig
from scheduler.output import CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.request_queue import create_request_queue
from scheduler.scheduled_step import ScheduledStep, SchedulingBudget
from scheduler.utils import check_stop


class Scheduler:
    splits_prompts: ClassVar[bool] = False      # chapter 05's subclass: may split a prompt across steps
    # Where a request that is neither running nor finished may be (chapter 06 adds one).
    WAITING_STATUSES: ClassVar[tuple[RequestStatus, ...]] = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        if config.enable_chunked_prefill and not self.splits_prompts:
            raise ValueError(f"{type(self).__name__} never splits a prompt, but the config enables chunked prefill; "
                             "use chunked_prefill.ChunkedPrefillScheduler")
        if config.preemption_mode == "swap" and getattr(kv_cache_manager, "cpu_block_pool", None) is None:
            raise ValueError("preemption_mode='swap' needs a KV cache manager with a CPU tier (num_cpu_blocks > 0)")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_size: int = kv_cache_manager.block_size
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        # KV slots reserved beyond the scheduled tokens of a running request (vLLM's name).
        self.num_lookahead_tokens = config.num_lookahead_tokens

        self.requests: dict[str, Request] = {}     # every unfinished request, by id
        self.waiting = create_request_queue(config.policy, self._remaining_tokens, config.staging_size)
        self.running: list[Request] = []           # admission order (the persistent batch's order)
        # Finished since the last schedule(): sent to the runner so it drops their state.
        self.finished_req_ids: set[str] = set()
        # Requests finished INSIDE schedule() (can never fit): reported by the next update_from_output.
        self._ignored_outputs: list[EngineCoreOutput] = []

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

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[str]:
        """Finish requests from outside the scheduler (abort, stop strings found by the
        detokenizer); None: every request. Unknown or already finished ids are ignored. Returns
        those finished."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
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
        """Streaming input ([Kwon 2025, Table 4.1], streaming prefills): more prompt arrives for
        a request that is already queued or running; its new tokens become schedulable next step."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown or finished request {request_id!r}")
        if request.num_tokens + len(token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id}: {request.num_tokens + len(token_ids)} tokens leave no room "
                             f"to generate within max_model_len={self.max_model_len}")
        request.append_prompt_tokens(token_ids, final)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting)."""
        return len(self.running), len(self.waiting)

    def get_known_request_ids(self) -> set[str]:
        """Unfinished requests, and those finished since the last schedule(): the ids whose state a
        model runner may hold (it drops a finished request when the next output says so)."""
        return set(self.requests) | self.finished_req_ids

    # ================================================================== schedule
    def schedule(self) -> SchedulerOutput:
        # NOTE (as in vLLM): there is no prefill phase and no decode phase. Each request has
        # num_computed_tokens and num_tokens; each step the scheduler gives requests tokens so
        # that the first catches up with the second, within the budget.
        step = self._new_step()
        self._schedule_running(step)
        if not step.preempted_reqs:       # admitting while evicting would thrash
            self._schedule_waiting(step)
        output = self._build_output(step)
        self._update_after_schedule(step)
        return output

    # ---- 1. RUNNING requests -------------------------------------------------------------
    def _schedule_running(self, step: ScheduledStep) -> None:
        """Give every running request its Δ, in order, preempting the lowest-priority running
        request (all of its blocks at once) whenever the KV cache has no room."""
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
            self._on_scheduled(request, num_new_tokens, step)
            req_index += 1

    def _allocate_slots(self, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
        """`allocate_slots` for a running request; None when the pool has no room (the caller
        preempts). Hook: chapter 06 first takes back blocks that idle waiting requests hold."""
        return self.kv_cache_manager.allocate_slots(request, num_new_tokens,
                                                    num_lookahead_tokens=self.num_lookahead_tokens)

    # ---- 2. WAITING requests -------------------------------------------------------------
    def _schedule_waiting(self, step: ScheduledStep) -> None:
        """Admit waiting requests in the policy's order while the budget, max_num_seqs and
        the KV cache allow. FCFS is strict: when the head does not fit, nobody behind it
        jumps the queue (only requests that are skipped on purpose are passed over)."""
        ### BEGIN SOLUTION
        skipped: list[Request] = []
        while self.waiting and self._has_room(step):
            request = self.waiting.peek_request()
            outcome = self._try_schedule_waiting(request, step)
            if outcome == "blocked":
                break
            popped = self.waiting.pop_request()
            if outcome == "skipped":
                skipped.append(popped)
        if skipped:
            self.waiting.prepend_requests(skipped)
        ### END SOLUTION

    def _has_room(self, step: ScheduledStep) -> bool:
        return step.budget.token_budget > 0 and len(self.running) < self.max_num_running_reqs

    def _try_schedule_waiting(self, request: Request, step: ScheduledStep) -> str:
        """One waiting request: "admitted", "skipped" (passed over, stays queued), "ignored"
        (finished: can never fit) or "blocked" (it does not fit now: stop here). Hook: chapter 06
        skips requests whose K/V is still on its way."""
        if request.kv_swapped_out:
            return self._try_swap_in(request, step)   # its KV lives on the CPU tier: bring it back
        return self._try_admit(request, step)

    def _try_swap_in(self, request: Request, step: ScheduledStep) -> str:
        """A swapped-out request comes back with its KV copied from the CPU tier."""
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
        self._admit(request, 0, num_new_tokens, step)
        return "admitted"

    def _try_admit(self, request: Request, step: ScheduledStep) -> str:
        """A new or recompute-preempted request: find its already-computed tokens (the prefix
        cache), allocate the rest of this step's Δ, admit."""
        new_computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        if self.kv_cache_manager.num_pending_tokens(request, num_hit):
            # Requests running this step are computing more of its prefix: wait one step and
            # hit them, rather than compute the same K/V twice.
            return "skipped"
        num_new_tokens, outcome = self._allocate_waiting(request, step, num_hit, new_computed_blocks)
        if outcome is not None:
            return outcome
        self._admit(request, num_hit, num_new_tokens, step)
        return "admitted"

    def _allocate_waiting(self, request: Request, step: ScheduledStep, num_hit: int,
                          new_computed_blocks: KVCacheBlocks | None,
                          num_external_tokens: int = 0) -> tuple[int, str | None]:
        """Δ and its KV slots for a waiting request whose first tokens are already computed:
        those it holds (`request.num_computed_tokens`), a prefix-cache hit (`num_hit` tokens in
        `new_computed_blocks`, claimed here) and `num_external_tokens` whose K/V is brought in
        from elsewhere before the forward (chapter 06). Returns (Δ, None) when allocated, or
        (0, "blocked" | "skipped" | "ignored") when the request is not admitted this step."""
        budget = step.budget
        num_computed_tokens = request.num_computed_tokens + num_hit + num_external_tokens
        num_new_tokens = self._num_new_tokens(request, num_computed_tokens, budget)
        if num_new_tokens == 0:
            return 0, "blocked"       # it does not fit this step
        if self._defer_admission(request, num_computed_tokens, num_new_tokens, budget):
            return 0, "skipped"
        # (No lookahead slots yet: a request only uses them once it decodes.)
        try:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_external_tokens + num_new_tokens, num_new_computed_tokens=num_hit,
                new_computed_blocks=new_computed_blocks)
        except RequestTooLargeError as e:
            self._ignore_request(request, str(e))
            return 0, "ignored"
        if new_blocks is None:
            return 0, "blocked"       # no room in the KV cache; the running requests will free some
        return num_new_tokens, None

    def _admit(self, request: Request, num_new_computed_tokens: int, num_new_tokens: int,
               step: ScheduledStep) -> None:
        """WAITING / PREEMPTED -> RUNNING with `num_new_computed_tokens` more tokens counted as
        computed (a prefix-cache hit) and Δ = num_new_tokens this step."""
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        if request.num_cached_tokens < 0:               # first admission: what it did not compute
            request.num_cached_tokens = num_computed_tokens
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
    def _build_output(self, step: ScheduledStep) -> SchedulerOutput:
        """The step as the model runner sees it (counters as they were BEFORE this step).
        Hook: chapters 04 and 06 add their parts of the output."""
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
            preempted_req_ids={r.request_id for r in step.preempted_reqs},
            finished_req_ids=self.finished_req_ids,
            blocks_to_swap_out=step.blocks_to_swap_out,
            blocks_to_swap_in=step.blocks_to_swap_in,
        )
        self.finished_req_ids = set()
        return output

    def _update_after_schedule(self, step: ScheduledStep) -> None:
        """Advance now (vLLM's name): the next step can be planned before this one has run.
        update_from_output corrects what the model did not keep."""
        for req_id, n in step.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n

    # ================================================================== hooks
    def _new_step(self) -> ScheduledStep:
        """Hook: a later chapter's step may carry more (chapter 04's carries speculative tokens)."""
        return ScheduledStep(budget=self._new_budget())

    def _new_budget(self) -> SchedulingBudget:
        return SchedulingBudget(token_budget=self.max_num_scheduled_tokens)

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: SchedulingBudget) -> int:
        """Δ for this step, given what is already computed; 0 = not this step.

        This chapter never splits: the request's known tokens go in whole or not at all.
        Hook: chapter 05 cuts chunks, chapter 04 adds speculative tokens."""
        ### BEGIN SOLUTION
        num_new_tokens = request.num_tokens - num_computed_tokens
        if num_new_tokens <= 0 or num_new_tokens > budget.token_budget:
            return 0
        return num_new_tokens
        ### END SOLUTION

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

    def _on_scheduled(self, request: Request, num_new_tokens: int, step: ScheduledStep) -> None:
        """Hook: a running request got its Δ this step (chapter 04 records what rides along)."""

    def _on_preempted(self, request: Request) -> None:
        """Hook: a running request was preempted (chapter 04 forgets what it proposed for it)."""

    def _num_rejected_tokens(self, request: Request, scheduler_output: SchedulerOutput, sampled: list[int]) -> int:
        """Hook: of the positions scheduled for `request`, how many the model did not keep (their
        K/V is not part of the sequence). Here one token is sampled at the end of Δ and nothing
        is rejected; chapter 04 counts the speculative tokens the target rejected."""
        if len(sampled) > 1:
            raise ValueError(f"request {request.request_id}: {len(sampled)} sampled tokens for one position")
        return 0

    def _max_num_computed_tokens(self, request: Request, in_flight: SchedulerOutput | None) -> int:
        """Hook: the invariant's bound on num_computed_tokens (chapter 04 adds what rides along)."""
        return request.num_tokens

    def _select_victim(self) -> Request:
        """Who is preempted when the KV cache is full: the lowest priority, i.e. the latest
        arrival under FCFS ([Kwon 2025, §3.4.5]: "the latest requests are preempted first");
        under the priority policy the largest (priority, arrival_time). Ties: the later admitted."""
        return max(reversed(self.running), key=self._preemption_rank)

    def _preemption_rank(self, request: Request) -> tuple:
        """Higher = given up first when the KV cache is full."""
        if self.config.policy == "priority":
            return request.priority, request.arrival_time
        return (request.arrival_time,)

    def _remaining_tokens(self, request: Request) -> int:
        """SRTF's key for a waiting request: tokens it still has to compute, counting a
        prefix-cache hit it would get right now ([Kwon 2025, Algorithm 2, line 5])."""
        if request.num_computed_tokens > 0 or request.kv_swapped_out:
            return request.num_tokens - request.num_computed_tokens
        _, num_cached = self.kv_cache_manager.get_computed_blocks(request)
        return request.num_tokens - num_cached

    # ================================================================== preemption
    def _preempt_request(self, request: Request) -> list[tuple[int, int]]:
        """RUNNING -> PREEMPTED, back to the front of the waiting queue. Returns the
        (device, cpu) block pairs to copy if its KV was swapped out instead of dropped.

        recompute ([Kwon 2025, Table 4.1]: num_computed_tokens <- 0): free the blocks; when
        resumed, prompt AND generated tokens are recomputed in one prefill-like step, and blocks
        that are still in the prefix cache come back for free.
        swap ([Kwon 2025, §3.4.5]): move the blocks to the CPU tier; num_computed_tokens is kept."""
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
        request.num_preemptions += 1
        self._on_preempted(request)
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
        """After the forward pass: fail the requests the runner could not run, register the
        blocks whose K/V is now written in the prefix cache, append the sampled tokens, check
        stop conditions, free finished requests. Returns one output per request that produced
        tokens or finished."""
        outputs, self._ignored_outputs = self._ignored_outputs, []
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        failed = model_runner_output.failed
        stopped_running: set[int] = set()
        # Looked up once, not per request: this loop runs for every scheduled request every step,
        # host time a GPU waits for at large batches.
        requests, cache_blocks = self.requests, self.kv_cache_manager.cache_blocks
        max_model_len = self.max_model_len
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or RequestStatus.is_finished(request.status):
                continue     # aborted while the model was running: drop its tokens
            if failed and req_id in failed:
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
                # Positions the model ran but did not keep are not part of the sequence.
                request.num_computed_tokens -= self._num_rejected_tokens(request, scheduler_output, generated)
                if request.num_computed_tokens < request.num_tokens:
                    raise ValueError(f"request {req_id}: a token was sampled for a partial prefill "
                                     f"({request.num_computed_tokens} of {request.num_tokens} tokens computed)")
                if request.streaming_input:
                    generated = []    # the input is still open: those logits belong to an unfinished prompt
            # The forward pass wrote the K/V of every computed token: full blocks may now be hit.
            cache_blocks(request, request.num_computed_tokens)
            stopped = False
            for n, token_id in enumerate(generated, 1):
                request.append_output_token_ids(token_id)
                if check_stop(request, max_model_len):
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
        return outputs

    # ================================================================== freeing
    def _owns_kv(self, request: Request) -> bool:
        """Does the KV manager hold blocks for this unfinished request (device or CPU)?"""
        return request.status == RequestStatus.RUNNING or request.kv_swapped_out

    def _free_request(self, request: Request, finished_status: RequestStatus, owns_kv: bool,
                      message: str | None = None) -> None:
        """The one place a request leaves the scheduler: free its KV exactly once (device or
        CPU tier), and let the manager forget its block hashes (kept across preemptions)."""
        request.status = finished_status
        if message is not None:
            request.stop_reason = message
        self._free_kv(request, owns_kv)
        request.kv_swapped_out = False
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _free_kv(self, request: Request, owns_kv: bool) -> None:
        """Hook: chapter 06 may keep a finished request's blocks until another machine has read them."""
        if owns_kv:
            self.kv_cache_manager.free(request)
        self.kv_cache_manager.free_block_hashes(request)

    # ================================================================== invariants
    def check_invariants(self, in_flight: SchedulerOutput | None = None) -> None:
        """Raise AssertionError if the queues/counters are inconsistent (used by tests).
        Between schedule() and update_from_output() pass the step's output (a later chapter
        counts what it scheduled beyond num_tokens as computed until the model answers)."""
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
            assert request.status in self.WAITING_STATUSES, request
        for request in self.requests.values():
            assert 0 <= request.num_computed_tokens <= self._max_num_computed_tokens(request, in_flight), request
            assert request.num_tokens < self.max_model_len, request
