"""The scheduler layer that runs beam searches: W beams as W requests whose blocks are re-pointed.

A beam search (`beam_search.py`) is one request to the user and W requests ("slots") to the
scheduler and the model runner. The slots' ids are the search's id and "1_id" ... "{W-1}_id"
(parallel sampling's naming); slot i runs the search's running beam i. One round:

1. Every slot computes its last token; the model runner returns that position's K most likely
   tokens (`ModelRunnerOutput.beam_candidates`) and the slot's sampled token is dropped: a slot
   never appends a token of its own. A slot that has its candidates waits (it has nothing left to
   compute, so the scheduler gives it no tokens) until every slot of its search has them — even
   across steps, if the token budget or a preemption split the round.
2. `BeamSearchState.step` picks the next W beams. Each continues some current beam b:
   - b's first continuation stays in b's slot: one token appended, nothing else changes;
   - b's other continuations take the slots of the beams nobody continued (the pruned ones):
     the pruned slot's blocks are freed, and the slot FORKS b (chapter 02's
     `BlockSpaceManager.fork`: b's blocks, ref_cnt + 1, nothing copied) before its token is
     appended. When b and its fork then write different tokens into their shared, partly filled
     last block, `append_slots` copies that one block ([Kwon 2025, §3.4.4]) — the pair rides in
     the step's blocks_to_copy (parallel sampling's `ForkingScheduler` path).
   Full blocks of dead lineages go back to the pool (and stay in the prefix cache).
3. Every slot whose tokens or block table changed is sent to the runner as a resumed request is
   (its whole token list and block table): the runner's copy of it is rebuilt.
When the search is done, all slots are freed and ONE output — the best hypotheses — goes out
under the search's id (`BeamSearchCoreOutput`).

The first round has a single slot (the prompt); the model runner creates the runner-side state
of slots 1..W-1 when that slot's prompt completes (`ModelRunner._beam_candidates`), so that the
scheduler can send them as resumed requests from then on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler import EngineCoreOutput, Request, RequestStatus, SchedulerOutput

from mini_vllm.beam_search import Beam, BeamSearchSamplingParams, BeamSearchState, Selection
from mini_vllm.parallel_sampling import ForkingScheduler, child_request_id


@dataclass
class BeamSearchCoreOutput(EngineCoreOutput):
    """A finished search: its best hypotheses [(score, Beam)], best first."""
    beams: list[tuple[float, Beam]] = field(default_factory=list)


@dataclass
class _Search:
    request_id: str
    state: BeamSearchState
    slots: list[str]                                  # slots[i] runs state.running[i]
    candidates: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)   # this round's

    @property
    def slot_pool(self) -> list[str]:
        return [child_request_id(self.request_id, i) for i in range(self.state.params.beam_width)]


class BeamSearchScheduler(ForkingScheduler):
    """Beam searches on top of the engine's scheduler (leftmost in the composed class)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._searches: dict[str, _Search] = {}
        self._search_of: dict[str, _Search] = {}      # slot id -> its search
        self._doomed: list[tuple[_Search, RequestStatus, str]] = []   # a slot could never fit

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if isinstance(params, BeamSearchSamplingParams):
            state = BeamSearchState(params.beam_search, request.num_prompt_tokens,
                                    min(request.num_prompt_tokens + params.max_tokens, self.max_model_len),
                                    params.eos_token_ids)
            search = _Search(request.request_id, state, [request.request_id])
            self._searches[request.request_id] = self._search_of[request.request_id] = search
            self._sharing.add(request.request_id)
        super().add_request(request)

    # ---- a round split across steps ----------------------------------------------------------
    def _is_waiting_for_siblings(self, request: Request) -> bool:
        search = self._search_of.get(request.request_id)
        return search is not None and request.request_id in search.candidates

    def _defer_admission(self, request: Request, num_computed_tokens: int, num_new_tokens: int, budget) -> bool:
        """A preempted slot that already has this round's candidates has nothing to compute until
        the round is decided: it stays out, and the slots still missing go in first."""
        return self._is_waiting_for_siblings(request) or super()._defer_admission(
            request, num_computed_tokens, num_new_tokens, budget)

    def schedule(self) -> SchedulerOutput:
        """Slots waiting for their siblings hold blocks and compute nothing. If they hold so many
        that nothing at all can run (a sibling cannot be admitted), preempt them: their candidates
        are kept, and they recompute once the round has given them a next token."""
        output = super().schedule()
        if output.total_num_scheduled_tokens == 0 and self.waiting:
            for request in [r for r in self.running if self._is_waiting_for_siblings(r)]:
                self.running.remove(request)
                output.blocks_to_swap_out += self._preempt_request(request)
                output.preempted_req_ids.add(request.request_id)
        return output

    # ---- 1. candidates in, 2. selection --------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> list[EngineCoreOutput]:
        if not self._searches:                 # no search running: nothing to look at per request
            return super().update_from_output(scheduler_output, model_runner_output)
        outputs = [self._finish_search(search, status, message) for search, status, message in self._doomed
                   if search.request_id in self._searches]
        self._doomed = []
        candidates = getattr(model_runner_output, "beam_candidates", {})
        for slot_id in scheduler_output.num_scheduled_tokens:
            search = self._search_of.get(slot_id)
            if search is None or search.request_id not in self._searches:
                continue
            if slot_id in model_runner_output.failed:          # one slot failed: the whole search does
                outputs.append(self._finish_search(search, RequestStatus.FINISHED_ERROR,
                                                   model_runner_output.failed[slot_id]))
            else:                                              # a slot never takes its sampled token
                model_runner_output.sampled_token_ids[model_runner_output.req_id_to_index[slot_id]] = []
                if slot_id in candidates:                      # (a recomputed slot: the same ones again)
                    search.candidates.setdefault(slot_id, candidates[slot_id])
        outputs += super().update_from_output(scheduler_output, model_runner_output)
        for search in list(self._searches.values()):
            if len(search.candidates) == len(search.slots):
                selection = search.state.step([search.candidates[s] for s in search.slots])
                search.candidates = {}
                if selection.done:
                    outputs.append(self._finish_search(search, RequestStatus.FINISHED_STOPPED))
                else:
                    self._apply(search, selection)
        return outputs

    def _apply(self, search: _Search, selection: Selection) -> None:
        """Re-point the slots at the selected beams (see the module docstring, step 2)."""
        old = [self.requests[s] for s in search.slots]
        sources = [b for b, *_ in selection.next_beams]
        new_slots: list[str | None] = [None] * len(sources)
        for i, b in enumerate(sources):
            if search.slots[b] not in new_slots:
                new_slots[i] = search.slots[b]                 # b's first continuation keeps its slot
        reusable = [s for s in search.slot_pool if s not in new_slots]
        for slot_id in reusable:                               # pruned beams: their blocks go
            if slot_id in self.requests:
                self._release(self.requests[slot_id])
        for i, b in enumerate(sources):
            if new_slots[i] is None:
                new_slots[i] = reusable.pop(0)
                self._fork_slot(old[b], new_slots[i])
        for slot_id, (_, token, _, _) in zip(new_slots, selection.next_beams):
            self.requests[slot_id].append_output_token_ids(token)
            self._unsent.add(slot_id)                          # tokens (and maybe blocks) changed: resend
            self._search_of[slot_id] = search
        search.slots = new_slots

    def _release(self, request: Request) -> None:
        """Free a pruned slot's blocks and take it out of the queues; its id stays with the search
        (the runner keeps its state: the slot comes back as another beam)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove_requests([request])
        self._free_kv(request, self._owns_kv(request))
        del self.requests[request.request_id]

    def _fork_slot(self, source: Request, slot_id: str) -> None:
        """Slot `slot_id` becomes a copy of beam `source` (before the new token): its blocks shared
        if `source` holds device blocks, else recomputed later (a preempted source has none)."""
        slot = Request(slot_id, source.prompt_token_ids, source.max_tokens, arrival_time=source.arrival_time,
                       priority=source.priority, eos_token_id=source.eos_token_id, ignore_eos=source.ignore_eos,
                       stop_token_ids=source.stop_token_ids, cache_salt=source.cache_salt,
                       sampling_params=source.sampling_params)
        slot.append_output_token_ids(list(source.output_token_ids))
        slot.num_cached_tokens = max(source.num_cached_tokens, 0)
        self.requests[slot_id] = slot
        self._sharing.add(slot_id)
        if source.status == RequestStatus.RUNNING and len(self.running) < self.max_num_running_reqs:
            slot.num_computed_tokens = source.num_computed_tokens
            self.kv_cache_manager.fork(source, slot)
            slot.status = RequestStatus.RUNNING
            self.running.append(slot)
        else:
            slot.status = RequestStatus.PREEMPTED
            slot.num_preemptions = 1                            # the runner gets it whole, as resumed
            self.waiting.add_request(slot)

    # ---- the end of a search -----------------------------------------------------------------
    def _finish_search(self, search: _Search, status: RequestStatus, message: str | None = None) -> EngineCoreOutput:
        """Free every slot; the runner forgets every slot id (also those it created but the
        scheduler never used). Returns the search's one output."""
        for slot_id in search.slot_pool:
            request = self.requests.get(slot_id)
            if request is not None:
                if request in self.running:
                    self.running.remove(request)
                else:
                    self.waiting.remove_requests([request])
                self._free_request(request, status, self._owns_kv(request))
            self.finished_req_ids.add(slot_id)
            self._search_of.pop(slot_id, None)
        del self._searches[search.request_id]
        reason = RequestStatus.get_finished_reason(status)
        if status != RequestStatus.FINISHED_STOPPED:
            return EngineCoreOutput(search.request_id, [], reason, message)
        return BeamSearchCoreOutput(search.request_id, [], reason, beams=search.state.result())

    def _finish_unscheduled(self, request: Request, status: RequestStatus, message: str, owns_kv: bool) -> None:
        """A slot that can never fit (RequestTooLargeError) dooms its whole search. The slot goes
        now (the caller is inside schedule(), iterating the queues); the rest of the search is
        finished, with the reason, when the step's output comes back."""
        super()._finish_unscheduled(request, status, message, owns_kv)
        search = self._search_of.get(request.request_id)
        if search is not None:
            self._doomed.append((search, status, message))

    def finish_requests(self, request_ids, finished_status: RequestStatus) -> list[str]:
        """A search's id finishes the whole search (abort): every slot is freed."""
        request_ids = (request_ids,) if isinstance(request_ids, str) else list(request_ids)
        searches = [self._searches[r] for r in request_ids if r in self._searches]
        for search in searches:
            self._finish_search(search, finished_status)
        done = {s.request_id for s in searches}
        return [s.request_id for s in searches] + super().finish_requests(
            [r for r in request_ids if r not in done], finished_status)
