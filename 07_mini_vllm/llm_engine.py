"""LLMEngine: text in, streamed text out, one `step()` at a time.

Mirrors vLLM v1's `vllm/v1/engine/llm_engine.py: LLMEngine` (`add_request`, `step`,
`abort_request`, `has_unfinished_requests`): the Processor validates and tokenizes, the
EngineCore schedules and runs the model, the OutputProcessor detokenizes and builds
RequestOutputs. By default the core is a plain object in this process (`InprocClient`), so a
step is a function call; with VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's default) it runs in its
own process (`core_proc.py`) and a step is a message over ZMQ (`SyncMPClient`) — same division
of labour, same outputs.

    engine = LLMEngine(EngineConfig(max_num_seqs=8))
    engine.add_request("a", "The capital of France is", SamplingParams(max_tokens=20))
    while engine.has_unfinished_requests():
        for out in engine.step():                # CUMULATIVE by default: the text so far, every step
            print(out.request_id, out.outputs[0].text)

Remote K/V (chapter 06): with `kv_transfer_config` a request may carry `kv_transfer_params`
(vLLM's name) — {"do_remote_decode": True} on a prefill node, whose finished RequestOutput
then carries the params for the decode node's request.

Bad input raises in `add_request` before any state changes. A request that fails inside a
step (non-finite logits, can never fit in the KV cache) comes back finished with
finish_reason "error" while the others continue.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from scheduler import RequestStatus

from mini_vllm.config import ModelConfig, read_default_sampling_params
from mini_vllm.core import EngineCoreStep
from mini_vllm.core_client import make_client, multiprocessing_enabled
from mini_vllm.engine_config import EngineConfig
from mini_vllm.engine_messages import EngineCoreRequest
from mini_vllm.lora_request import LoRARegistry, LoRARequest
from mini_vllm.output_processor import OutputProcessor
from mini_vllm.outputs import RequestOutput
from mini_vllm.parallel_sampling import ParentRequest
from mini_vllm.processor import Processor, PromptType
from mini_vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, multiprocess_mode: bool | None = None,
                 asyncio_mode: bool = False, chat_template: str | None = None, **kwargs):
        """multiprocess_mode: the engine core in its own process (core_proc.py) instead of this one;
        None reads VLLM_ENABLE_V1_MULTIPROCESSING (default 0 here, 1 in vLLM).
        asyncio_mode: AsyncLLM's front end — the core is reached through an AsyncMPClient, which
        AsyncLLM drives; this object then only validates (process_request) and detokenizes (its
        OutputProcessor), and its blocking step() is not available.
        chat_template: a Jinja template (or a file holding one) instead of the tokenizer's (vLLM's --chat-template)."""
        if config is not None and kwargs:
            raise ValueError("pass either an EngineConfig or keyword arguments, not both")
        if chat_template is not None and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text()
        self.config = config if config is not None else EngineConfig(**kwargs)
        if self.config.model is not None:
            model_path = Path(self.config.model).expanduser()
        else:
            from mini_vllm.default_model import default_model_path
            model_path = default_model_path()
        self.model_config = ModelConfig.from_pretrained(model_path, dtype=self.config.dtype,
                                                        max_model_len=self.config.max_model_len,
                                                        quantization=self.config.quantization,
                                                        kv_cache_dtype=self.config.kv_cache_dtype)
        self.tokenizer = load_tokenizer(self.config.tokenizer or model_path)
        self.processor = Processor(self.model_config, self.tokenizer, self.config.max_logprobs, chat_template,
                                   self.config.structured_outputs_config["backend"])
        self.loras = LoRARegistry(self.config.enable_lora, self.config.max_lora_rank)     # chapter 09
        self.default_sampling_params = self._read_generation_config(model_path)
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled() or asyncio_mode
        self.engine_core = make_client(self.config, self.model_config, multiprocess_mode, asyncio_mode)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_step: EngineCoreStep | None = None       # for tracing (the notebook)

    def _read_generation_config(self, model_path: Path) -> dict:
        """The defaults `generation_config` names (vLLM: ModelConfig.get_diff_sampling_param), said
        once at start-up as vLLM does, so nobody wonders why temperature 1 samples at 0.6."""
        source = self.config.generation_config
        if source == "vllm":
            return {}
        diff = read_default_sampling_params(model_path if source == "auto" else Path(source))
        if diff:
            logger.warning("default sampling parameters from %s: %s (explicit SamplingParams override them; "
                           "generation_config='vllm' ignores them)",
                           "the model's generation_config.json" if source == "auto" else source, diff)
        return diff

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams for requests that bring none: the generation config's fields over
        SamplingParams' defaults (vLLM: LLM.get_default_sampling_params)."""
        return SamplingParams(**self.default_sampling_params)

    @property
    def kv_cache_report(self):
        return self.engine_core.kv_cache_report

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0,
                    prompt_token_ids: list[int] | None = None, kv_transfer_params: dict | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate, tokenize and queue one request. Raises (changing nothing) on bad input.

        prompt_token_ids: the ids of `prompt` when the caller tokenized it already (LLM.generate
        tokenizes a whole batch before adding any of it); they are validated again here.
        n > 1: the request goes to the engine core as n child requests (parallel_sampling.py)."""
        prompt, request = self.process_request(request_id, prompt, params, arrival_time=arrival_time,
                                               priority=priority, prompt_token_ids=prompt_token_ids,
                                               kv_transfer_params=kv_transfer_params, lora_request=lora_request)
        for child, parent, index in self.fan_out(request):
            self.output_processor.add_request(child.request_id, prompt, child.prompt_token_ids,
                                              child.sampling_params, child.arrival_time, parent, index,
                                              child.lora_request)
            self.engine_core.add_request(child)

    @staticmethod
    def fan_out(request: EngineCoreRequest) -> list[tuple[EngineCoreRequest, ParentRequest | None, int]]:
        """The engine core's requests for one user request: itself, or with n > 1 its n children
        (vLLM's LLMEngine.add_request: ParentRequest.get_child_info) -> [(request, parent, index)]."""
        params = request.sampling_params
        if params.n == 1:
            return [(request, None, 0)]
        parent = ParentRequest(request.request_id, params)
        children = []
        for index in range(params.n):
            child_id, child_params = parent.get_child_info(index)
            children.append((dataclasses.replace(request, request_id=child_id, sampling_params=child_params),
                             parent, index))
        return children

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                        arrival_time: float | None = None, priority: int = 0,
                        prompt_token_ids: list[int] | None = None, kv_transfer_params: dict | None = None,
                        lora_request: LoRARequest | None = None) -> tuple[str | None, EngineCoreRequest]:
        """Every check of add_request, nothing queued -> (the prompt text or None, the core's
        message). AsyncLLM validates through here too, so both front ends refuse the same input."""
        params = params if params is not None else self.get_default_sampling_params()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        running = self.output_processor.request_states
        if request_id in self.output_processor.parents or request_id in running:
            raise ValueError(f"request id {request_id!r} is already running")
        taken = [i for i in self._core_ids(request_id, params) if i in running]
        if taken:
            raise ValueError(f"request id {request_id!r}: its children's ids {taken[:3]} are in use")
        if prompt_token_ids is None:
            prompt, prompt_token_ids = self.processor.process_inputs(prompt, params)
        else:   # ids from a caller: validated like any other prompt (one bad id would fail every step)
            prompt_token_ids = self.processor.validate(prompt_token_ids, params)
        params = self.processor.prepare_params(params)
        kv_transfer_params = self.engine_core.validate_kv_transfer_params(kv_transfer_params)
        if kv_transfer_params is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be combined with kv_transfer_params: K/V loaded from another "
                             "engine comes without the logits the prompt's logprobs need")
        lora_request = self.loras.check(lora_request)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        return prompt if isinstance(prompt, str) else None, self.make_core_request(
            request_id, prompt_token_ids, params, arrival_time, priority, kv_transfer_params, lora_request)

    @staticmethod
    def _core_ids(request_id: str, params) -> list[str]:
        """The ids the engine core would know this request by."""
        n = getattr(params, "n", 1)
        return [request_id] if n == 1 else ParentRequest(request_id, params).child_ids

    def make_core_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          arrival_time: float, priority: int = 0, kv_transfer_params: dict | None = None,
                          lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """The message for the engine core (validated ids, prepared params). AsyncLLM builds the
        same one, through the same code."""
        eos_ids = self.model_config.eos_token_ids
        return EngineCoreRequest(
            request_id, prompt_token_ids, params, arrival_time, priority,
            eos_token_id=eos_ids[0] if eos_ids else None,
            # Chat models list more than one EOS (generation_config.json): all of them stop, as in HF
            # generate and vLLM — unless ignore_eos.
            stop_token_ids=list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids[1:])),
            kv_transfer_params=kv_transfer_params, lora_request=lora_request)

    # ------------------------------------------------------------------ LoRA adapters (chapter 09)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and register an adapter before any request uses it (vLLM: LLMEngine.add_lora); the
        model runner loads its weights with the first request that runs it."""
        return self.loras.check(lora_request) is not None

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (False: unknown); ValueError while a running request uses it."""
        in_use = any(s.lora_request is not None and s.lora_request.lora_int_id == lora_int_id
                     for s in self.output_processor.request_states.values())
        return self.loras.remove(lora_int_id, in_use)

    def list_loras(self) -> set[int]:
        return set(self.loras.by_id)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests now (with n > 1: every child); their KV blocks are freed at once."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        core_ids = [c for r in request_ids for c in self.output_processor.child_ids(r)]
        self.engine_core.abort_requests(core_ids)
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, run the model, sample, detokenize. Returns the outputs of
        this step (per each request's output kind)."""
        step = self.engine_core.get_output()
        self.last_step = step
        outputs, reqs_to_stop = self.output_processor.process_outputs(step)
        if reqs_to_stop:                                     # stop strings: the scheduler frees them now
            self.engine_core.finish_requests(reqs_to_stop, RequestStatus.FINISHED_STOPPED)
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False, changing nothing, while a request holds blocks."""
        return self.engine_core.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        """Release what outlives a step: the KV connector's servers and threads, the executor's
        workers; the core's process when it has one."""
        self.engine_core.shutdown()

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                            chat_template_kwargs: Mapping | None = None) -> tuple[str, list[int]]:
        return self.processor.chat_to_token_ids(messages, add_generation_prompt, chat_template_kwargs)
