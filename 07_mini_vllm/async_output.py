"""Async scheduling, the model runner's side: sampled tokens that stay on the device.

Mirrors vLLM v1's `AsyncGPUModelRunnerOutput` (`vllm/v1/worker/gpu_model_runner.py`: the sampled
ids' device-to-host copy started non_blocking on a side stream, a CUDA event recorded after it,
`get_output()` waiting on that event) and `InputBatch.prev_sampled_token_ids` (the next step's
input ids of the same requests are taken from that tensor on the device).

Why: with async scheduling (async_scheduler.py) step N+1 is scheduled and prepared while step N
still runs. Its input ids for the requests that sampled in step N are step N's sampled tokens:
reading them back to the host first would make the host wait for step N's forward pass — the very
wait async scheduling removes. So the runner writes a placeholder (`PLACEHOLDER_TOKEN_ID`) where
the token goes in its host-side batch, and `InputBatch.prepare_inputs` scatters the device tensor
into those positions of the input ids. The host copy is only waited for by whoever needs the values:
the engine core when it applies step N's output (`AsyncModelRunnerOutput.get_output`), and the
runner itself when a sampler needs the output tokens (penalties, min_tokens, bad words) or a step
later, when it writes the values into its own state (`ModelRunner._write_back_sampled`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from mini_vllm.sampler import NONFINITE_LOGITS

if TYPE_CHECKING:
    from mini_vllm.input_batch import CachedRequestState

# Where a sampled token's value is not on the host yet (vLLM uses -1 the same way). Never a
# valid token id: an input id that is still a placeholder at the forward pass fails loudly
# (the embedding's index check) instead of computing with a wrong token.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class SampledTokens:
    """One sampling call's tokens (and logprobs): on the device, and their host copy in flight."""
    rows: list[int]                          # batch rows at sampling time (ModelRunnerOutput's order)
    req_ids: list[str]
    states: list[CachedRequestState]         # whose output_token_ids hold the placeholders
    output_index: list[int]                  # where each token goes in its state's output_token_ids
    num_logprobs: list[int | None]           # per row: SamplingParams.logprobs
    token_ids: torch.Tensor                  # [S] int64, on the device: the next step's input ids
    host_token_ids: torch.Tensor             # [S] int64, on the host once `event` has completed
    host_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # [S, 1+k] ids, [S, 1+k], [S]
    host_nonfinite: torch.Tensor | None      # [S] bool: rows whose logits were not finite (their requests fail)
    event: "torch.cuda.Event | None"         # None on a CPU: the copy is done when it returns

    @classmethod
    def copy_to_host(cls, token_ids: torch.Tensor, logprobs, rows: list[int], states: list[CachedRequestState],
                     output_index: list[int], nonfinite: torch.Tensor | None = None) -> "SampledTokens":
        """Start the device-to-host copies (non_blocking into pinned memory on a GPU) and record an
        event after them; nothing here waits for the forward pass."""
        lp = None
        if logprobs is not None:
            lp = tuple(_to_host(t) for t in (logprobs.logprob_token_ids, logprobs.logprobs,
                                             logprobs.selected_token_ranks))
        host = _to_host(token_ids)
        host_nonfinite = _to_host(nonfinite) if nonfinite is not None else None
        event = None
        if token_ids.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return cls(rows, [s.req_id for s in states], states, output_index,
                   [s.sampling_params.logprobs for s in states], token_ids, host, lp, host_nonfinite, event)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def index_of(self) -> dict[str, int]:
        return {req_id: j for j, req_id in enumerate(self.req_ids)}


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class AsyncModelRunnerOutput:
    """A step's ModelRunnerOutput whose sampled rows are still on their way (vLLM's name).
    `get_output()` waits for the host copies and fills them in; it reads nothing of the runner
    (the engine core calls it from its own thread while the runner runs the next step)."""

    def __init__(self, output, sampled: list[SampledTokens]):
        self._output, self._sampled, self._done = output, sampled, False

    def get_output(self):
        if self._done:
            return self._output
        output = self._output
        for sampled in self._sampled:
            sampled.wait()
            tokens = sampled.host_token_ids.tolist()
            failed = sampled.host_nonfinite.tolist() if sampled.host_nonfinite is not None else [False] * len(tokens)
            for row, req_id, token, bad in zip(sampled.rows, sampled.req_ids, tokens, failed):
                if bad:                                   # its token was drawn from neutral logits: not sent
                    output.failed[req_id] = NONFINITE_LOGITS
                else:
                    output.sampled_token_ids[row].append(token)
            if sampled.host_logprobs is not None:
                ids, values, ranks = (t.tolist() for t in sampled.host_logprobs)
                for j, (req_id, k) in enumerate(zip(sampled.req_ids, sampled.num_logprobs)):
                    if k is not None and not failed[j]:
                        output.logprobs[req_id] = [(ids[j][:k + 1], values[j][:k + 1], ranks[j])]
        self._done = True
        return output


