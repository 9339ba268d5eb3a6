"""EngineCore: the scheduler, the KV cache manager and the model runner, one step at a time.

Mirrors vLLM v1's `vllm/v1/engine/core.py: EngineCore` (`__init__` -> `_initialize_kv_caches`,
`add_request`, `abort_requests`, `step`). Token ids in, token ids out: no text here (that is
the LLMEngine's processor and output processor).

    step():  scheduler.schedule()                      -> SchedulerOutput      (chapters 03-06, engine_scheduler.py)
             model_executor.execute_model(...)         -> ModelRunnerOutput    (this chapter)
             scheduler.update_from_output(...)         -> EngineCoreOutputs    (chapter 03)

The model runs behind an executor (executor/, vLLM's `Executor`): UniProcExecutor keeps the model
runner in this process (`self.model_runner`), MultiprocExecutor runs one worker process per
tensor / pipeline-parallel rank (`self.model_runner` is None: the runners are in the workers). If
the workers fail (a rank died, hung, raised), every request is finished with the executor's
message and the engine refuses new ones: it cannot step any more.

Start-up sizes the KV cache (`kv_memory.py`), allocates it, captures CUDA graphs, and only
then builds the KV cache manager (chapter 02) with that many blocks and the scheduler on top.

With `kv_transfer_config` (chapter 06) the KV connector is built twice, as in vLLM: its worker
half in every rank (through the executor, registered with that rank's K/V) and its scheduler half
here, given to the scheduler and told each rank's side channel.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kvcache import BlockSpaceManager, KVCacheManager
from scheduler import EngineCoreOutput, FinishReason, Request, RequestStatus, SchedulerOutput

from mini_vllm.config import ModelConfig, weights_fingerprint
from mini_vllm.engine_config import GiB, EngineConfig
from mini_vllm.engine_messages import EngineCoreRequest
from mini_vllm.engine_scheduler import make_scheduler
from mini_vllm.executor import Executor, ExecutorError
from mini_vllm.executor.abstract import FutureOutput
from mini_vllm.kv_memory import (DEFAULT_CPU_KV_CACHE_MEMORY, GPUMemorySnapshot, KVCacheReport,
                                 check_enough_kv_cache_memory, gpu_kv_cache_bytes, num_blocks_for_bytes)
from mini_vllm.model_runner import ModelRunnerOutput
from mini_vllm.spec_decode_worker import SpecDecodeEngineStats, SpecDecodeStepStats
from mini_vllm.structured_output_manager import StructuredOutputManager
from spec_decode import SpecDecodingStats

logger = logging.getLogger(__name__)


def _load_tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


@dataclass
class EngineCoreStep:
    """Everything one step produced. The LLMEngine turns it into RequestOutputs; a trace reads
    scheduler_output (and, wrapping the runner from outside, the model's inputs: step_trace.py)."""
    scheduler_output: SchedulerOutput
    outputs: list[EngineCoreOutput]
    logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)   # per emitted token
    errors: dict[str, str] = field(default_factory=dict)     # requests that failed this step: the reason
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    start_time: float = 0.0                                   # time.monotonic() when the step began
    spec_decode: SpecDecodeStepStats | None = None            # speculative decoding: drafts verified, times
    # What requests that finished this step produced for another engine (a prefill node's: where
    # its K/V waits for the decode node); the RequestOutput carries it (vLLM: EngineCoreOutput's).
    kv_transfer_params: dict[str, dict] = field(default_factory=dict)


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config, self.model_config = config, model_config
        device = config.resolved_device
        profile_gpu = (device.type == "cuda" and config.num_gpu_blocks_override is None
                       and config.kv_cache_memory is None)
        baseline = None
        if profile_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            baseline = GPUMemorySnapshot.take(device)
        self.failure: str | None = None                  # why the executor can no longer step, once it cannot
        self.model_executor: Executor = Executor.get_class(config)(config, model_config)
        self.model_runner = self.model_executor.model_runner    # in this process, or None (multiprocess)
        try:
            self.kv_cache_report = self._determine_kv_cache_size(baseline)
            self.model_executor.initialize_kv_cache(self.kv_cache_report.num_blocks, self.kv_cache_report.num_cpu_blocks)
            if config.cpu_warm_up and device.type == "cpu":
                self.model_executor.profile_run()        # the largest step once, before any client waits on it
        except BaseException:
            self.model_executor.shutdown()               # no worker outlives a failed start
            raise
        # CUDA graphs around NCCL collectives are not attempted: one rank per engine only.
        # Nor with LoRA: the step's token -> adapter map is read on the host (lora_mixin.py).
        use_graphs = (device.type == "cuda" and not config.enforce_eager and config.parallel_config.world_size == 1
                      and self.model_executor.attn_backend in ("triton", "cuda") and not config.enable_lora)
        if use_graphs:
            t0 = time.perf_counter()
            self.model_executor.capture_model()
            logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", config.capture_sizes(),
                        time.perf_counter() - t0)

        # Chapter 02's v1 manager with vLLM v0's CPU tier for swap preemption (0 blocks: none).
        self.kv_cache_manager: KVCacheManager = BlockSpaceManager(
            self.kv_cache_report.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
            num_cpu_blocks=self.kv_cache_report.num_cpu_blocks)
        self.kv_connector = self._make_kv_connector()
        # Pipeline micro-batches and async scheduling (vLLM: EngineCore.batch_queue,
        # step_with_batch_queue): up to this many scheduled batches in flight, oldest first; 1 = one
        # step at a time.
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self._spec_decoding_stats = (SpecDecodeEngineStats(SpecDecodingStats.new(config.num_speculative_tokens))
                                     if config.speculative_config is not None else None)
        self.batch_queue: deque[tuple[SchedulerOutput, FutureOutput, float]] = deque()
        self._num_waiting_for_grammar = 0                        # structured output: see _schedule
        self.num_batches_overlapped = 0                          # batches sent while another was in flight
        self.scheduler = make_scheduler(config.scheduler_config(model_config.max_model_len), self.kv_cache_manager,
                                        self.kv_connector, async_scheduling=config.async_scheduling,
                                        max_concurrent_batches=self.batch_queue_size,
                                        pipeline_parallel_size=config.pipeline_parallel_size,
                                        max_loras=config.max_loras if config.enable_lora else None)
        self.structured_output_manager = StructuredOutputManager(
            config.structured_outputs_config["backend"], lambda: _load_tokenizer(config.tokenizer or model_config.model),
            model_config.vocab_size, model_config.eos_token_ids)
        self.scheduler.structured_output_manager = self.structured_output_manager
        logger.info("%s", self.kv_cache_report)

    # ------------------------------------------------------------------ KV connector (chapter 06)
    def _make_kv_connector(self):
        """vLLM's KVConnectorFactory, once per role: the worker halves in the ranks, then the
        scheduler half here. The K/V of two engines is interchangeable only for the same weights, so
        the connector's node spec names them (directory name + `weights_fingerprint`) unless
        kv_connector_extra_config["model"] does."""
        kv_config = self.config.kv_transfer_config
        if kv_config is None:
            return None
        from global_prefix_cache.config import KVConnectorRole
        from global_prefix_cache.connector import create_connector, new_node_id
        extra = dict(kv_config.kv_connector_extra_config)
        if not extra.get("model"):
            extra["model"] = f"{self.model_config.model.name}@{weights_fingerprint(self.model_config.model)}"
        kv_config = dataclasses.replace(kv_config, kv_connector_extra_config=extra)
        spec = self._kv_node_spec(extra["model"])
        node_id = new_node_id(kv_config)
        sessions = self.model_executor.init_kv_connector(kv_config, spec, node_id)  # they join the pool
        connector = create_connector(kv_config, KVConnectorRole.SCHEDULER, spec, node_id=node_id)
        connector.set_xfer_handshake_metadata(sessions)
        return connector

    def _kv_node_spec(self, model: str):
        """The whole engine's K/V, as the connector names it to other engines: every layer and KV
        head, and how the ranks split them (each rank moves only its share)."""
        from global_prefix_cache.kv_layout import NodeSpec
        mc, pc, kv = self.model_config, self.config.parallel_config, self.model_executor.kv_cache_spec
        # What a block row stores: an 8-bit cache's dtype and its rows' length (head_dim + an inline scale for
        # the per-token-head modes), so two engines share K/V only if they store it alike.
        return NodeSpec(model, self.config.block_size, mc.num_hidden_layers, mc.num_key_value_heads, kv.row_dim,
                        str(kv.dtype).removeprefix("torch."), pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def kv_connector_stats(self) -> dict:
        """The connector's counters, the scheduler half's and every rank's together, and every
        rank's load times: {"connector": {...}, "load_seconds": [...]}."""
        from global_prefix_cache.connector import merge_stats
        if self.kv_connector is None:
            return {"connector": {}, "load_seconds": []}
        self.model_executor.wait_in_flight()
        ranks = self.model_executor.collective_rpc("get_kv_connector_stats")
        return {"connector": merge_stats(self.kv_connector.stats, *(r["stats"] for r in ranks)),
                "load_seconds": [t for r in ranks for t in r["load_seconds"]]}

    def validate_kv_transfer_params(self, params: dict | None) -> dict | None:
        """The canonical form of a request's kv_transfer_params, which the request must carry;
        ValueError if they are malformed or ask what this engine cannot do (no connector, a role
        that cannot, a prefill node of another model or block size)."""
        if params is None:
            return None
        if self.kv_connector is None:
            raise ValueError("kv_transfer_params given, but this engine has no kv_transfer_config "
                             "(LLM(..., kv_transfer_config={'kv_connector': ..., 'kv_role': ...}))")
        return self.kv_connector.validate_kv_transfer_params(params)

    def _take_kv_transfer_params(self, outputs: list[EngineCoreOutput]) -> dict[str, dict]:
        """What the requests that finished in `outputs` produced for another engine, taken once."""
        if self.kv_connector is None:
            return {}
        taken = ((o.request_id, self.kv_connector.take_kv_transfer_params(o.request_id))
                 for o in outputs if o.finish_reason is not None)
        return {req_id: params for req_id, params in taken if params is not None}

    def shutdown(self) -> None:
        """Stop the connector's servers and threads (leaves the pool) and the executor's workers;
        the engine is unusable after."""
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None
        if getattr(self, "model_executor", None) is not None:
            self.model_executor.shutdown()
        if getattr(self, "structured_output_manager", None) is not None:
            self.structured_output_manager.shutdown()

    def _determine_kv_cache_size(self, baseline: GPUMemorySnapshot | None) -> KVCacheReport:
        config = self.config
        spec = self.model_executor.kv_cache_spec          # one rank's: its heads, its layers
        bytes_per_block = spec.bytes_per_block
        max_model_len = self.model_config.max_model_len
        num_cpu_blocks = int(config.swap_space * GiB) // bytes_per_block if config.preemption_mode == "swap" else 0
        report = dict(block_size=config.block_size, bytes_per_block=bytes_per_block, max_model_len=max_model_len,
                      num_cpu_blocks=num_cpu_blocks)
        if config.num_gpu_blocks_override is not None:
            num_blocks = config.num_gpu_blocks_override
            if num_blocks * config.block_size < max_model_len:
                logger.warning("num_gpu_blocks_override=%d holds %d tokens < max_model_len=%d: longer requests "
                               "will fail", num_blocks, num_blocks * config.block_size, max_model_len)
            return KVCacheReport(num_blocks=num_blocks, how="num_gpu_blocks_override", **report)
        if baseline is not None:
            self.model_runner.profile_run()
            kv_bytes, how = gpu_kv_cache_bytes(baseline, config.gpu_memory_utilization, self.model_runner.device)
        else:
            kv_bytes = config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
            how = f"kv_cache_memory={kv_bytes / GiB:.2f} GiB"
        num_blocks = num_blocks_for_bytes(kv_bytes, bytes_per_block)
        check_enough_kv_cache_memory(num_blocks, config.block_size, max_model_len, bytes_per_block, kv_bytes)
        return KVCacheReport(num_blocks=num_blocks, how=how, **report)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request | EngineCoreRequest) -> None:
        """A scheduler Request, or the front end's EngineCoreRequest (vLLM's EngineCore takes
        that one: a core in another process is sent a message, not a scheduler object)."""
        if self.failure is not None:
            raise RuntimeError(f"the engine cannot run requests any more: {self.failure}")
        if isinstance(request, EngineCoreRequest):
            if request.kv_transfer_params is not None:      # (a front end in another process checked the form)
                self.validate_kv_transfer_params(request.kv_transfer_params)
            request = request.to_request()
        if self.config.async_scheduling and request.streaming_input:
            raise ValueError("streaming input cannot be combined with async_scheduling: the tokens a request "
                             "samples while its input is open are dropped, so its placeholders never resolve")
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[str]:
        """Finish requests from outside (abort, a stop string the front end found)."""
        finished = self.scheduler.finish_requests(request_ids, status)
        if self.kv_connector is not None:
            for req_id in finished:
                self.kv_connector.take_kv_transfer_params(req_id)     # nobody will ask for them
        if not self.scheduler.has_unfinished_requests():
            self._drain_if_idle()                 # async scheduling: nothing stays in flight for no request
        return finished

    def abort_requests(self, request_ids) -> list[str]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ speculative decoding (chapter 04)
    @property
    def spec_decoding_stats(self) -> SpecDecodeEngineStats | None:
        """Acceptance rate, mean acceptance length, per-position acceptance, drafting and
        verification time over the engine's life (None without speculative_config)."""
        return self._spec_decoding_stats

    def _update_draft_token_ids(self, runner_output: ModelRunnerOutput) -> None:
        """After update_from_output (vLLM: EngineCore.post_step): the drafts the runner proposed
        this step go to the scheduler, which schedules them next step as Δ = 1 + k (stale ones —
        finished, preempted, still prefilling — it drops)."""
        if self._spec_decoding_stats is None:
            return
        if runner_output.spec_decode is not None:
            self._spec_decoding_stats.observe_step(runner_output.spec_decode)
        self.scheduler.update_draft_token_ids(runner_output.draft_token_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pieces disagree (tests call it after steps and at the end):
        the scheduler's and the KV manager's own invariants, the runner knowing no request the
        scheduler has forgotten, and — with nothing left to run — every KV block free again."""
        self.scheduler.check_invariants()
        self.kv_cache_manager.check_invariants()
        self.model_executor.wait_in_flight()    # the runner's state is the worker thread's until then
        known = self.scheduler.get_known_request_ids()
        stale = set(self.model_runner.requests) - known if self.model_runner is not None else set()
        assert not stale, f"the model runner still holds requests the scheduler does not know: {sorted(stale)}"
        if not self.scheduler.has_unfinished_requests():
            kv = self.kv_cache_manager
            assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked"
            cpu = kv.cpu_block_pool
            assert cpu is None or kv.num_free_cpu_blocks == cpu.num_blocks, "CPU swap blocks leaked"
            if self.kv_connector is not None:
                pending = self.model_executor.collective_rpc("has_pending_kv_loads")
                assert not any(pending), "remote K/V still loading for no request"
        drafter = self.model_runner.spec_decode if self.model_runner is not None else None
        if drafter is not None:
            drafter.check_idle(known)

    # ------------------------------------------------------------------ the step
    def step(self) -> EngineCoreStep:
        """One step. A per-request fault (bad state, a forward pass or sampler that raises for one
        request, non-finite logits, a request the KV cache can never hold) finishes THAT request
        with an error message and frees its blocks; the others go on. step() itself raises only
        for faults of the engine (the scheduler's own bookkeeping)."""
        if self.batch_queue_size > 1:
            return self.step_with_batch_queue()
        start = time.monotonic()
        scheduler_output = self._schedule()
        try:
            runner_output = self.model_executor.execute_model(scheduler_output)
        except ExecutorError as e:
            return self._fail_all_requests(str(e), scheduler_output, start)
        return self._finish_step(scheduler_output, runner_output, start)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next batch, with its structured-output masks started: they are computed on
        the manager's thread while the model runs, and the runner waits for them only to sample
        (vLLM: EngineCore.step's get_grammar_bitmask between execute_model and sample_tokens)."""
        # Counted BEFORE scheduling: a grammar that becomes ready meanwhile must not make the idle
        # check below (_finish_step) mistake "still compiling" for "cannot be scheduled".
        self._num_waiting_for_grammar = self.scheduler.get_num_waiting_for_grammar()
        scheduler_output = self.scheduler.schedule()
        scheduler_output.grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
        return scheduler_output

    # ------------------------------------------------------------------ batches in flight
    def step_with_batch_queue(self) -> EngineCoreStep:
        """Up to batch_queue_size batches in flight (vLLM: step_with_batch_queue). Fill the queue:
        schedule a batch, send it (the executor returns at once), repeat while there is room and the
        batch was not empty; then wait for the OLDEST batch and apply its output. One call returns
        one batch's step. Which requests a batch holds is the scheduler's business
        (async_scheduler.py): other requests than the batches in flight (pipeline micro-batches), or
        the same ones with placeholders for their tokens in flight (async scheduling)."""
        while len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            start = time.monotonic()
            scheduler_output = self._schedule()
            try:
                future = self.model_executor.execute_model_async(scheduler_output)
            except ExecutorError as e:
                return self._fail_in_flight(str(e), scheduler_output, start)
            self.num_batches_overlapped += bool(self.batch_queue)
            self.batch_queue.append((scheduler_output, future, start))
            if scheduler_output.is_empty:
                break                                    # everyone schedulable is in flight already
        if not self.batch_queue:                         # nothing left at all: an empty step
            start = time.monotonic()
            scheduler_output = self._schedule()
            return self._finish_step(scheduler_output, self.model_executor.execute_model(scheduler_output), start)
        scheduler_output, future, start = self.batch_queue.popleft()
        try:
            runner_output = future.result()
        except ExecutorError as e:
            return self._fail_in_flight(str(e), scheduler_output, start)
        step = self._finish_step(scheduler_output, runner_output, start)
        step.outputs += self._drain_if_idle()
        return step

    def _drain_if_idle(self) -> list[EngineCoreOutput]:
        """When the last request has just finished, the batches still in flight hold only finished
        requests (their work is discarded). Take their outputs now, so that an idle engine has
        nothing in flight — nothing left for shutdown, check_invariants or the next request to trip
        over."""
        outputs: list[EngineCoreOutput] = []
        while self.batch_queue and not self.scheduler.has_unfinished_requests():
            scheduler_output, future, start = self.batch_queue.popleft()
            try:
                outputs += self.scheduler.update_from_output(scheduler_output, future.result())
            except ExecutorError as e:
                outputs += self._fail_in_flight(str(e), scheduler_output, start).outputs
        return outputs

    def _fail_in_flight(self, message: str, scheduler_output: SchedulerOutput, start: float) -> EngineCoreStep:
        """The executor failed: the batches still queued are dropped with it, every request fails."""
        self.batch_queue.clear()
        return self._fail_all_requests(message, scheduler_output, start)

    def _finish_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                     start: float) -> EngineCoreStep:
        """Apply one batch's output: tokens, stops, errors (the second half of a step)."""
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._update_draft_token_ids(runner_output)
        errors: dict[str, str] = {}
        for output in outputs:
            # FINISHED_ERROR (the runner failed it) and FINISHED_IGNORED (chapter 03: can never fit;
            # finish reason "length" with the KV manager's message) are reported as errors.
            if output.finish_reason == FinishReason.ERROR or (
                    output.finish_reason == FinishReason.LENGTH and isinstance(output.stop_reason, str)):
                errors[output.request_id] = output.stop_reason
        idle = (scheduler_output.is_empty and not scheduler_output.preempted_req_ids and not outputs
                and self.scheduler.get_request_counts()[0] == 0 and self.scheduler.has_unfinished_requests())
        if idle and self._num_waiting_for_grammar:
            self.structured_output_manager.wait_for_compiles(0.05)     # nothing to run until a grammar is ready
        elif (idle and not self.scheduler.get_num_waiting_for_remote_kvs()
                and not runner_output.invalid_block_ids):     # a failed remote load just went back to waiting
            raise RuntimeError(f"the scheduler could schedule none of {self.scheduler.get_num_unfinished_requests()} "
                               "waiting requests with an idle engine: this is a bug, not a full cache")
        return EngineCoreStep(scheduler_output, outputs, runner_output.logprobs, errors,
                              runner_output.prompt_logprobs, start, runner_output.spec_decode, self._take_kv_transfer_params(outputs))

    def _fail_all_requests(self, message: str, scheduler_output: SchedulerOutput, start: float) -> EngineCoreStep:
        """The executor cannot step any more: finish every request with `message` — the scheduled
        ones through update_from_output's failure path (their blocks freed, never cached: their K/V
        may be half written), the others directly — and refuse new requests from now on."""
        self.failure = message
        scheduled = list(scheduler_output.num_scheduled_tokens)
        failed_output = ModelRunnerOutput(scheduled, [[] for _ in scheduled], failed=dict.fromkeys(scheduled, message))
        outputs = self.scheduler.update_from_output(scheduler_output, failed_output)
        rest = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR)
        outputs += [EngineCoreOutput(req_id, [], FinishReason.ERROR, message, 0) for req_id in rest]
        errors = {o.request_id: message for o in outputs if o.finish_reason == FinishReason.ERROR}
        return EngineCoreStep(scheduler_output, outputs, errors=errors, start_time=start)
