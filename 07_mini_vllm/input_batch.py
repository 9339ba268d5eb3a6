"""The model runner's persistent batch: per-request state that survives from step to step.

Mirrors vLLM v1's `vllm/v1/worker/gpu_input_batch.py` (`CachedRequestState`, `InputBatch`:
`add_request`, `remove_request`, `condense`) and the persistent block table of
`vllm/v1/worker/block_table.py` ([Kwon 2025, §4.6.2], "incremental state updates").

Why persistent: from one step to the next almost nothing changes — each running request gains
one token and, every block_size tokens, one block id. Rebuilding the batch from Python lists
every step costs O(total tokens and blocks); keeping it in preallocated arrays and applying the
scheduler's *deltas* costs O(changes). So the runner keeps, per request:

  * `CachedRequestState` (in a dict by request id): prompt, sampled outputs, block ids, sampling
    params and the request's own random generator — kept even while the request is preempted or
    not scheduled, so a seeded request resumes its random stream where it stopped;
  * one ROW of `InputBatch` while it is in the batch: its tokens in `token_ids` [max_reqs,
    max_model_len], its counters, its block table row. Rows are dense (0..num_reqs-1): a removed
    request leaves a hole that `condense()` fills by moving the last rows down, so a step reads
    `[:num_reqs]` slices without gathers.

The arrays are numpy on the CPU (cheap single-element writes, no torch dispatch per write);
one step's input tensors are gathered from them with a few vectorized ops
(`InputBatch.prepare_inputs`; `model_inputs.prepare_inputs` is the same result rebuilt from
Python lists, the readable version the tests compare it with).

Speculative decoding (chapter 04) needs nothing else: a request's drafts for this step are
written into its row right after its last verified token (`set_draft_token_ids`), so the step's
flat batch is `[... t_last, d_1 .. d_k ...]` for it — ordinary input ids and positions whose K/V
is written like any other token's (vLLM: `token_ids_cpu` holds the spec tokens past
`num_tokens_no_spec`). Sampling writes the emitted tokens over them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from paged_attention.metadata import AttentionMetadata

from mini_vllm.async_output import SampledTokens, plan_prev_sampled, scatter_prev_sampled
from mini_vllm.input_staging import InputStaging
from mini_vllm.logits_processors import OutputTokens
from mini_vllm.model_inputs import ModelInputs
from mini_vllm.sampling_params import SamplingParams


_state_serials = itertools.count()


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None          # a seeded request's own stream (sampler.request_generator)
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # prompt_logprobs: one (ids, logprobs, rank) per prompt position after the first, filled as
    # the prompt is computed (chunk by chunk), handed out once when the prompt is complete.
    prompt_logprobs: list[tuple[list[int], list[float], int] | None] | None = None
    prompt_logprobs_sent: bool = False
    # Unique per state object, never reused: a request id that finishes and comes back is a NEW
    # request (new sampling params, new seed), and per-row caches must see the difference.
    serial: int = field(default_factory=lambda: next(_state_serials))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Dense rows 0..num_reqs-1, one per request currently in the batch."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)       # prompt + output
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)                       # valid entries of token_ids
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)                # outputs start there
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)           # k, or -1: not wanted
        self.num_draft_tokens = np.zeros(max_num_reqs, dtype=np.int64)                 # drafts after them, this step
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)                       # valid entries of block_table
        self.req_ids: list[str | None] = []            # row -> request id (None: a hole until condense())
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState | None] = []   # row -> its state (sampling params, generator)
        # Async scheduling (async_output.py): the previous step's sampled tokens, on the device; the
        # rows' placeholder input ids are taken from them. Empty: every input id is on the host.
        self.prev_sampled_token_ids: list[SampledTokens] = []
        # On a GPU: the pinned buffers and event each step's input copies go through (the runner
        # sets it). None: the arrays reach torch without a copy (a CPU) or by plain copies.
        self.staging: InputStaging | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    # ------------------------------------------------------------------ membership
    def add_request(self, state: CachedRequestState) -> int:
        """Give the request a row (the first hole, else a new one) filled from its state."""
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        if state.num_tokens > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has {state.num_tokens} tokens > max_model_len {self.max_model_len}")
        if len(state.block_ids) > self.max_num_blocks_per_req:
            raise ValueError(f"request {state.req_id!r} holds {len(state.block_ids)} blocks > {self.max_num_blocks_per_req}")
        try:
            row = self.req_ids.index(None)
        except ValueError:
            if len(self.req_ids) == self.max_num_reqs:
                raise ValueError(f"the batch is full ({self.max_num_reqs} requests)") from None
            row = len(self.req_ids)
            self.req_ids.append(None)
            self.states.append(None)
        self.req_ids[row], self.states[row] = state.req_id, state
        self.req_id_to_index[state.req_id] = row
        n_prompt, n = len(state.prompt_token_ids), state.num_tokens
        self.token_ids[row, :n_prompt] = state.prompt_token_ids
        self.token_ids[row, n_prompt:n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = n_prompt
        k = state.sampling_params.prompt_logprobs
        self.num_prompt_logprobs[row] = -1 if k is None or state.prompt_logprobs_sent else k
        self.num_draft_tokens[row] = 0
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.num_blocks[row] = len(state.block_ids)
        self.block_table[row, :len(state.block_ids)] = state.block_ids
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Leave a hole at the request's row (filled by condense()). Returns the row, or None."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.req_ids[row], self.states[row] = None, None
        return row

    def condense(self) -> None:
        """Fill holes with the last rows so that rows 0..num_reqs-1 are the batch (vLLM: condense)."""
        ### BEGIN SOLUTION
        # Every hole below num_reqs is matched by an occupied row at or above it: move the last one down.
        last = len(self.req_ids) - 1
        for hole in range(self.num_reqs):
            if self.req_ids[hole] is not None:
                continue
            while self.req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        ### END SOLUTION
        del self.req_ids[self.num_reqs:]
        del self.states[self.num_reqs:]

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        n, nb = self.num_tokens[src] + self.num_draft_tokens[src], self.num_blocks[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for array in (self.num_tokens, self.num_prompt_tokens, self.num_prompt_logprobs, self.num_draft_tokens,
                      self.num_computed_tokens, self.num_blocks):
            array[dst] = array[src]
        self.req_ids[dst], self.states[dst] = req_id, self.states[src]
        self.req_ids[src], self.states[src] = None, None
        self.req_id_to_index[req_id] = dst

    # ------------------------------------------------------------------ per-step deltas
    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        nb = self.num_blocks[row]
        if nb + len(block_ids) > self.max_num_blocks_per_req:
            raise ValueError(f"row {row}: {nb + len(block_ids)} blocks > {self.max_num_blocks_per_req}")
        self.block_table[row, nb:nb + len(block_ids)] = block_ids
        self.num_blocks[row] = nb + len(block_ids)

    def set_draft_token_ids(self, row: int, draft_token_ids: list[int]) -> None:
        """This step's drafts of the request in `row`, right after its verified tokens (they are
        scheduled tokens; they become the request's tokens only if verification accepts them)."""
        n, k = self.num_tokens[row], len(draft_token_ids)
        if n + k > self.max_model_len:
            raise ValueError(f"row {row}: {n} tokens + {k} drafts > max_model_len {self.max_model_len}")
        self.token_ids[row, n:n + k] = draft_token_ids
        self.num_draft_tokens[row] = k

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """`append_token` for many distinct rows at once, one token each (a decode step)."""
        n = self.num_tokens[rows]
        if n.size and int(n.max()) >= self.max_model_len:
            raise IndexError(f"a row already holds max_model_len={self.max_model_len} tokens")
        self.token_ids[rows, n] = token_ids
        self.num_tokens[rows] = n + 1

    def output_tokens(self, rows: np.ndarray, extra: np.ndarray | None = None,
                      device: str | torch.device = "cpu") -> OutputTokens:
        """Each row's output tokens so far (+ its first extra[r] drafts), one padded tensor for the
        penalties, min_tokens and bad words (only built when a request uses them)."""
        ends = self.num_tokens[rows] + (0 if extra is None else extra)
        return OutputTokens.from_token_array(self.token_ids, rows, self.num_prompt_tokens[rows], ends, device)

    # ------------------------------------------------------------------ one step's tensors
    def prepare_inputs(self, num_scheduled: np.ndarray, block_size: int, device: str | torch.device = "cpu",
                       rows: np.ndarray | None = None) -> tuple[ModelInputs, np.ndarray]:
        """The flat ragged batch for rows 0..num_reqs-1 (or only `rows`, in that order), row r
        running num_scheduled[r] >= 1 tokens from its num_computed_tokens on (vLLM:
        GPUModelRunner._prepare_inputs). `rows` is how the runner re-runs part of a step to find
        the one request that makes a forward pass fail.

        Returns (inputs, sample_rows): the rows whose tokens reach the end of what the request
        has this step — only they sample, so logits_indices holds their last token's row only.
        A row with drafts runs up to its last draft and samples (its other logits rows are the
        runner's business: spec_decode.calc_spec_decode_metadata over these last-token rows).
        """
        rows = np.arange(self.num_reqs) if rows is None else np.asarray(rows, dtype=np.int64)
        n = len(rows)
        if num_scheduled.shape != (n,) or n == 0 or num_scheduled.min() < 1:
            raise ValueError(f"need one count >= 1 per row ({n} rows), got {num_scheduled.tolist()}")
        num_tokens = self.num_tokens[rows]                                         # [n]
        ### BEGIN SOLUTION
        cu_num_tokens = np.cumsum(num_scheduled)                                   # [n]
        total = int(cu_num_tokens[-1])
        req_indices = np.repeat(np.arange(n), num_scheduled)                       # [T] batch row of each token
        offsets = np.arange(total) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        computed = self.num_computed_tokens[rows]                                  # [n]
        positions = computed[req_indices] + offsets                                # [T]
        input_ids = self.token_ids.reshape(-1)[rows[req_indices] * self.max_model_len + positions]   # [T]
        seq_lens = computed + num_scheduled                                        # [n] KV length after the step
        sample_rows = np.flatnonzero(seq_lens >= num_tokens)                       # reach the end: sample
        logits_indices = cu_num_tokens[sample_rows] - 1
        ### END SOLUTION
        overrun = np.flatnonzero(seq_lens > num_tokens + self.num_draft_tokens[rows])
        if overrun.size:
            raise RuntimeError(f"scheduled past the tokens the runner has for {[self.req_ids[rows[i]] for i in overrun]}: "
                               "scheduler and runner disagree")
        width = max(1, int(self.num_blocks[rows].max()))
        table = self.block_table[rows, :width]                                     # [n, width] (a copy)
        # Chapter 01's slot mapping (`compute_slot_mapping`: block of the position, times block_size,
        # plus the offset in it), on the host in numpy as vLLM's BlockTable.compute_slot_mapping does:
        # no device ops, and the result travels with the other index arrays.
        slot_mapping = table[req_indices, positions // block_size].astype(np.int64) * block_size + positions % block_size
        query_start_loc = np.zeros(n + 1, dtype=np.int32)
        query_start_loc[1:] = cu_num_tokens
        # Under async scheduling, where the previous step's sampled tokens go (placeholders in
        # input_ids): index arrays that travel with the others.
        plan = plan_prev_sampled(input_ids, rows[req_indices], self.req_ids, self.prev_sampled_token_ids) \
            if self.prev_sampled_token_ids else []
        scatter_parts = [a for _, dst, src in plan for a in (dst, src)]
        # Three host-to-device copies instead of seven: the int64 arrays in one, the int32 ones in
        # another, the block table; each tensor is a view of its copy. On a GPU they go through
        # pinned buffers without waiting for the device (input_staging.py).
        int64_parts = [input_ids, positions, slot_mapping, logits_indices, *scatter_parts]
        int32_parts = [seq_lens, query_start_loc]
        if self.staging is not None:
            int64_views, (seq_lens_t, query_start_loc_t), table_t = self.staging.stage(int64_parts, int32_parts, table)
        else:
            int64 = torch.from_numpy(np.concatenate(int64_parts, dtype=np.int64, casting="same_kind")).to(device)
            int32 = torch.from_numpy(np.concatenate(int32_parts, dtype=np.int32, casting="same_kind")).to(device)
            int64_views = int64.split([len(p) for p in int64_parts])
            seq_lens_t, query_start_loc_t = int32.split((n, n + 1))
            table_t = torch.from_numpy(table).to(device)
        input_ids_t, positions_t, slot_mapping_t, logits_indices_t = int64_views[:4]
        scatter_prev_sampled(input_ids_t, [sampled for sampled, _, _ in plan],
                             list(zip(int64_views[4::2], int64_views[5::2])))
        md = AttentionMetadata(
            slot_mapping=slot_mapping_t, block_tables=table_t,
            seq_lens=seq_lens_t, query_start_loc=query_start_loc_t,
            max_query_len=int(num_scheduled.max()), max_seq_len=int(seq_lens.max()))
        inputs = ModelInputs(input_ids=input_ids_t, positions=positions_t, attn_metadata=md,
                             logits_indices=logits_indices_t)
        return inputs, rows[sample_rows]