def plan_prev_sampled(input_ids: np.ndarray, token_rows: np.ndarray, req_ids: list[str | None],
                      prev: list[SampledTokens]) -> list[tuple[SampledTokens, np.ndarray, np.ndarray]]:
    """Where the previous step's sampled tokens go in this step's input ids: for each sampling call
    with a token in flight for this step, (its SampledTokens, dst [p] positions of placeholders in
    the input ids, src [p] indices into its token_ids). `input_ids` [T] is the host-side copy,
    `token_rows` [T] the batch row of each token, `req_ids` row -> request. Host-side only: the
    index arrays travel to the device with the step's other inputs (input_staging.py).
    Raises if a placeholder has no sampled token (the caller fails that request)."""
    positions = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN_ID)                       # [P]
    if positions.size == 0:
        return []
    owners = [req_ids[r] for r in token_rows[positions].tolist()]
    if len(set(owners)) != len(owners):
        raise RuntimeError(f"more than one token in flight for {owners}: scheduler and runner disagree")
    done = np.zeros(len(owners), dtype=bool)
    plan = []
    for sampled in prev:
        index = sampled.index_of()
        pick = [(i, index[r]) for i, r in enumerate(owners) if r in index]
        if not pick:
            continue
        dst, src = (np.asarray(x, dtype=np.int64) for x in zip(*pick))                 # [p], [p]
        plan.append((sampled, positions[dst], src))
        done[dst] = True
    if not done.all():
        missing = [r for r, d in zip(owners, done) if not d]
        raise RuntimeError(f"no sampled token for the placeholder of {missing}: scheduler and runner disagree")
    return plan


def scatter_prev_sampled(input_ids_t: torch.Tensor, sources: list[SampledTokens],
                         indices: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replace the placeholders in the device tensor `input_ids_t` [T] by the previous step's sampled
    tokens, on the device (vLLM: GPUModelRunner._prepare_input_ids): for each of `sources` (the plan's
    SampledTokens), its (dst [p], src [p]) of `plan_prev_sampled`, already on the device."""
    for sampled, (dst, src) in zip(sources, indices):
        input_ids_t[dst] = sampled.token_ids[src]                                       # [p]


class AsyncOutputMixin:
    """For ModelRunner: a step's sampled tokens stay on the device; placeholders in the host batch."""

    def _init_async_output(self, async_scheduling: bool, tokens_stay_on_device: bool) -> None:
        self.async_scheduling = async_scheduling
        # Sampled tokens left on the device, placeholders in the host batch (else: written at once).
        self.tokens_stay_on_device = async_scheduling and tokens_stay_on_device
        # Each step's sampled tokens, oldest first, until their values are written into the requests'
        # states; the last step's feed the next input ids.
        self._sampled_steps: deque[list[SampledTokens]] = deque()
        self._step_sampled: list[SampledTokens] = []          # the step being run's
        self._failed_last_step: set[str] = set()              # already scheduled again when they failed

    def _execute_async(self, scheduler_output) -> AsyncModelRunnerOutput:
        """One step whose sampled tokens stay on the device: `get_output()` of the result waits for
        their host copy."""
        # Steps before the last are done (the engine core took their outputs): their values go into
        # the states now; the last step's tokens are still the device tensor this step reads.
        self._write_back_sampled(keep_last=True)
        self.input_batch.prev_sampled_token_ids = self._sampled_steps[-1] if self._sampled_steps else []
        self._step_sampled = []
        try:
            output = self._execute_model(scheduler_output)
        finally:
            self._sampled_steps.append(self._step_sampled)
            self.input_batch.prev_sampled_token_ids = []
        self._failed_last_step = set(output.failed)
        return AsyncModelRunnerOutput(output, self._step_sampled)

    def _drop_failed_in_flight(self, so, failed: dict[str, str]) -> None:
        """A request that failed in the previous step was scheduled for this one before the scheduler
        knew; it has no token in flight to compute. Its row goes (the scheduler finished it already
        and drops whatever this step reports for it)."""
        if not self._failed_last_step:
            return
        batch = self.input_batch
        for req_id in self._failed_last_step & so.num_scheduled_tokens.keys():
            if batch.remove_request(req_id) is not None:
                failed[req_id] = "failed in the previous step"
        batch.condense()

    def _record_async(self, result, rows: np.ndarray, nonfinite: torch.Tensor | None) -> None:
        """`_record` without reading the tokens: a placeholder goes where each token belongs (the
        batch row, the state's output list), the tokens and logprobs start their copy to the host,
        and the step's AsyncModelRunnerOutput fills them in when the engine core asks."""
        batch = self.input_batch
        states = [batch.states[i] for i in rows.tolist()]
        batch.append_tokens(rows, np.full(len(rows), PLACEHOLDER_TOKEN_ID, dtype=batch.token_ids.dtype))   # (checks first)
        output_index = []
        for state in states:
            output_index.append(len(state.output_token_ids))
            state.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self._step_sampled.append(SampledTokens.copy_to_host(result.sampled_token_ids, result.logprobs_tensors,
                                                             rows.tolist(), states, output_index, nonfinite))

    def _write_back_sampled(self, keep_last: bool) -> None:
        """Write sampled values over their placeholders, in each request's state and — if it still
        has its row — in the batch; oldest step first, all but the last step with `keep_last`.
        Waits for the host copies (on a GPU: for those steps' forward passes). A request that
        finished, or was re-sent by the scheduler since (its tokens replaced by the truth), is
        skipped."""
        batch = self.input_batch
        while len(self._sampled_steps) > keep_last:
            for sampled in self._sampled_steps.popleft():
                sampled.wait()
                for req_id, state, k, token in zip(sampled.req_ids, sampled.states, sampled.output_index,
                                                   sampled.host_token_ids.tolist()):
                    if (self.requests.get(req_id) is not state or k >= len(state.output_token_ids)
                            or state.output_token_ids[k] != PLACEHOLDER_TOKEN_ID):
                        continue
                    state.output_token_ids[k] = token
                    row = batch.req_id_to_index.get(req_id)
                    if row is not None and batch.states[row] is state:
                        batch.token_ids[row, batch.num_prompt_tokens[row] + k] = token
