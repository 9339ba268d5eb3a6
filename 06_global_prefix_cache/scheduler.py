"""K/V computed ELSEWHERE in the scheduler: chapter 03's `Scheduler`, asking a KV connector.

Two uses, one mechanism ([Kwon 2025, §4.4.4, Table 4.1]): a global prefix cache (a prefix
computed by another engine) and prefill/decode disaggregation (a whole prompt computed by a
prefill node) are both a prefix-cache hit that lives on another machine:
`num_computed_tokens <- L_local + L_external`.

vLLM: the scheduler-side half of `KVConnectorBase_V1`
(`vllm/distributed/kv_transfer/kv_connector/v1/base.py`: `get_num_new_matched_tokens`,
`update_state_after_alloc`, `build_connector_meta`, `request_finished`) and what
`vllm/v1/core/sched/scheduler.py` does with it: `WAITING_FOR_REMOTE_KVS`, `finished_recving`
/ `finished_sending`, delayed frees, `_update_requests_with_invalid_blocks` under
`kv_load_failure_policy`.

The life of a remote hit:
  1. admission: after the local prefix-cache hit, the connector says how many more tokens exist
     elsewhere; the scheduler allocates their blocks and `update_state_after_alloc` plans the
     load into them. An asynchronous load parks the request in WAITING_FOR_REMOTE_KVS, owning
     its blocks; `build_connector_meta` hands the step's loads and saves to the worker side.
  2. the model runner reports the load in `finished_recving`: the request is admitted first
     next step (it holds blocks) with `num_computed_tokens` already advanced.
  3. a load can FAIL (a dead node, a timeout, bytes that fail their checksum): the runner reports
     the blocks in `invalid_block_ids`; "recompute" rewinds to the first invalid block and the
     request computes the rest itself, "fail" finishes it with an error. Invalid blocks never
     enter the prefix cache (blocks are cached only after a step computed them).
  4. the request finishes: `request_finished` may keep its blocks until another machine has read
     them (`finished_sending` frees them).

At least one token is always left to compute: its logits are the request's next token (vLLM
recomputes the last prompt token the same way).
"""
from __future__ import annotations

from typing import Any

from kvcache import KVCacheBlocks, RequestTooLargeError
from scheduler import (EngineCoreOutput, ModelRunnerOutput, Request, RequestStatus, ScheduledStep, Scheduler,
                       SchedulerOutput)


