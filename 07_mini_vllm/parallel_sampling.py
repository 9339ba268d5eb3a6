"""Parallel sampling (`SamplingParams.n`): n completions of one prompt on ONE copy of its K/V.

Why: n samples of the same prompt differ only after the prompt. Computing the prompt n times
and storing its K/V n times wastes both; PagedAttention shares it instead ([Kwon 2025, §3.4.4],
the memory-sharing figures): the children's block tables point at the same physical blocks
(reference counts), and the one block they will write differently — the prompt's partly filled
last block — is copied by whichever writes into it first (copy-on-write, chapter 02's
`BlockSpaceManager.fork` / `append_slots`).

How, here (vLLM v0's `SequenceGroup.fork`, with v1's naming of the children, `ParentRequest`):
1. The request runs as one request (its id is child 0) until its prompt is computed.
2. In that step the model runner samples n tokens from the prompt's last logits — child i with
   its own generator (seed + i) — and keeps a state for each new child (`ModelRunner._fork_rows`).
3. `ForkingScheduler.update_from_output` forks children "{i}_{id}": each gets the parent's
   prompt blocks (ref_cnt + 1, nothing copied), its first token, and joins `running`; from then
   on a child is an ordinary request whose writes go through `append_slots`, so the copy of the
   shared partial block is in the step's `blocks_to_copy`, executed before the forward pass.
4. `ParentRequest` gathers the children's outputs into one RequestOutput with n completions.
A child that does not fit in `running` (max_num_seqs) waits like a preempted request; when it is
admitted its prompt's full blocks come back from the prefix cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler import (EngineCoreOutput, Request, RequestStatus, ScheduledStep, Scheduler, SchedulerOutput,
                       check_stop)


def child_request_id(parent_id: str, index: int) -> str:
    """vLLM v1's naming of parallel-sampling children; index 0 is the parent itself."""
    return parent_id if index == 0 else f"{index}_{parent_id}"


class ForkingScheduler(Scheduler):
    """The engine's scheduler layer for parallel sampling (leftmost in the composed class)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sharing: set[str] = set()          # requests whose blocks may be shared: writes copy first
        self._unsent: set[str] = set()           # forked children the runner has not had in its batch
        self._copies: list[tuple[int, int]] = []  # this step's copy-on-write pairs
        self._rewritten: set[str] = set()        # requests whose block table a copy changed this step

    # ---- forking, after the parent's prompt step ------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> list[EngineCoreOutput]:
        forked: list[EngineCoreOutput] = []
        for parent_id, children in getattr(model_runner_output, "forked", {}).items():
            parent = self.requests.get(parent_id)
            if parent is None or parent.is_finished or parent_id in model_runner_output.failed:
                continue
            # Its prompt's full blocks are computed: cache them now, so the children share them
            # as cached blocks (the parent's own update below finds nothing left to cache).
            self.kv_cache_manager.cache_blocks(parent, parent.num_computed_tokens)
            forked += [self._fork(parent, child_id, token) for child_id, token in children]
        return super().update_from_output(scheduler_output, model_runner_output) + forked

    def _fork(self, parent: Request, child_id: str, first_token: int) -> EngineCoreOutput:
        child = Request(child_id, parent.prompt_token_ids, parent.max_tokens, arrival_time=parent.arrival_time,
                        priority=parent.priority, eos_token_id=parent.eos_token_id, ignore_eos=parent.ignore_eos,
                        stop_token_ids=parent.stop_token_ids, cache_salt=parent.cache_salt,
                        sampling_params=parent.sampling_params)
        child.num_cached_tokens = max(parent.num_cached_tokens, 0)
        self.requests[child_id] = child
        if len(self.running) < self.max_num_running_reqs:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv_cache_manager.fork(parent, child)             # the prompt's blocks, ref_cnt + 1
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._sharing |= {parent.request_id, child_id}
        else:                                                     # no room to run: wait, holding nothing
            child.status = RequestStatus.PREEMPTED
            self.waiting.add_request(child)
        self._unsent.add(child_id)
        waiting = child.status == RequestStatus.PREEMPTED
        child.append_output_token_ids(first_token)
        if check_stop(child, self.max_model_len):          # (it sets the finished status)
            if waiting:
                self.waiting.remove_requests([child])
            else:
                self.running.remove(child)
            self._free_request(child, child.status, owns_kv=not waiting)
            return EngineCoreOutput(child_id, [first_token], child.get_finished_reason(), child.stop_reason,
                                    child.num_cached_tokens)
        return EngineCoreOutput(child_id, [first_token], num_cached_tokens=child.num_cached_tokens)

    # ---- copy-on-write, when a sharer writes --------------------------------------------------
    def _allocate_slots(self, request: Request, num_new_tokens: int):
        if request.request_id not in self._sharing:
            return super()._allocate_slots(request, num_new_tokens)
        result = self.kv_cache_manager.append_slots(request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)
        if result is None:
            return None
        new_blocks, copies = result
        if copies:
            self._copies += copies
            self._rewritten.add(request.request_id)
        return new_blocks

    def _build_output(self, step: ScheduledStep) -> SchedulerOutput:
        """A child the runner has never had in its batch, and a request whose block table a copy
        just changed (a block REPLACED, not appended), are sent as resumed requests are: the whole
        block table and the tokens. The step's copy-on-write pairs go out as blocks_to_copy."""
        resend = self._unsent | self._rewritten
        self._rewritten = set()
        for kind in ((step.running_reqs, step.new_reqs) if resend else ()):     # (usually nothing to resend)
            for request in [r for r in kind if r.request_id in resend]:
                kind.remove(request)
                step.resumed_reqs.append(request)
                step.req_to_new_block_ids[request.request_id] = self.kv_cache_manager.get_block_ids(request.request_id)
        for request in step.resumed_reqs:
            self._unsent.discard(request.request_id)
        output = super()._build_output(step)
        output.blocks_to_copy, self._copies = self._copies, []
        return output

    def _free_request(self, request: Request, finished_status: RequestStatus, owns_kv: bool,
                      message: str | None = None) -> None:
        self._sharing.discard(request.request_id)
        self._unsent.discard(request.request_id)
        super()._free_request(request, finished_status, owns_kv, message)


@dataclass
class ParentRequest:
    """The front end's view of an n > 1 request (vLLM v1: vllm/v1/engine/parallel_sampling.py):
    which child ids belong to it, and each child's latest completion until all have finished."""
    request_id: str
    n: int
    completions: dict[int, object] = field(default_factory=dict)      # index -> CompletionOutput
    finished: set[int] = field(default_factory=set)
    first_state: object = None        # child 0's RequestState: the request's metrics and prompt logprobs

    @property
    def child_ids(self) -> list[str]:
        return [child_request_id(self.request_id, i) for i in range(self.n)]

    def index_of(self, child_id: str) -> int:
        return 0 if child_id == self.request_id else int(child_id.split("_", 1)[0])
