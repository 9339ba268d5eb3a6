"""Static (request-level) batching: the baseline continuous batching replaces.

The thesis' Baseline 1 [Kwon 2025, §3.6.1]: FasterTransformer behind a dynamic batcher such as
Triton's — take up to B of the earliest requests, run them as ONE padded batch until the
last of them finishes, only then take the next batch. B is as large as memory allows when
every request reserves a contiguous max_model_len of K/V (no paging).

Two wastes continuous batching removes ([vLLM 2.0 part 2, §8.3]; [Kwon 2025, §3.2.3]):
  * queueing: a request arriving just after a batch started waits for the whole batch;
  * padding: prompts are padded to the longest in the batch, and a finished request keeps
    its row (computing padding) until the slowest one is done.
The padding shows up in the cost: `padded_work` reports the [B, max_len] rectangle the
forward pass really computes, not the useful tokens. (Finished requests are reported as
soon as their own last token exists — generous to the baseline: a real static server
returns the whole batch at the end.)

Same interface as `Scheduler` (add_request / schedule / update_from_output / ...), so the
simulator drives both unchanged.
"""
from __future__ import annotations

from collections import deque

from scheduler.output import CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.utils import check_stop


class StaticBatchScheduler:
    kv_cache_manager = None     # contiguous per-request reservation: no block manager

    def __init__(self, max_batch_size: int, max_model_len: int, kv_capacity_tokens: int) -> None:
        self.max_model_len = max_model_len
        # Every request reserves max_model_len slots, so memory caps the batch too.
        self.batch_size = min(max_batch_size, kv_capacity_tokens // max_model_len)
        if self.batch_size < 1:
            raise ValueError(f"a KV capacity of {kv_capacity_tokens} tokens cannot hold one request of "
                             f"max_model_len={max_model_len}")
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.batch: list[Request] = []         # the rows of the running batch, finished ones included
        self._padded_len = 0                   # prompt length the batch is padded to
        self._steps_in_batch = 0
        self.finished_req_ids: set[str] = set()

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id}: no room to generate within max_model_len")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        new_reqs, cached = [], CachedRequestData()
        num_scheduled_tokens: dict[str, int] = {}
        ### BEGIN SOLUTION
        if not self.batch:
            # Form a new batch from the earliest arrivals; it prefills all prompts at once.
            while self.waiting and len(self.batch) < self.batch_size:
                self.batch.append(self.waiting.popleft())
            self._padded_len = max((r.num_prompt_tokens for r in self.batch), default=0)
            self._steps_in_batch = 0
            for r in self.batch:
                r.status = RequestStatus.RUNNING
                new_reqs.append(NewRequestData.from_request(r, []))
                num_scheduled_tokens[r.request_id] = r.num_tokens
        else:
            for r in self.batch:
                if not r.is_finished:
                    cached.req_ids.append(r.request_id)
                    cached.resumed_from_preemption.append(False)
                    cached.new_block_ids.append([])
                    cached.num_computed_tokens.append(r.num_computed_tokens)
                    num_scheduled_tokens[r.request_id] = 1
        ### END SOLUTION
        self._steps_in_batch += 1
        for rid, n in num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        output = SchedulerOutput(new_reqs, cached, num_scheduled_tokens, sum(num_scheduled_tokens.values()),
                                 finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        return output

    def padded_work(self, output: SchedulerOutput) -> tuple[int, int]:
        """(tokens, context tokens) of the padded [B, L] forward pass of this step."""
        rows = len(self.batch)
        if self._steps_in_batch == 1:                        # prefill, padded to the longest prompt
            return rows * self._padded_len, rows * self._padded_len
        seq_len = self._padded_len + self._steps_in_batch - 1
        return rows, rows * seq_len                          # one token per row, finished rows too

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue
            tokens = model_runner_output.sampled_token_ids[model_runner_output.req_id_to_index[req_id]]
            generated = []
            for token_id in tokens:
                request.append_output_token_ids(token_id)
                generated.append(token_id)
                if check_stop(request, self.max_model_len):
                    break
            if request.is_finished:
                del self.requests[req_id]
                self.finished_req_ids.add(req_id)
            if generated or request.is_finished:
                outputs.append(EngineCoreOutput(req_id, generated, request.get_finished_reason(), request.stop_reason))
        if self.batch and all(r.is_finished for r in self.batch):
            self.batch = []                                   # only now may the next batch start
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        return sum(not r.is_finished for r in self.batch), len(self.waiting)