class KVConnectorBase:
    """What the scheduler asks of a KV connector (the scheduler-side half of vLLM's
    `KVConnectorBase_V1`; `connector_scheduler.ConnectorScheduler` implements it, and
    `connector_worker.ConnectorWorker` is the worker side). Subclasses implement the two
    matching methods; the others default to "nothing to tell the workers", "free the blocks
    now" and "nothing to remember about a failed load"."""

    # What the scheduler does with a request whose asynchronous load failed (vLLM:
    # KVTransferConfig.kv_load_failure_policy): "recompute" or "fail".
    kv_load_failure_policy: str = "recompute"

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens AFTER the local prefix-cache hit (`num_computed_tokens`) can be loaded
        from outside, and whether the load is asynchronous (the request must wait for it).
        None: cannot tell yet (ask again next step). The scheduler caps the answer so that at
        least one token is left to compute."""
        raise NotImplementedError

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request now owns `block_ids` (its whole table, the local hit first); the connector
        plans the load of `num_external_tokens` tokens into them."""
        raise NotImplementedError

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """What the worker-side connector must do this step (loads to start, blocks to save)."""
        return None

    def request_load_failed(self, request: Request) -> None:
        """The worker reported this request's load as failed and the scheduler recomputes it
        (policy "recompute"). From now on `get_num_new_matched_tokens` should answer 0 for it:
        it is asked again if the request is ever reset to zero computed tokens (preemption)."""

    def update_connector_output(self, connector_output: Any) -> None:
        """What the workers reported for a step (chapter 06's KVConnectorOutput), before the
        step's outputs are applied: the connector's own bookkeeping (stats, failures)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """The request finished (told of every finished request, holding blocks or not). True:
        its blocks are still in use by a transfer — being sent to another node, or written by a
        load the workers have not stopped yet: free them only when the workers report the request
        in `finished_sending` / `finished_recving`."""
        return False


class KVConnectorScheduler(Scheduler):
    """Chapter 03's scheduler, with K/V that may come from another machine through `connector`.
    Without a connector (None) it is chapter 03's scheduler: the engine composes this layer always
    and gives it the connector its config names, if any."""

    WAITING_STATUSES = Scheduler.WAITING_STATUSES + (RequestStatus.WAITING_FOR_REMOTE_KVS,)

    def __init__(self, config, kv_cache_manager, *, connector: KVConnectorBase | None = None, **kwargs) -> None:
        super().__init__(config, kv_cache_manager, **kwargs)
        self.connector = connector
        # Requests whose remote KV finished loading (reported by the model runner), and finished
        # requests whose blocks the connector is still sending (freed when it is done).
        self.finished_recving_kv_req_ids: set[str] = set()
        self._delayed_free: dict[str, Request] = {}

    def get_num_waiting_for_remote_kvs(self) -> int:
        """Requests whose K/V transfer is still under way — waiting ones whose K/V is on its way,
        finished ones whose blocks a transfer still holds: the engine may step with nothing to
        compute while they wait, and that is not a stuck scheduler."""
        return sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting) + len(self._delayed_free)

    def has_unfinished_requests(self) -> bool:
        """Finished requests whose blocks a transfer still holds count: the engine steps until the
        workers report them done, and only then are the blocks free."""
        return super().has_unfinished_requests() or bool(self._delayed_free)

    # ================================================================== admission
    def _schedule_waiting(self, step: ScheduledStep) -> None:
        # Requests whose remote KV has landed go first: they already hold their blocks, and
        # idle blocks behind a head that needs them would deadlock the queue.
        for request in [r for r in self.waiting if r.request_id in self.finished_recving_kv_req_ids]:
            if not self._has_room(step):
                break
            if self._try_admit(request, step) in ("admitted", "ignored"):
                self.waiting.remove_request(request)
        super()._schedule_waiting(step)
        if not step.num_scheduled_tokens and not self.running and self.waiting:
            self._release_idle_remote_blocks()

    def _try_schedule_waiting(self, request: Request, step: ScheduledStep) -> str:
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return "skipped"                      # its K/V is still on its way (or landed: admitted above)
        return super()._try_schedule_waiting(request, step)

    def _try_admit(self, request: Request, step: ScheduledStep) -> str:
        """Chapter 03's admission with the connector asked after the local prefix-cache hit: a
        synchronous load is allocated with Δ and admitted now; an asynchronous one is allocated
        alone and the request waits in WAITING_FOR_REMOTE_KVS, owning its blocks."""
        if self.connector is None:
            return super()._try_admit(request, step)
        if request.num_computed_tokens > 0:       # its remote KV landed in blocks it owns
            num_new_tokens, outcome = self._allocate_waiting(request, step, 0, None)
            if outcome is None:
                self._admit(request, 0, num_new_tokens, step)
            return outcome or "admitted"
        new_computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
        if self.kv_cache_manager.num_pending_tokens(request, num_local):
            return "skipped"                      # chapter 03: wait for the prefix being computed
        ### BEGIN SOLUTION
        try:
            external = self._external_tokens(request, num_local)
        except Exception as e:                    # a fault in THIS request's remote KV: it fails alone
            self._finish_unscheduled(request, RequestStatus.FINISHED_ERROR, _connector_fault(e), owns_kv=False)
            return "ignored"
        if external is None:
            return "skipped"                      # the connector cannot tell yet: ask again next step
        num_external, load_kv_async = external
        if not load_kv_async:
            num_new_tokens, outcome = self._allocate_waiting(request, step, num_local, new_computed_blocks,
                                                             num_external)
            if outcome is not None:
                return outcome
        else:
            outcome = self._allocate_for_load(request, num_local, new_computed_blocks, num_external)
            if outcome is not None:
                return outcome
        if num_external:
            try:
                self.connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_block_ids(request.request_id), num_external)
            except Exception as e:
                self._finish_unscheduled(request, RequestStatus.FINISHED_ERROR, _connector_fault(e), owns_kv=True)
                return "ignored"
        if load_kv_async:
            # It owns its blocks now and waits, in its place in the queue, for the load to land.
            request.num_computed_tokens = num_local + num_external
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return "skipped"
        self._admit(request, num_local + num_external, num_new_tokens, step)
        return "admitted"
        ### END SOLUTION

    def _external_tokens(self, request: Request, num_local: int) -> tuple[int, bool] | None:
        """(tokens the connector can load after the local hit, load asynchronously?), or None
        when it cannot tell yet. At least one token is always left to compute; none is loaded
        for a request that must compute all of its tokens (skip_reading_prefix_cache)."""
        if request.skip_reading_prefix_cache:
            return 0, False
        answer = self.connector.get_num_new_matched_tokens(request, num_local)
        if answer[0] is None:
            return None
        num_external, load_kv_async = answer
        if num_external < 0:
            raise ValueError(f"KV connector returned {num_external} external tokens for request {request.request_id}")
        num_external = min(num_external, request.num_tokens - 1 - num_local)
        return num_external, load_kv_async and num_external > 0

    def _allocate_for_load(self, request: Request, num_local: int, new_computed_blocks: KVCacheBlocks,
                           num_external: int) -> str | None:
        """Blocks for the local hit and the tokens to load (nothing to compute until they land).
        None when allocated; otherwise the outcome for the queue."""
        try:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_external, num_new_computed_tokens=num_local, new_computed_blocks=new_computed_blocks)
        except RequestTooLargeError as e:
            self._ignore_request(request, str(e))
            return "ignored"
        return None if new_blocks is not None else "blocked"

    def _admit(self, request: Request, num_new_computed_tokens: int, num_new_tokens: int,
               step: ScheduledStep) -> None:
        self.finished_recving_kv_req_ids.discard(request.request_id)
        super()._admit(request, num_new_computed_tokens, num_new_tokens, step)

    # ================================================================== blocks held by idle requests
    def _allocate_slots(self, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
        """When the pool is full, the lowest-ranked of the running requests and the idle holders
        (waiting requests whose remote KV has landed in their blocks) gives its blocks up: a
        holder ranked at or below the running victim is released here (its KV dropped, it
        recomputes) and the allocation retried; None when the victim is a running request,
        which chapter 03's loop then preempts.

        Why holders count: a waiting request that cannot be admitted yet (max_num_seqs, the
        budget, a partial-prefill limit) keeps its loaded blocks and makes no progress. Left
        out of the choice, they livelock the pool — found by the chunked-prefill property
        test: with one long partial prefill allowed, the one running request grew until no
        block was free, preempted itself, the next did the same, and so on forever, while
        deferred holders kept a third of the pool."""
        while True:
            new_blocks = super()._allocate_slots(request, num_new_tokens)
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
        their remote KV was loaded into: no one will ever free a block for the head of the
        queue. Drop the loaded KV of the last such request (it recomputes) so the queue moves.
        (With requests running, `_allocate_slots` makes the same choice when the pool is full.)
        Loads still in flight are never touched: the connector is writing their blocks."""
        holders = [r for r in self.waiting if r.request_id in self.finished_recving_kv_req_ids]
        if holders:
            self._drop_loaded_kv(holders[-1])

    def _drop_loaded_kv(self, request: Request) -> None:
        """An idle holder gives its blocks back and starts over (as after a recompute preemption)."""
        self.kv_cache_manager.free(request)
        self.finished_recving_kv_req_ids.discard(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING

    # ================================================================== the output
    def _build_output(self, step: ScheduledStep) -> SchedulerOutput:
        output = super()._build_output(step)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    # ================================================================== after the forward pass
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if self.connector is not None and model_runner_output.kv_connector_output is not None:
            self.connector.update_connector_output(model_runner_output.kv_connector_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        outputs += self._update_requests_with_invalid_blocks(model_runner_output.invalid_block_ids)
        self.finished_recving_kv_req_ids |= {r for r in model_runner_output.finished_recving if r in self.requests}
        for req_id in model_runner_output.finished_sending | model_runner_output.finished_recving:
            request = self._delayed_free.pop(req_id, None)
            if request is not None:
                super()._free_kv(request, owns_kv=True)
        return outputs

    def _update_requests_with_invalid_blocks(self, invalid_block_ids: set[int]) -> list[EngineCoreOutput]:
        """Asynchronous loads that failed (vLLM's name, under `kv_load_failure_policy`). For
        each request waiting for remote KV that owns an invalid block — its K/V there is missing
        or wrong — either:
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
        return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS or super()._owns_kv(request)

    def _free_kv(self, request: Request, owns_kv: bool) -> None:
        """The connector is told of every finished request; one whose blocks another machine is
        still reading (a prefill node pushing its K/V) is freed when `finished_sending` says so."""
        self.finished_recving_kv_req_ids.discard(request.request_id)
        if self.connector is None:
            return super()._free_kv(request, owns_kv)
        on_device = owns_kv and not request.kv_swapped_out
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id) if on_device else []
        if self.connector.request_finished(request, block_ids) and on_device:
            self._delayed_free[request.request_id] = request
            return
        super()._free_kv(request, owns_kv)


def _connector_fault(error: Exception) -> str:
    return f"the KV connector failed on this request's remote KV: {type(error).__name__}: {error}"
