"""AsyncLLM: the engine for a server — `generate()` is an async iterator of RequestOutputs.

Mirrors vLLM v1's `vllm/v1/engine/async_llm.py: AsyncLLM` (`generate`, `abort`,
`output_handler`) and `vllm/v1/engine/output_processor.py: RequestOutputCollector`:

    llm = AsyncLLM.from_engine_config(EngineConfig(max_num_seqs=64))
    async for out in llm.generate("The capital of France is", SamplingParams(max_tokens=16,
                                  output_kind=RequestOutputKind.DELTA), request_id="r1"):
        print(out.outputs[0].text, end="")

The engine core runs in its own process (AsyncMPClient); in this process one task — the output
handler — reads every output message, detokenizes it (OutputProcessor) and hands each request
its RequestOutput through that request's collector. Why a collector of one slot and not a
queue: a client that stops reading would make a queue grow without bound, and waiting for it
would stall every other request. The collector never blocks the handler: a DELTA output that
arrives before the previous one was read is merged into it (texts and tokens appended); other
kinds keep only the latest, which already contains everything.

Bad input raises in `generate()` before anything is queued (the same checks as LLMEngine,
through `LLMEngine.process_request`). Leaving the iterator early (the HTTP client went away, the
task was cancelled) aborts the request, which frees its KV blocks. A dead core process fails
every waiting generate() with EngineDeadError, and every later call at once.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from mini_vllm.beam_search import BeamSearch, BeamSearchParams
from mini_vllm.core_client import AsyncMPClient, EngineDeadError, step_from_outputs
from mini_vllm.engine_config import EngineConfig
from mini_vllm.engine_messages import EngineCoreOutputs, EngineCoreRequest
from mini_vllm.llm_engine import LLMEngine
from mini_vllm.lora_request import LoRARequest
from mini_vllm.metrics import IterationStats, LoggingStatLogger, PrometheusStatLogger
from mini_vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mini_vllm.processor import PromptType
from mini_vllm.router import CacheAwareRouter, LeastLoadedRouter, ReplicaView, RoundRobinRouter, Router
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class RequestOutputCollector:
    """One request's mailbox: at most one unread RequestOutput (or the error that ended it)."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(output, BaseException):
            self.output = output
        elif isinstance(self.output, RequestOutput):
            self.output = merge_delta(self.output, output) if self.aggregate else output
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


def merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two unread DELTA outputs of one request -> one (per completion index: text and tokens appended)."""
    merged = copy.copy(new)
    completions = {c.index: copy.copy(c) for c in old.outputs}
    for c in new.outputs:
        prev = completions.get(c.index)
        if prev is None:
            completions[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = list(prev.token_ids) + list(c.token_ids)
        if c.logprobs is not None:
            prev.logprobs = list(prev.logprobs or []) + list(c.logprobs)
        prev.cumulative_logprob, prev.finish_reason, prev.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                         c.stop_reason)
    merged.outputs = [completions[i] for i in sorted(completions)]
    return merged


def make_router(router: str | Router, block_size: int) -> Router:
    """A Router by name (the cache-aware one hashes prompts with chapter 02's chain hash), or as given."""
    if isinstance(router, Router):
        return router
    from kvcache.hashing import sha256_hash
    makers = {"round_robin": RoundRobinRouter, "least_loaded": LeastLoadedRouter,
              "cache_aware": lambda: CacheAwareRouter(block_size, sha256_hash)}
    if router not in makers:
        raise ValueError(f"router must be one of {sorted(makers)} or a Router, got {router!r}")
    return makers[router]()


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, served_model_name: str | None = None,
                 log_stats_interval: float | None = 10.0, data_parallel_size: int = 1,
                 router: str | Router = "cache_aware", chat_template: str | None = None) -> None:
        """log_stats_interval: seconds between vLLM's one-line stats logs (None: no log).
        data_parallel_size: engine cores (replicas), each in its own process with the whole model,
        behind `router` (router.py; vLLM: DPLBAsyncMPClient) — one front end for all of them."""
        if not isinstance(data_parallel_size, int) or isinstance(data_parallel_size, bool) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        # The front end: tokenizer, Processor, OutputProcessor; the core in its own process.
        self.engine = LLMEngine(config, asyncio_mode=True, chat_template=chat_template)
        self.engine_core: AsyncMPClient = self.engine.engine_core
        # Data parallelism: more cores, each started like the first; replica 0 is engine_core.
        self.core_clients: list[AsyncMPClient] = [self.engine_core]
        try:
            for _ in range(data_parallel_size - 1):
                self.core_clients.append(AsyncMPClient(config, self.engine.model_config))
        except BaseException:
            for client in self.core_clients:
                client.shutdown()
            raise
        self.replicas = [ReplicaView(i) for i in range(data_parallel_size)]
        self.router = make_router(router, config.block_size)
        self.replica_of: dict[str, int] = {}              # request id -> replica index, while unfinished
        self.route_log: deque[tuple[str, int, int]] = deque(maxlen=4096)   # (request id, replica, blocks matched)
        self.output_processor = self.engine.output_processor
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.served_model_name = served_model_name or self.model_config.model.name
        self.prometheus = PrometheusStatLogger(self.served_model_name, num_engines=data_parallel_size)
        self.log_stats = LoggingStatLogger()
        self.log_stats_interval = log_stats_interval
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.dead_error: EngineDeadError | None = None
        self._tasks: list[asyncio.Task] = []
        self._reqs_to_stop: list[str] = []              # stop strings found by the last _process

    @classmethod
    def from_engine_config(cls, config: EngineConfig, **kwargs) -> AsyncLLM:
        return cls(config, **kwargs)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or any(client.is_dead for client in self.core_clients)

    @property
    def data_parallel_size(self) -> int:
        return len(self.core_clients)

    def _route(self, request: EngineCoreRequest) -> int:
        """Which replica runs this request (one replica: 0; n > 1: all children, where the prefix
        cache shares their prompt). Logged, and counted per replica in /metrics
        (mini_vllm:dp_requests_routed_total{engine=...}), so the router's choices show."""
        if len(self.core_clients) == 1:
            index = 0
        else:
            index = self.router.select(request.prompt_token_ids, self.replicas)
            logger.info("request %s -> engine %d (%s, %d prefix blocks matched; loads %s)", request.request_id,
                        index, type(self.router).__name__, getattr(self.router, "last_match_blocks", 0),
                        [r.num_unfinished for r in self.replicas])
        self.replica_of[request.request_id] = index
        self.route_log.append((request.request_id, index, getattr(self.router, "last_match_blocks", 0)
                               if len(self.core_clients) > 1 else 0))
        self.replicas[index].num_unfinished += 1
        self.prometheus.record_routed(index)
        return index

    def _unroute(self, request_id: str) -> None:
        """Finished or aborted: no longer counted in its replica's load."""
        index = self.replica_of.pop(request_id, None)
        if index is not None:
            self.replicas[index].num_unfinished -= 1

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    # ------------------------------------------------------------------ requests
    def process_request(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams, *,
                        prompt_token_ids: list[int] | None = None, priority: int = 0,
                        kv_transfer_params: dict | None = None,
                        lora_request: LoRARequest | None = None) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenize, queue nothing: raises ValueError/TypeError on bad input. A server
        calls it for every prompt of a request before it starts answering (vLLM's serving layer
        likewise hands generate() a processed EngineCoreRequest). kv_transfer_params: chapter 06's
        remote K/V (prefill/decode disaggregation), as in LLMEngine.add_request; lora_request: the
        adapter it runs with (chapter 09)."""
        if request_id in self.collectors:
            raise ValueError(f"request id {request_id!r} is already running")
        return self.engine.process_request(request_id, prompt, sampling_params, priority=priority,
                                           prompt_token_ids=prompt_token_ids, kv_transfer_params=kv_transfer_params,
                                           lora_request=lora_request)

    async def generate(self, prompt: PromptType | EngineCoreRequest, sampling_params: SamplingParams | None,
                       request_id: str, *, prompt_token_ids: list[int] | None = None, priority: int = 0,
                       prompt_text: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """prompt: text, token ids, a dict — or an EngineCoreRequest from process_request (then
        sampling_params is ignored, and prompt_text is the text it came from)."""
        self._start_background_tasks()
        if self.errored:
            raise self._dead()
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
            if request.request_id != request_id or request_id in self.collectors:
                raise ValueError(f"request id {request_id!r}: already running, or not the EngineCoreRequest's")
        else:
            prompt_text, request = self.process_request(request_id, prompt, sampling_params,
                                                        prompt_token_ids=prompt_token_ids, priority=priority,
                                                        lora_request=lora_request)
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        self.collectors[request_id] = collector
        children = LLMEngine.fan_out(request)
        for child, parent, index in children:
            self.output_processor.add_request(child.request_id, prompt_text, child.prompt_token_ids,
                                              child.sampling_params, child.arrival_time, parent, index,
                                              child.lora_request)
        finished = False
        try:
            client = self.core_clients[self._route(request)]
            for child, _, _ in children:
                await client.add_request_async(child)
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            # Normal end: nothing to do. Early end (client gone, cancelled, engine dead): abort,
            # so the core frees the request's blocks now rather than when it would have finished.
            self.collectors.pop(request_id, None)
            if not finished:
                await asyncio.shield(self.abort(request_id))
            self._unroute(request_id)

    async def beam_search(self, prompt: PromptType, request_id: str, params: BeamSearchParams, *,
                          prompt_token_ids: list[int] | None = None,
                          lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """vLLM's online beam search (`vllm/entrypoints/generate/beam_search/online.py`): the rounds of
        beam_search.py, each round's one-token requests through `generate` at once; yields one finished
        RequestOutput whose completions are the best beams, best first (their generated tokens). Bad
        input raises before anything is queued; a round that fails ends the search with its error."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompt_text, probe = self.process_request(request_id, prompt, SamplingParams(max_tokens=1),
                                                  prompt_token_ids=prompt_token_ids, lora_request=lora_request)
        metrics = RequestMetrics(probe.arrival_time)
        search = BeamSearch(params, probe.prompt_token_ids, self.model_config.max_model_len,
                            frozenset(self.model_config.eos_token_ids))
        for round_index in itertools.count():
            if search.done:
                break
            finals = await asyncio.gather(*(self._final_output(f"{request_id}-beam{round_index}.{i}", ids,
                                                               search.request_params, lora_request)
                                            for i, ids in enumerate(search.requests())))
            search.advance([out.outputs[0] for out in finals])
        metrics.finished_time = time.monotonic()
        prompt_len = len(probe.prompt_token_ids)
        completions = [CompletionOutput(i, seq.text, seq.tokens[prompt_len:], seq.cum_logprob, None, seq.finish_reason,
                                        seq.stop_reason) for i, seq in enumerate(search.output(self.tokenizer).sequences)]
        yield RequestOutput(request_id, prompt_text, probe.prompt_token_ids, completions, True, metrics,
                            lora_request=probe.lora_request)

    async def _final_output(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                            lora_request: LoRARequest | None = None) -> RequestOutput:
        async for output in self.generate({"prompt_token_ids": prompt_token_ids}, params, request_id,
                                          lora_request=lora_request):
            if output.finished:
                return output
        raise RuntimeError(f"request {request_id} ended without a final output")

    async def abort(self, request_id: str) -> None:
        """Stop a request now (n > 1: every child); the core frees its KV blocks."""
        core_ids = self.output_processor.child_ids(request_id)
        self.output_processor.abort_requests([request_id])
        self.collectors.pop(request_id, None)
        if not self.errored:
            try:
                await self.core_clients[self.replica_of.get(request_id, 0)].abort_requests_async(core_ids)
            except (EngineDeadError, TimeoutError):
                pass                          # the core is gone: its blocks went with it

    # ------------------------------------------------------------------ LoRA adapters (chapter 09)
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and register an adapter (vLLM: AsyncLLM.add_lora); ValueError says why not."""
        return self.engine.add_lora(lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    async def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    async def check_invariants(self) -> None:
        """Every core's invariants, including: with nothing running, every KV block free (tests)."""
        for client in self.core_clients:
            await client.call_utility_async("check_invariants")

    async def reset_prefix_cache(self) -> bool:
        results = [await client.call_utility_async("reset_prefix_cache") for client in self.core_clients]
        return all(results)

    async def call_utility_all(self, method: str, *args) -> list:
        """`method` on every replica's core, in replica order (tests, the notebook)."""
        return [await client.call_utility_async(method, *args) for client in self.core_clients]

    def _dead(self) -> EngineDeadError:
        if self.dead_error is not None:
            return self.dead_error
        dead = [client for client in self.core_clients if client.is_dead]
        return (dead[0] if dead else self.engine_core)._dead_error()

    # ------------------------------------------------------------------ the output handler
    def _start_background_tasks(self) -> None:
        """Started on first use, inside the server's event loop (vLLM: _run_output_handler)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        for index, client in enumerate(self.core_clients):     # one reader per core (vLLM: one per DP rank's socket)
            self._tasks.append(loop.create_task(self._output_handler(client, index),
                                                name=f"AsyncLLM.output_handler[{index}]"))
        if self.log_stats_interval:
            self._tasks.append(loop.create_task(self._log_stats_loop(), name="AsyncLLM.log_stats"))

    async def start(self) -> None:
        self._start_background_tasks()

    async def _output_handler(self, client: AsyncMPClient | None = None, index: int = 0) -> None:
        client = client or self.engine_core
        try:
            while True:
                outputs = await client.get_output_async()
                self._process(outputs, index)
                reqs_to_stop = self._reqs_to_stop
                if reqs_to_stop:
                    await client.finish_requests_async(reqs_to_stop)
        except asyncio.CancelledError:
            raise
        except Exception as e:               # noqa: BLE001 - the engine is unusable: fail everyone, loudly
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(f"{type(e).__name__}: {e}")
            logger.error("engine core failed: %s", error)
            self.dead_error = error
            for collector in list(self.collectors.values()):
                collector.put(error)
            for other in self.core_clients:
                other.fail_pending_utilities(error)

    def _process(self, outputs: EngineCoreOutputs, index: int = 0) -> None:
        states = self.output_processor.request_states
        before = {}
        for core_output in outputs.outputs:
            state = states.get(core_output.request_id)
            if state is not None:
                is_child = state.index > 0          # n > 1: the prompt and the request count once, for child 0
                before[core_output.request_id] = (state, state.metrics.last_token_time, is_child,
                                                  len(core_output.new_token_ids))
        request_outputs, self._reqs_to_stop = self.output_processor.process_outputs(step_from_outputs(outputs))
        for output in request_outputs:
            collector = self.collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
        iteration = IterationStats()
        for request_id, (state, last_token_time, is_child, num_new) in before.items():
            m = state.metrics
            if request_id in outputs.errors:
                continue
            iteration.num_generation_tokens += num_new
            if last_token_time is None and m.first_token_time is not None:
                iteration.time_to_first_tokens.append(m.first_token_time - m.arrival_time)
                if not is_child:
                    iteration.num_prompt_tokens += len(state.prompt_token_ids)
            elif last_token_time is not None and m.last_token_time != last_token_time:
                iteration.inter_token_latencies.append(m.last_token_time - last_token_time)
            if m.finished_time is not None and request_id not in states and not is_child:
                iteration.e2e_latencies.append(m.finished_time - m.arrival_time)
        for output in request_outputs:        # one per request (n > 1: when its last child finished)
            reasons = [c.finish_reason for c in output.outputs if c.finish_reason is not None]
            if output.finished and reasons:
                iteration.finished_reasons.append(reasons[-1])
        self.prometheus.record(outputs.scheduler_stats, iteration, engine=index)
        self.log_stats.record(outputs.scheduler_stats, iteration)

    async def _log_stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_stats_interval)
            self.log_stats.log()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        for client in self.core_clients[1:]:
            client.shutdown()
        self.engine.shutdown()
