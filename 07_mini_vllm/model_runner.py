"""ModelRunner: turns each SchedulerOutput into one forward pass and one sampled token per request.

Mirrors vLLM v1's `vllm/v1/worker/gpu_model_runner.py: GPUModelRunner` — `_update_states`
(apply the scheduler's deltas to the persistent batch), `_prepare_inputs` (the flat ragged
batch), `execute_model` (forward, logits for the sampling rows only, sample),
`profile_run` (a dummy forward at the largest batch, to measure activation memory),
`initialize_kv_cache`, `capture_model` — and the block moves of v0's worker
(`CacheEngine.swap_in/swap_out/copy`, executed before the forward).

One step (the plain path, this file):

    SchedulerOutput ──_update_states──> persistent batch (rows = requests scheduled this step)
        finished / preempted / unscheduled requests leave their row; new and resumed ones get
        one; running ones append their new block ids; num_computed_tokens comes from the scheduler
    blocks_to_swap_out -> blocks_to_swap_in -> blocks_to_copy  (chapter 02's CacheEngine)
    _execute_rows:  input_ids, positions, slot_mapping (chapter 01's compute_slot_mapping),
                    block_tables, seq_lens, query_start_loc -> AttentionMetadata; logits_indices
                    model(...) -> hidden [T, hidden];  compute_logits(hidden[logits_indices]) -> [S, vocab]
                    Sampler -> one token per sampling row, appended to the persistent batch
    -> ModelRunnerOutput(req_ids, sampled_token_ids) for chapter 03's update_from_output

A row samples only when this step's tokens reach the end of what the request has: a prefill chunk
that stops short gets no logits at all (for SmolLM2 the 49152 x 576 vocabulary projection is the
largest matmul of a decode step). A request whose logits are not finite (NaN, +inf, or all -inf)
fails alone: the sampler refuses such rows, the runner samples the others and reports the bad one
in `failed`; a row whose forward pass raises fails alone too (request_isolation.py).

What only some engines do lives beside it, one concern per module, as vLLM v1 splits its runner
into mixins and `spec_decode/` proposers:

    spec_decode_mixin.py      drafts into the batch, verification, the next step's drafts (chapter 04)
    kv_connector_mixin.py     a KV connector's loads before and saves after the forward (chapter 06)
    lora_mixin.py             each token's LoRA adapter, the adapters loaded into slots (chapter 09)
    prompt_logprobs.py        the prompt tokens' logprobs
    pipeline_stages.py        which pipeline stage samples; the tokens the others learn
    async_output.py           async scheduling: sampled tokens that stay on the device
    request_isolation.py      one request never takes the batch down
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from chunked_prefill import build_attention_plan
import kernels_cpu
from kvcache.cache_engine import CacheEngine
from paged_attention import cdiv
from scheduler import ModelRunnerOutput as SchedulerModelRunnerOutput
from scheduler import SchedulerOutput

from mini_vllm.async_output import AsyncModelRunnerOutput, AsyncOutputMixin
from mini_vllm.structured_output_backend import apply_grammar_bitmask
from mini_vllm.config import ModelConfig
from mini_vllm.cuda_graph import CUDAGraphRunner
from mini_vllm.engine_config import EngineConfig
from mini_vllm.hidden_states_tap import HiddenStatesTap
from mini_vllm.input_batch import CachedRequestState, InputBatch
from mini_vllm.input_staging import InputStaging
from mini_vllm.kv_connector_mixin import KVConnectorModelRunnerMixin
from mini_vllm.lora_mixin import LoRAModelRunnerMixin
from mini_vllm.model_inputs import ModelInputs, prepare_inputs
from mini_vllm.models.attention import ATTENTION_BACKENDS
from mini_vllm.models.loader import get_model
from mini_vllm.pipeline_stages import PipelineStageMixin
from mini_vllm.prompt_logprobs import PromptLogprobsMixin
from mini_vllm.request_isolation import run_isolated
from mini_vllm.sampler import (NONFINITE_LOGITS, Sampler, SamplerOutput, SamplingMetadata, nonfinite_rows,
                              request_generator)
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode_mixin import SpecDecodeMixin
from mini_vllm.spec_decode_worker import SpecDecodeStepStats

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput(SchedulerModelRunnerOutput):
    """Chapter 03's ModelRunnerOutput (what update_from_output reads, including `failed`) plus
    what the engine core and the output processor need (vLLM's ModelRunnerOutput carries logprobs
    and the drafts the same way)."""
    # req_id -> one entry per emitted token (several with speculative decoding):
    # ([sampled, top-1, ..., top-k] token ids, their logprobs, the sampled token's rank)
    logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    # req_id -> its prompt's logprobs (positions 1..L-1, same tuples), once, when the prompt is complete
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    # Speculative decoding (chapter 04): the next step's drafts, and what speculation did this step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_decode: SpecDecodeStepStats | None = None


class ModelRunner(SpecDecodeMixin, KVConnectorModelRunnerMixin, LoRAModelRunnerMixin, PromptLogprobsMixin,
                  PipelineStageMixin, AsyncOutputMixin):
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config, self.model_config = config, model_config
        self.device = config.resolved_device
        self.attn_backend = self._attention_backend(config, model_config)
        self.block_size = config.block_size
        self.max_model_len = model_config.max_model_len
        self.max_num_reqs = config.max_num_seqs
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(self.max_model_len)
        self.max_num_blocks_per_req = cdiv(self.max_model_len, self.block_size)

        eagle = config.speculative_config is not None and config.speculative_config.method == "eagle"
        self.model = get_model(model_config, device=self.device, attn_backend=self.attn_backend,
                               cpu_gemm_backend=config.cpu_gemm_backend, cpu_layer_ops=config.cpu_layer_ops,
                               cuda_layer_ops=config.cuda_layer_ops, embed_on_last_stage=eagle)
        self._init_pipeline_stage()
        self._init_lora(config)                          # chapter 09: the layers wrapped, the adapter slots
        # The stream of unseeded random rows, seeded by the engine's seed: runs are reproducible.
        self.sampler = Sampler(generator=torch.Generator(device=self.device).manual_seed(config.seed),
                               logprobs_mode=config.logprobs_mode)
        self._init_spec_decode(config, model_config)
        # Set from outside (self_distill.py): every position's hidden state copied out as computed.
        self.hidden_states_tap: HiddenStatesTap | None = None
        self._grammar_output = None          # structured output: the step's masks (structured_output_manager.py)
        # With drafts, a step's emitted tokens are read on the host anyway (the rejection sampler's
        # verdict) and the drafter reads them: they go into the batch at once (async_output.py).
        self._init_async_output(config.async_scheduling, tokens_stay_on_device=self.spec_decode is None)
        if self.device.type == "cpu" and config.cpu_kernels != "off" and config.cpu_keep_freed_memory:
            # After loading: the checkpoint's unpacked copies, freed by packing, go back to the OS first.
            reason = kernels_cpu.configure_process()
            if reason:
                logger.warning("cpu_keep_freed_memory: %s", reason)

        self.requests: dict[str, CachedRequestState] = {}    # every request the runner knows, by id
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_blocks_per_req)
        if self.device.type == "cuda":
            # Each step's index arrays reach the GPU from pinned buffers, without waiting for it; one
            # buffer set per batch that can be in flight, so a step's traced inputs outlive the next.
            self.input_batch.staging = InputStaging(
                self.device, self.max_num_batched_tokens, self.max_num_reqs, self.max_num_blocks_per_req,
                num_sets=max(2, config.parallel_config.max_concurrent_batches))
        self.kv_cache_spec = model_config.kv_cache_spec(self.block_size)
        self.cache_engine: CacheEngine | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_graph_runner: CUDAGraphRunner | None = None
        self._sampling_metadata: tuple[tuple[str, ...], SamplingMetadata] | None = None   # (row ids, metadata)

    # ================================================================== set-up
    @staticmethod
    def _attention_backend(config: EngineConfig, model_config: ModelConfig) -> str:
        """The configured backend; "auto" on a CPU is the C++ kernel unless this model's
        head_dim is not one it supports (a multiple of 8), then the vectorized torch path."""
        backend = config.resolved_attention_backend
        if backend == "cpu" and model_config.head_dim % 8:
            if config.attention_backend == "cpu":
                raise ValueError(f"attention_backend='cpu' needs head_dim to be a multiple of 8, this model has "
                                 f"{model_config.head_dim}; use 'torch'")
            backend = "torch"
        return backend

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Allocate the device KV cache (and the CPU swap tier) through chapter 02's CacheEngine."""
        copy_backend = "torch" if self.device.type == "cpu" else "triton"
        self.cache_engine = CacheEngine(self.kv_cache_spec, num_blocks, num_cpu_blocks, device=self.device,
                                        backend=copy_backend)
        self.kv_caches = list(zip(self.cache_engine.key_caches, self.cache_engine.value_caches))
        if self.spec_decode is not None:
            self.spec_decode.initialize_kv_cache(num_blocks)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward at the largest step the scheduler may ask for (max_num_batched_tokens over
        max_num_seqs requests), plus logits and sampling for max_num_seqs rows — so that the
        peak memory afterwards is the activations' high-water mark (vLLM: profile_run,
        _dummy_sampler_run). Uses a throwaway KV cache just big enough for it."""
        num_reqs = min(self.max_num_reqs, self.max_num_batched_tokens)
        base, extra = divmod(self.max_num_batched_tokens, num_reqs)
        lens = [min(base + (i < extra), self.max_model_len) for i in range(num_reqs)]
        block_ids, next_block = [], 0
        for n in lens:
            k = cdiv(n, self.block_size)
            block_ids.append(list(range(next_block, next_block + k)))
            next_block += k
        kv_caches = self.kv_cache_spec.allocate_per_layer(next_block, self.device)
        inputs = prepare_inputs([[0] * n for n in lens], [0] * num_reqs, block_ids, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn_metadata)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        # Random sampling with top-k and top-p exercises the sampler's filtering buffers (its top-k
        # candidates; a full sort only happens for rows that need it, see topk_topp_sampler.py).
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * num_reqs
        self.sampler(logits, SamplingMetadata.from_params(params, device=self.device))
        del kv_caches, hidden, logits

    def capture_model(self) -> None:
        """CUDA graphs for decode batches (GPU, triton/cuda backends, unless enforce_eager)."""
        self.cuda_graph_runner = CUDAGraphRunner(
            self.model, self.kv_caches, self.config.capture_sizes(), self.max_model_len,
            self.max_num_blocks_per_req, self.device)
        self.cuda_graph_runner.capture()

    # ================================================================== one step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """One step. With async scheduling the sampled tokens stay on the device: the output is an
        AsyncModelRunnerOutput whose `get_output()` waits for their host copy (async_output.py)."""
        if self.async_scheduling:
            return self._execute_async(scheduler_output)
        return self._execute_model(scheduler_output)

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.scheduled_spec_decode_tokens and self.config.speculative_config is None:
            raise ValueError("drafts were scheduled, but this engine has no speculative_config (chapter 04): "
                             "the scheduler only schedules drafts the runner proposed")
        self._apply_new_token_ids(so)
        self._grammar_output = so.grammar_output          # structured output: this step's masks (or None)
        failed = self._update_states(so)
        self._load_loras(so, failed)                      # chapter 09: adapters first used this step
        if self.async_scheduling:
            self._drop_failed_in_flight(so, failed)
        # Block moves BEFORE the forward, in this order: a block a swap-out frees may be written
        # by this very step (chapter 02).
        if so.blocks_to_swap_out or so.blocks_to_swap_in or so.blocks_to_copy:
            self.cache_engine.execute(so.blocks_to_swap_out, so.blocks_to_swap_in, so.blocks_to_copy)
        self._kv_connector_start(so)          # after the moves: a load may fill a block a swap-out freed
        batch = self.input_batch
        output = ModelRunnerOutput(list(batch.req_ids), [[] for _ in range(batch.num_reqs)], failed=failed)
        if batch.num_reqs:
            unused = self._unused_slots                      # async: placeholder drafts nothing filled
            num_scheduled = np.fromiter((so.num_scheduled_tokens[r] - unused.get(r, 0) for r in batch.req_ids),
                                        dtype=np.int64, count=batch.num_reqs)
            if self.spec_decode is not None:
                self.spec_decode.begin_step()
            t0, has_drafts = time.perf_counter(), bool(batch.num_draft_tokens[:batch.num_reqs].any())
            run_isolated(lambda rows, n: self._execute_rows(rows, n, output), np.arange(batch.num_reqs),
                         num_scheduled, batch.req_ids, output.failed)
            self._clear_active_loras()                   # what runs the target's layers next runs the base
            if self.spec_decode is not None:
                if has_drafts:
                    self.spec_decode.step_stats.verification_time = time.perf_counter() - t0
                self._propose_draft_token_ids(output)
        return self._kv_connector_finish(so, output)

    def _execute_rows(self, rows: np.ndarray, num_scheduled: np.ndarray, output: ModelRunnerOutput) -> None:
        """Forward + sample `rows` of the persistent batch (each running num_scheduled[j] tokens)."""
        self._set_active_loras(rows, num_scheduled)      # chapter 09: each token's adapter slot
        ### BEGIN SOLUTION
        inputs, sample_rows = self.input_batch.prepare_inputs(num_scheduled, self.block_size, self.device, rows)
        inputs = self._with_attention_plan(inputs, rows)
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(inputs):
            hidden = self.cuda_graph_runner.run(inputs)                              # [T, hidden]
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        if not self.samples:
            return                                   # a pipeline stage before the last (micro-batches)
        if self.spec_decode is None:
            self._sample(hidden, inputs.logits_indices, sample_rows, output)
        else:
            self._sample_with_drafts(hidden, inputs, sample_rows, output)
            self._keep_hidden_for_drafter(hidden, rows, num_scheduled, output)
        ### END SOLUTION
        if self.hidden_states_tap is not None and self.samples:
            batch = self.input_batch
            self.hidden_states_tap.observe_hidden([batch.req_ids[i] for i in rows], batch.num_computed_tokens[rows],
                                                  num_scheduled, hidden)
        self._prompt_logprobs(hidden, rows, num_scheduled, sample_rows, output)

    def _with_attention_plan(self, inputs: ModelInputs, rows: np.ndarray | None = None) -> ModelInputs:
        """The attention backend's per-step precomputation, built once here instead of in each
        of the model's layers (vLLM: the backend's AttentionMetadataBuilder.build); for a step
        that verifies EAGLE-2 trees, their positions and masks instead (spec_decode_mixin.py)."""
        if rows is not None and self._step_trees:
            tree_inputs = self._with_tree_layout(inputs, rows)
            if tree_inputs is not None:
                return tree_inputs
        plan = build_attention_plan(inputs.attn_metadata, self.block_size, ATTENTION_BACKENDS[self.attn_backend][1])
        if plan is None:
            return inputs
        return dataclasses.replace(inputs, attn_metadata=dataclasses.replace(inputs.attn_metadata, plan=plan))

    # ================================================================== the persistent batch
    def _update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Apply the scheduler's deltas to `requests` and the persistent batch (vLLM: _update_states).
        Returns {req_id: message} for scheduled requests whose state could not be applied (they
        stay out of the batch; the others run)."""
        batch = self.input_batch
        failed: dict[str, str] = {}
        ### BEGIN SOLUTION
        for req_id in so.finished_req_ids:                   # gone for good
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in so.preempted_req_ids:                  # KV dropped or swapped: out of the batch,
            batch.remove_request(req_id)                     # state (and generator) kept for resumption
        scheduled = so.num_scheduled_tokens
        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove_request(req_id)                     # not scheduled this step: row freed, state kept

        for new in so.scheduled_new_reqs:
            try:
                params = new.sampling_params if new.sampling_params is not None else SamplingParams(temperature=0.0)
                state = CachedRequestState(new.req_id, list(new.prompt_token_ids), params,
                                           request_generator(params, self.device), list(new.block_ids),
                                           new.num_computed_tokens)
                self.requests[new.req_id] = state
                batch.add_request(state)
            except Exception as error:    # noqa: BLE001
                failed[new.req_id] = self._state_error(new.req_id, error)

        cached = so.scheduled_cached_reqs
        for req_id, resumed, new_block_ids, num_computed in zip(
                cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens):
            try:
                self._update_cached_request(req_id, resumed, new_block_ids, num_computed,
                                            cached.resumed_token_ids.get(req_id))
            except Exception as error:    # noqa: BLE001
                failed[req_id] = self._state_error(req_id, error)
        self._write_draft_token_ids(so, failed)
        batch.condense()
        ### END SOLUTION
        if batch.num_reqs != len(scheduled) - len(failed):
            raise RuntimeError(f"the persistent batch holds {batch.num_reqs} requests but "
                               f"{len(scheduled) - len(failed)} are scheduled")
        return failed

    def _update_cached_request(self, req_id: str, resumed: bool, new_block_ids: list[int], num_computed: int,
                               resumed_token_ids: list[int] | None) -> None:
        batch = self.input_batch
        state = self.requests[req_id]
        state.num_computed_tokens = num_computed
        if resumed:
            # Preempted earlier (and out of the batch since): its block table is replaced, and the
            # scheduler's tokens (prompt + output so far) are the truth.
            state.block_ids = list(new_block_ids)
            state.output_token_ids = list(resumed_token_ids[len(state.prompt_token_ids):])
        else:
            state.block_ids.extend(new_block_ids)
        row = batch.req_id_to_index.get(req_id)
        if row is None:                                  # resumed, or back after a step unscheduled
            batch.add_request(state)
        else:
            batch.num_computed_tokens[row] = num_computed
            if new_block_ids:
                batch.append_block_ids(row, new_block_ids)

    def _state_error(self, req_id: str, error: Exception) -> str:
        logger.exception("request %s: its state could not be applied to the batch", req_id)
        self.input_batch.remove_request(req_id)
        return f"the engine could not prepare this request: {type(error).__name__}: {error}"

    # ================================================================== sampling
    def _sampling_metadata_for(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampler's per-row tensors, rebuilt only when the sampling rows change (in a run of
        decode steps they do not, and rebuilding is O(rows) of Python). The key is the rows'
        state serials, not their request ids: a finished id added again is a new request with
        its own sampling params and seed (vLLM: refresh_metadata when the batch changes)."""
        batch = self.input_batch
        key = tuple(batch.states[i].serial for i in rows)
        if self._sampling_metadata is None or self._sampling_metadata[0] != key:
            states = [batch.states[i] for i in rows]
            md = SamplingMetadata.from_params([s.sampling_params for s in states], [s.generator for s in states],
                                              req_ids=[s.req_id for s in states], device=self.device,
                                              prompt_token_ids=[s.prompt_token_ids for s in states])
            self._sampling_metadata = (key, md)
        return self._sampling_metadata[1]

    def _sample(self, hidden: torch.Tensor, logits_indices: torch.Tensor, sample_rows: np.ndarray,
                output: ModelRunnerOutput) -> None:
        """Logits for the sampling rows, one token each, recorded into `output`."""
        if len(sample_rows) == 0:
            return
        logits = self.model.compute_logits(hidden[logits_indices])                 # [S, vocab] fp32
        rows = sample_rows
        if self.hidden_states_tap is not None:
            self.hidden_states_tap.observe_greedy([self.input_batch.req_ids[i] for i in rows], logits)
        if self.tokens_stay_on_device:
            # Reading the flags here would make the host wait for this forward pass (on a GPU: the
            # very wait async scheduling removes). The rows sample from neutral logits instead, and
            # their requests fail when the step's output is read (AsyncModelRunnerOutput.get_output);
            # the step already scheduled for them computes a token the scheduler then drops.
            nonfinite = nonfinite_rows(logits)                                     # [S] bool, on the device
            self._sample_rows(logits.masked_fill_(nonfinite[:, None], 0.0), rows, output, nonfinite)   # in place: no [S, V] copy
            return
        bad = nonfinite_rows(logits).cpu().numpy()                                  # [S]
        if bad.any():
            # Fail only the offending rows (before drawing anything, so no random stream has
            # advanced), then sample the others.
            for i in rows[bad]:
                output.failed[self.input_batch.req_ids[i]] = NONFINITE_LOGITS
            rows, logits = rows[~bad], logits[torch.from_numpy(~bad).to(logits.device)]
            if len(rows) == 0:
                return
        self._sample_rows(logits, rows, output)

    def _sample_rows(self, logits: torch.Tensor, rows: np.ndarray, output: ModelRunnerOutput,
                     nonfinite: torch.Tensor | None = None) -> None:
        """One token for each of `rows` from its logits row [len(rows), V]; `nonfinite` [len(rows)]
        (async scheduling): device flags of rows whose request fails once the flags are on the host."""
        apply_grammar_bitmask(self._grammar_output, [self.input_batch.req_ids[i] for i in rows], [1] * len(rows), logits,
                              output.failed)
        md = self._sampling_metadata_for(rows)
        outputs = None
        if md.logits_processors is not None and md.logits_processors.needs_output_tokens:
            self._write_back_sampled(keep_last=False)        # async: the output tokens' values, waited for
            outputs = self.input_batch.output_tokens(rows, device=self.device)
        result = self.sampler(logits, md, outputs)
        if self.tokens_stay_on_device:
            self._record_async(result, rows, nonfinite)
        else:
            self._record(result, rows, output)

    def _record(self, result: SamplerOutput, rows: np.ndarray, output: ModelRunnerOutput) -> None:
        """Append each sampled token to its request (the runner keeps its own copy of the tokens:
        the next step's input ids are read from the persistent batch). Exactly one token per row,
        so the batch takes them in one vectorized write instead of a call per row (at batch 256
        the per-row calls were a visible part of a decode step's host time). Everything is read
        out before anything is appended, so a failure here leaves the batch as it was."""
        batch = self.input_batch
        tokens = result.sampled_token_ids.tolist()
        logprobs: dict[str, list[tuple[list[int], list[float], int]]] = {}
        lp = result.logprobs_tensors
        if lp is not None:
            ids, values, ranks = lp.logprob_token_ids.tolist(), lp.logprobs.tolist(), lp.selected_token_ranks.tolist()
            for j, i in enumerate(rows.tolist()):
                k = batch.states[i].sampling_params.logprobs
                if k is not None:
                    logprobs[batch.req_ids[i]] = [(ids[j][:k + 1], values[j][:k + 1], ranks[j])]
        batch.append_tokens(rows, np.asarray(tokens, dtype=batch.token_ids.dtype))    # (checks first)
        sampled, states = output.sampled_token_ids, batch.states
        for i, token in zip(rows.tolist(), tokens):
            sampled[i].append(token)
            states[i].output_token_ids.append(token)
        output.logprobs.update(logprobs)
