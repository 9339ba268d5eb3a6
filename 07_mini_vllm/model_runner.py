"""ModelRunner: turns each SchedulerOutput into one forward pass and one sampled token per request.

Mirrors vLLM v1's `vllm/v1/worker/gpu_model_runner.py: GPUModelRunner` — `_update_states`
(apply the scheduler's deltas to the persistent batch), `_prepare_inputs` (the flat ragged
batch), `execute_model` (forward, logits for the sampling rows only, sample),
`profile_run` (a dummy forward at the largest batch, to measure activation memory),
`initialize_kv_cache`, `capture_model` — and the block moves of v0's worker
(`CacheEngine.swap_in/swap_out/copy`, executed before the forward).

One step:

    SchedulerOutput ──_update_states──> persistent batch (rows = requests scheduled this step)
        finished / preempted / unscheduled requests leave their row; new and resumed ones get
        one; running ones append their new block ids; num_computed_tokens comes from the scheduler
    blocks_to_swap_out -> blocks_to_swap_in -> blocks_to_copy  (chapter 02's CacheEngine)
    _prepare_inputs:  input_ids, positions, slot_mapping (chapter 01's compute_slot_mapping),
                      block_tables, seq_lens, query_start_loc -> AttentionMetadata; logits_indices
    model(...) -> hidden [T, hidden];  compute_logits(hidden[logits_indices]) -> [S, vocab]
    Sampler -> one token per sampling row, appended to the persistent batch
    -> ModelRunnerOutput(req_ids, sampled_token_ids) for chapter 03's update_from_output

A row samples only when this step's tokens reach the end of what the request has: a prefill
chunk that stops short gets no logits at all (for SmolLM2 the 49152 x 576 vocabulary projection
is the largest matmul of a decode step).

Speculative decoding (chapter 04; `spec_decode_worker.py` owns its pieces): a request's drafts
are written into its row after its last token, so the flat batch carries them as ordinary
tokens; a step with drafts computes logits at every draft position plus one (vLLM's
SpecDecodeMetadata.logits_indices), samples the bonus rows with the Sampler and verifies the
drafts with the rejection sampler (`_sample_with_drafts`); after sampling the drafter proposes
the next step's drafts (`_propose_draft_token_ids`), which EngineCore hands to the scheduler.

A KV connector (chapter 06), when the engine has one, is driven around the step in vLLM's
order: `bind_connector_metadata` + `start_load_kv` after the block moves (its loads are
asynchronous: their requests are not in this forward), `wait_for_save` + `get_finished` after
the forward, and what they report goes into ModelRunnerOutput (`finished_recving`,
`finished_sending`, `invalid_block_ids`). The model itself is untouched: the pool copies a
step's blocks once the whole forward is done (`wait_for_save`), not layer by layer.

A request whose logits are not finite (NaN, +inf, or all -inf) does not take the batch down:
the sampler refuses such rows, the runner samples the other rows and reports the bad one in
`failed`, and the engine finishes it with an error.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from chunked_prefill import build_attention_plan
from global_prefix_cache.kv_layout import kv_caches_from_cache_engine
import kernels_cpu
from kvcache.cache_engine import CacheEngine
from paged_attention import cdiv
from paged_attention.model.parallel_state import get_pp_group
from scheduler import ModelRunnerOutput as SchedulerModelRunnerOutput
from scheduler import SchedulerOutput

from mini_vllm.async_output import PLACEHOLDER_TOKEN_ID, AsyncModelRunnerOutput, SampledTokens
from mini_vllm.config import ModelConfig
from mini_vllm.cuda_graph import CUDAGraphRunner
from mini_vllm.engine_config import EngineConfig
from mini_vllm.model_inputs import ModelInputs, prepare_inputs
from mini_vllm.models.attention import ATTENTION_BACKENDS
from mini_vllm.models.loader import get_model
from mini_vllm.input_batch import CachedRequestState, InputBatch
from mini_vllm.input_staging import InputStaging
from mini_vllm.logits_processors import apply_logits_processors
from mini_vllm.sampler import (NONFINITE_LOGITS, Sampler, SamplerOutput, SamplingMetadata, compute_logprobs, nonfinite_rows,
                              request_generator)
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode_worker import SpecDecodeStepStats, SpecDecodeWorker

logger = logging.getLogger(__name__)




@dataclass
class ModelRunnerOutput(SchedulerModelRunnerOutput):
    """Chapter 03's ModelRunnerOutput (what update_from_output reads, including `failed`) plus
    what only the engine's output processor needs (vLLM's ModelRunnerOutput carries logprobs
    the same way)."""
    # req_id -> one entry per emitted token (several with speculative decoding):
    # ([sampled, top-1, ..., top-k] token ids, their logprobs, the sampled token's rank)
    logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    # req_id -> its prompt's logprobs (positions 1..L-1, same tuples), once, when the prompt is complete
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    spec_decode: SpecDecodeStepStats | None = None      # what speculation did this step (chapter 04)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config, self.model_config = config, model_config
        self.device = config.resolved_device
        self.attn_backend = self._attention_backend(config, model_config)
        self.block_size = config.block_size
        self.max_model_len = model_config.max_model_len
        self.max_num_reqs = config.max_num_seqs
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(self.max_model_len)
        self.max_num_blocks_per_req = cdiv(self.max_model_len, self.block_size)

        self.model = get_model(model_config, device=self.device, attn_backend=self.attn_backend,
                               cpu_gemm_backend=config.cpu_gemm_backend, cpu_layer_ops=config.cpu_layer_ops,
                               cuda_layer_ops=config.cuda_layer_ops)
        # Pipeline micro-batches: only the last stage samples; the others learn the tokens from the
        # next schedule of each request (CachedRequestData.new_token_ids), so no stage waits for the
        # last one's logits and stage 0 can run batch B while stage 1 runs batch A (vLLM does the same).
        pp = get_pp_group()
        micro = config.parallel_config.pipeline_micro_batches and pp.world_size > 1
        self.samples = pp.is_last_rank or not micro
        self.model.broadcast_logits = not micro
        # The stream of unseeded random rows, seeded by the engine's seed: runs are reproducible.
        self.sampler = Sampler(generator=torch.Generator(device=self.device).manual_seed(config.seed),
                               logprobs_mode=config.logprobs_mode)
        self.spec_decode: SpecDecodeWorker | None = None
        if config.speculative_config is not None:
            self.spec_decode = SpecDecodeWorker(
                config.speculative_config, model_config, self.model, device=self.device, block_size=self.block_size,
                attn_backend=self.attn_backend, cpu_gemm_backend=config.cpu_gemm_backend,
                cpu_layer_ops=config.cpu_layer_ops, cuda_layer_ops=config.cuda_layer_ops,
                generator=self.sampler.generator, tokenizer_path=config.tokenizer)

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
        self.last_inputs: ModelInputs | None = None          # the last step's tensors (the notebook traces them)
        self.kv_connector = None                              # chapter 06's worker side (register_kv_connector)
        # Async scheduling (async_output.py): each step's sampled tokens, oldest first, until their
        # values are written into the requests' states; the last step's feed the next input ids.
        self.async_scheduling = config.async_scheduling
        self._sampled_steps: deque[list[SampledTokens]] = deque()
        self._step_sampled: list[SampledTokens] = []          # the step being run's
        self._failed_last_step: set[str] = set()              # already scheduled again when they failed

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

    def register_kv_connector(self, connector) -> None:
        """Give a KV connector this runner's K/V tensors (vLLM: register_kv_caches), as
        {"layers.{i}.k_cache" / "v_cache": [num_blocks, block_size, kv_heads, head_dim]}."""
        connector.register_kv_caches(kv_caches_from_cache_engine(self.cache_engine))
        self.kv_connector = connector

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
        AsyncModelRunnerOutput whose `get_output()` waits for their host copy."""
        if not self.async_scheduling:
            return self._execute_model(scheduler_output)
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

    def _drop_failed_in_flight(self, so: SchedulerOutput, failed: dict[str, str]) -> None:
        """Async scheduling: a request that failed in the previous step was scheduled for this one
        before the scheduler knew; it has no token in flight to compute. Its row goes (the scheduler
        finished it already and drops whatever this step reports for it)."""
        batch = self.input_batch
        for req_id in self._failed_last_step & so.num_scheduled_tokens.keys():
            if batch.remove_request(req_id) is not None:
                failed[req_id] = "failed in the previous step"
        batch.condense()

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.scheduled_spec_decode_tokens and self.spec_decode is None:
            raise ValueError("drafts were scheduled, but this engine has no speculative_config (chapter 04): "
                             "the scheduler only schedules drafts the runner proposed")
        self._apply_new_token_ids(scheduler_output)
        failed = self._update_states(scheduler_output)
        if self.async_scheduling and self._failed_last_step:
            self._drop_failed_in_flight(scheduler_output, failed)
        # Block moves BEFORE the forward, in this order: a block a swap-out frees may be written
        # by this very step (chapter 02).
        so = scheduler_output
        if so.blocks_to_swap_out or so.blocks_to_swap_in or so.blocks_to_copy:
            self.cache_engine.execute(so.blocks_to_swap_out, so.blocks_to_swap_in, so.blocks_to_copy)
        self._kv_connector_start(so)          # after the moves: a load may fill a block a swap-out freed
        batch = self.input_batch
        output = ModelRunnerOutput(list(batch.req_ids), [[] for _ in range(batch.num_reqs)], failed=failed)
        if batch.num_reqs == 0:
            return self._kv_connector_finish(so, output)
        num_scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in batch.req_ids), dtype=np.int64,
                                    count=batch.num_reqs)
        if self.spec_decode is None:
            self._execute_rows(np.arange(batch.num_reqs), num_scheduled, output)
        else:
            self._execute_and_propose(num_scheduled, output)
        return self._kv_connector_finish(so, output)

    def _execute_and_propose(self, num_scheduled: np.ndarray, output: ModelRunnerOutput) -> None:
        """A step of a speculative engine: run (and verify) the batch, then propose the next
        step's drafts for the requests that emitted tokens — after sampling, as vLLM does."""
        worker, batch = self.spec_decode, self.input_batch
        worker.begin_step()
        has_drafts = bool(batch.num_draft_tokens[:batch.num_reqs].any())
        t0 = time.perf_counter()
        self._execute_rows(np.arange(batch.num_reqs), num_scheduled, output)
        if has_drafts:
            worker.step_stats.verification_time = time.perf_counter() - t0
        self._propose_draft_token_ids(output)
        output.spec_decode = worker.end_step()

    def _execute_rows(self, rows: np.ndarray, num_scheduled: np.ndarray, output: ModelRunnerOutput) -> None:
        """Forward + sample `rows` of the persistent batch. One request must never take the
        batch down: if anything raises, the rows are run again in two halves, down to the one
        request that fails alone — it is reported in `output.failed` and the scheduler finishes
        it with the message, freeing its blocks (never cached: its K/V may be half written).
        Re-running is safe: a forward writes each token's K/V to the same slot again."""
        try:
            ### BEGIN SOLUTION
            inputs, sample_rows = self.input_batch.prepare_inputs(num_scheduled, self.block_size, self.device, rows)
            inputs = self._with_attention_plan(inputs)
            self.last_inputs = inputs
            if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(inputs):
                hidden = self.cuda_graph_runner.run(inputs)                              # [T, hidden]
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
            if self.spec_decode is None:
                self._sample(hidden, inputs.logits_indices, sample_rows, output)
            else:
                self._sample_with_drafts(hidden, inputs, sample_rows, output)
                self._keep_hidden_for_drafter(hidden, rows, num_scheduled, output)
            ### END SOLUTION
            # What only some requests ask for, from the same step's hidden [T, hidden]: their prompts' logprobs.
            self._prompt_logprobs(hidden, rows, num_scheduled, sample_rows, output)
        except Exception as error:      # noqa: BLE001 — isolating per-request faults is the point
            if len(rows) == 1:
                req_id = self.input_batch.req_ids[rows[0]]
                logger.exception("request %s failed in the forward pass or the sampler", req_id)
                output.failed[req_id] = f"the engine could not run this request: {type(error).__name__}: {error}"
                return
            half = len(rows) // 2
            self._execute_rows(rows[:half], num_scheduled[:half], output)
            self._execute_rows(rows[half:], num_scheduled[half:], output)

    def _kv_connector_start(self, so: SchedulerOutput) -> None:
        """Before the forward (vLLM: bind_connector_metadata, start_load_kv): this step's loads
        start in the background, into blocks of requests waiting for them."""
        connector = self.kv_connector
        if connector is not None:
            connector.bind_connector_metadata(so.kv_connector_metadata)
            connector.start_load_kv()

    def _kv_connector_finish(self, so: SchedulerOutput, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """After the forward (vLLM: wait_for_save, get_finished, get_block_ids_with_load_errors):
        publish / stage what this step computed — never the blocks of a request that failed in
        it — and report finished sends and loads, and the blocks of failed loads."""
        connector = self.kv_connector
        if connector is None:
            return output
        if output.failed:
            connector.discard_saves(output.failed)
        connector.wait_for_save()
        output.finished_sending, output.finished_recving = connector.get_finished(so.finished_req_ids)
        for req_id, reason in connector.get_failed_loads().items():
            logger.warning("request %s: loading its remote K/V failed (%s); it is computed here", req_id, reason)
        output.invalid_block_ids = connector.get_block_ids_with_load_errors()
        connector.clear_connector_metadata()
        return output

    def _with_attention_plan(self, inputs: ModelInputs) -> ModelInputs:
        """The attention backend's per-step precomputation, built once here instead of in each
        of the model's layers (vLLM: the backend's AttentionMetadataBuilder.build)."""
        plan = build_attention_plan(inputs.attn_metadata, self.block_size, ATTENTION_BACKENDS[self.attn_backend][1])
        if plan is None:
            return inputs
        return dataclasses.replace(inputs, attn_metadata=dataclasses.replace(inputs.attn_metadata, plan=plan))

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

    def _apply_new_token_ids(self, so: SchedulerOutput) -> None:
        """Pipeline micro-batches: a stage that does not sample appends the tokens the last stage
        sampled for a request since it was last scheduled; the last stage, which appended them when it
        sampled, checks that the scheduler agrees (a mismatch fails the step, never goes unseen)."""
        batch = self.input_batch
        for req_id, tokens in so.scheduled_cached_reqs.new_token_ids.items():
            state = self.requests.get(req_id)
            if state is None or not tokens:
                continue
            if self.samples:
                if state.output_token_ids[-len(tokens):] != list(tokens):
                    raise RuntimeError(f"request {req_id}: the scheduler's new tokens {tokens} are not the ones "
                                       f"sampled ({state.output_token_ids[-len(tokens):]})")
                continue
            state.output_token_ids.extend(tokens)
            row = batch.req_id_to_index.get(req_id)
            if row is not None:                          # still has its row: append there too
                for token in tokens:
                    batch.append_token(row, token)

    def _write_draft_token_ids(self, so: SchedulerOutput, failed: dict[str, str]) -> None:
        """This step's drafts into their requests' rows (none left over from the last step); the
        drafter drops the draft KV of preempted requests (finished ones it forgot already: the
        engine core tells it the moment they finish)."""
        batch = self.input_batch
        batch.num_draft_tokens[:len(batch.req_ids)] = 0
        if self.spec_decode is None:
            return
        self.spec_decode.preempt_requests(so.preempted_req_ids)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                continue                                 # failed above
            try:
                batch.set_draft_token_ids(row, drafts)
            except Exception as error:    # noqa: BLE001
                failed[req_id] = self._state_error(req_id, error)

    def _update_cached_request(self, req_id: str, resumed: bool, new_block_ids: list[int], num_computed: int,
                               resumed_token_ids: list[int] | None) -> None:
        batch = self.input_batch
        state = self.requests[req_id]
        state.num_computed_tokens = num_computed
        if resumed:
            # Preempted earlier: the block table is replaced, and the scheduler's tokens
            # (prompt + output so far) are the truth.
            state.block_ids = list(new_block_ids)
            state.output_token_ids = list(resumed_token_ids[len(state.prompt_token_ids):])
        else:
            state.block_ids.extend(new_block_ids)
        row = batch.req_id_to_index.get(req_id)
        if resumed and row is not None:                  # still in the batch, its block table replaced
            batch.remove_request(req_id)                 # (copy-on-write): the row is rebuilt
            row = None
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
        if not self.samples:
            return                                   # a pipeline stage before the last (micro-batches)
        if len(sample_rows) == 0:
            return
        logits = self.model.compute_logits(hidden[logits_indices])                 # [S, vocab] fp32
        rows = sample_rows
        if self.async_scheduling:
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
        md = self._sampling_metadata_for(rows)
        outputs = None
        if md.logits_processors is not None and md.logits_processors.needs_output_tokens:
            self._write_back_sampled(keep_last=False)        # async: the output tokens' values, waited for
            outputs = self.input_batch.output_tokens(rows, device=self.device)
        result = self.sampler(logits, md, outputs)
        if self.async_scheduling:
            self._record_async(result, rows, nonfinite)
        else:
            self._record(result, rows, output)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: np.ndarray, num_scheduled: np.ndarray,
                         sample_rows: np.ndarray, output: ModelRunnerOutput) -> None:
        """Logprobs of the prompt tokens this step computed, for requests that asked (vLLM:
        GPUModelRunner._get_prompt_logprobs_dict): position p's logits give token p + 1's logprob,
        its rank and the k most likely — from the raw model distribution, whatever logprobs_mode.
        A chunked prompt fills them in over several steps; they go out when the prompt is done."""
        if not self.samples:
            return                                   # a pipeline stage before the last (micro-batches)
        batch = self.input_batch
        k = batch.num_prompt_logprobs[rows]                                            # [n]
        wanted = np.flatnonzero(k >= 0)
        if wanted.size == 0:
            return
        starts = np.cumsum(num_scheduled) - num_scheduled                              # [n] flat offsets
        flat, owners = [], []
        for j in wanted.tolist():
            row = rows[j]
            first = int(batch.num_computed_tokens[row])
            last = min(first + int(num_scheduled[j]), int(batch.num_prompt_tokens[row]) - 1)   # positions [first, last)
            flat.extend(range(int(starts[j]), int(starts[j]) + max(0, last - first)))
            owners.extend((row, p) for p in range(first, last))
        if flat:
            logits = self.model.compute_logits(hidden[torch.tensor(flat, device=hidden.device)])      # [P, V]
            targets = torch.tensor([int(batch.token_ids[row, p + 1]) for row, p in owners], device=logits.device)
            lp = compute_logprobs(logits, targets, int(k[wanted].max()))
            ids, values, ranks = lp.logprob_token_ids.tolist(), lp.logprobs.tolist(), lp.selected_token_ranks.tolist()
            for i, (row, p) in enumerate(owners):
                state, kk = batch.states[row], int(batch.num_prompt_logprobs[row])
                if state.prompt_logprobs is None:
                    state.prompt_logprobs = [None] * (len(state.prompt_token_ids) - 1)
                state.prompt_logprobs[p] = (ids[i][:kk + 1], values[i][:kk + 1], ranks[i])
        for row in set(sample_rows.tolist()) & set(rows[wanted].tolist()):           # the prompt is complete
            state = batch.states[row]
            output.prompt_logprobs[state.req_id] = list(state.prompt_logprobs or [])
            state.prompt_logprobs_sent = True
            batch.num_prompt_logprobs[row] = -1

    def _record(self, result: SamplerOutput, rows: np.ndarray, output: ModelRunnerOutput) -> None:
        """Append each sampled token to its request (the runner keeps its own copy of the
        tokens: the next step's input ids are read from the persistent batch). Everything is
        read out before anything is appended, so a failure here leaves the batch as it was."""
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
        self._append_sampled(rows, tokens, logprobs, output)

    def _append_sampled(self, rows: np.ndarray, tokens: list[int], logprobs: dict,
                        output: ModelRunnerOutput) -> None:
        """Plain decoding's `_append_emitted`: exactly one token per row, so the persistent
        batch takes them in one vectorized write instead of a call per row (at batch 256 the
        per-row calls were a visible part of a decode step's host time)."""
        batch = self.input_batch
        batch.append_tokens(rows, np.asarray(tokens, dtype=batch.token_ids.dtype))    # (checks first)
        sampled, states = output.sampled_token_ids, batch.states
        for i, token in zip(rows.tolist(), tokens):
            sampled[i].append(token)
            states[i].output_token_ids.append(token)
        output.logprobs.update(logprobs)

    # ================================================================== async scheduling (async_output.py)
    def _record_async(self, result: SamplerOutput, rows: np.ndarray, nonfinite: torch.Tensor | None) -> None:
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

    # ================================================================== speculative decoding (chapter 04)
    def _sample_with_drafts(self, hidden: torch.Tensor, inputs: ModelInputs, sample_rows: np.ndarray,
                            output: ModelRunnerOutput) -> None:
        """A speculative engine's sampling (vLLM: GPUModelRunner._sample with spec_decode_metadata).

        A sampling row with k drafts owns its last k + 1 positions: logits at all of them
        (`SpecDecodeMetadata.logits_indices`); the Sampler draws the bonus token of every row
        from its last one (for rows without drafts that is simply its token), then the rejection
        sampler verifies the drafts against the others. Rows without drafts cost what `_sample`
        costs."""
        batch = self.input_batch
        if len(sample_rows) == 0:
            return
        num_draft = batch.num_draft_tokens[sample_rows]                                 # [b]
        if not num_draft.any():
            self._sample(hidden, inputs.logits_indices, sample_rows, output)
            return
        worker = self.spec_decode
        md = worker.metadata(num_draft, inputs.logits_indices, inputs.input_ids)
        logits = self.model.compute_logits(hidden[md.logits_indices.long()])           # [n + b, V] fp32
        # A request with a non-finite logits row anywhere fails alone (before any random draw).
        bad_row = nonfinite_rows(logits).cpu().numpy()                                  # [n + b]
        bad = np.add.reduceat(bad_row, np.concatenate(([0], np.cumsum(num_draft + 1)[:-1]))) > 0   # [b]
        if bad.any():
            for i in sample_rows[bad]:
                output.failed[batch.req_ids[i]] = NONFINITE_LOGITS
            keep = np.repeat(~bad, num_draft + 1)
            sample_rows, num_draft = sample_rows[~bad], num_draft[~bad]
            if len(sample_rows) == 0:
                return
            logits = logits[torch.from_numpy(keep).to(logits.device)]
            md = worker.metadata(num_draft, inputs.logits_indices[torch.from_numpy(~bad)], inputs.input_ids)
        sm = self._sampling_metadata_for(sample_rows)
        raw_logits = logits
        if sm.logits_processors is not None:
            logits, sm = self._process_draft_rows(logits, sm, sample_rows, num_draft)
        bonus = self.sampler(logits[md.bonus_logits_indices.long()], sm)                # [b]: the normal sampler
        emitted = worker.verify(md, logits, bonus.sampled_token_ids, sm)                # b lists of 1..k+1 tokens
        logprobs = self._emitted_logprobs(raw_logits, md, emitted, sample_rows, sm.max_num_logprobs)
        for i, k, tokens in zip(sample_rows.tolist(), num_draft.tolist(), emitted):
            if k:
                worker.observe_verified(batch.req_ids[i], k, len(tokens) - 1)
        self._append_emitted(sample_rows, emitted, logprobs, output)

    def _process_draft_rows(self, logits: torch.Tensor, sm: SamplingMetadata, rows: np.ndarray,
                            num_draft: np.ndarray) -> tuple[torch.Tensor, SamplingMetadata]:
        """Penalties & co. on a speculative step's logits [n + b, V]: the row at draft position j
        of a request sees its output plus its first j drafts — the output it will have if those
        drafts are accepted, which is exactly when that row's distribution is used (vLLM:
        apply_all_penalties / apply_bad_words_with_drafts with the spec tokens). Returns the
        processed logits and the metadata without processors (they have been applied)."""
        per_request = num_draft + 1                                                     # [b] logits rows each
        req_rows = np.repeat(np.arange(len(rows)), per_request)                         # [n + b]
        position = np.arange(len(req_rows)) - np.repeat(np.cumsum(per_request) - per_request, per_request)
        outputs = None
        if sm.logits_processors.needs_output_tokens:
            outputs = self.input_batch.output_tokens(rows[req_rows], extra=position, device=self.device)
        processed = apply_logits_processors(logits, sm.logits_processors,
                                            torch.from_numpy(req_rows).to(logits.device), outputs)
        return processed, dataclasses.replace(sm, logits_processors=None)

    def _emitted_logprobs(self, logits: torch.Tensor, md, emitted: list[list[int]], rows: np.ndarray,
                          num_logprobs: int | None) -> dict[str, list[tuple[list[int], list[float], int]]]:
        """Logprobs of every emitted token, from the logits row that produced it: the j-th
        emitted token of a request came from its j-th sampled position (accepted drafts, then
        the recovered or bonus token), so they are the logprobs plain decoding would report."""
        if num_logprobs is None:
            return {}
        batch = self.input_batch
        starts = (md.cu_num_sampled_tokens.long() - torch.tensor(md.num_draft_tokens) - 1).tolist()   # [b]
        index = [s + j for s, tokens in zip(starts, emitted) for j in range(len(tokens))]
        flat = torch.tensor([t for tokens in emitted for t in tokens], dtype=torch.int64, device=logits.device)
        lp = compute_logprobs(logits[torch.tensor(index, device=logits.device)], flat, num_logprobs,
                              as_logits=self.sampler.logprobs_mode == "raw_logits")
        ids, values, ranks = lp.logprob_token_ids.tolist(), lp.logprobs.tolist(), lp.selected_token_ranks.tolist()
        out, pos = {}, 0
        for i, tokens in zip(rows.tolist(), emitted):
            k = batch.states[i].sampling_params.logprobs
            if k is not None:
                out[batch.req_ids[i]] = [(ids[p][:k + 1], values[p][:k + 1], ranks[p])
                                         for p in range(pos, pos + len(tokens))]
            pos += len(tokens)
        return out

    def _append_emitted(self, rows: np.ndarray, emitted: list[list[int]], logprobs: dict,
                        output: ModelRunnerOutput) -> None:
        """Append each request's emitted tokens: one per row in plain decoding, 1..k+1 with
        drafts (they overwrite the drafts in the batch row)."""
        batch = self.input_batch
        for i, tokens in zip(rows.tolist(), emitted):
            output.sampled_token_ids[i].extend(tokens)
            batch.states[i].output_token_ids.extend(tokens)
            for token in tokens:
                batch.append_token(i, token)
        output.logprobs.update(logprobs)

    def _keep_hidden_for_drafter(self, hidden: torch.Tensor, rows: np.ndarray, num_scheduled: np.ndarray,
                                 output: ModelRunnerOutput) -> None:
        """EAGLE drafts from the target's hidden states: hand it those of every position whose
        K/V this step computed AND kept — a prefill chunk's tokens, or a decode's last token
        plus its accepted drafts (rejected drafts' states are of an abandoned sequence)."""
        worker = self.spec_decode
        if not worker.needs_hidden_states:
            return
        batch = self.input_batch
        starts = np.concatenate(([0], np.cumsum(num_scheduled)[:-1]))
        for i, start, n in zip(rows.tolist(), starts.tolist(), num_scheduled.tolist()):
            req_id = batch.req_ids[i]
            if req_id in output.failed:
                continue
            emitted = output.sampled_token_ids[i]
            kept = n - int(batch.num_draft_tokens[i]) + len(emitted) - 1 if emitted else n
            worker.observe_hidden(req_id, int(batch.num_computed_tokens[i]), hidden[start:start + kept])

    def _propose_draft_token_ids(self, output: ModelRunnerOutput) -> None:
        """After sampling, the drafter guesses the next step's tokens of every request that just
        emitted some (vLLM: propose_draft_token_ids); EngineCore passes them to the scheduler."""
        batch = self.input_batch
        rows = [i for i, tokens in enumerate(output.sampled_token_ids)
                if tokens and batch.req_ids[i] not in output.failed]
        self.spec_decode.propose(batch, rows)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        return self.spec_decode.take_draft_token_ids() if self.spec_decode is not None else {}
