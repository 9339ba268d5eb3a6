"""What the completion and chat endpoints share (vLLM: `vllm/entrypoints/openai/serving_engine.py:
OpenAIServing` — `create_error_response`, `_check_model`, `_validate_input`; and
`vllm/entrypoints/utils.py: with_cancellation`, `vllm/utils: merge_async_iterators`).

Error policy (the issue's "never a 500, never a disturbed neighbour"): everything a client can
get wrong is found here or in the engine's Processor BEFORE a request is queued, and answered
with OpenAI's error body and vLLM's status — 400 bad request, 404 unknown model; a dead engine
core is 503. Nothing that is queued can fail another request: each request has its own
collector in AsyncLLM, and leaving early aborts only it.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from mini_vllm.async_llm import AsyncLLM
from mini_vllm.beam_search import BeamSearchParams
from mini_vllm.core_client import EngineDeadError
from mini_vllm.entrypoints.protocol import ErrorInfo, ErrorResponse
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class OpenAIError(Exception):
    """An error a client caused (or a dead engine), answered with its status and OpenAI's body."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


_ERROR_TYPES = {HTTPStatus.BAD_REQUEST: "BadRequestError", HTTPStatus.UNAUTHORIZED: "AuthenticationError",
                HTTPStatus.NOT_FOUND: "NotFoundError", HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
                HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError"}


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, status.phrase),
                                         param=param, code=int(status))).model_dump()


def error_response(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=int(status))


def sse(data: dict | str) -> str:
    """One server-sent event, as OpenAI streams them."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def parse_body(raw_request: Request, model: type[BaseModel]) -> BaseModel:
    """Malformed JSON or a field of the wrong type -> 400 naming what is wrong (not FastAPI's 422)."""
    try:
        body = json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise OpenAIError(f"{where}: {first['msg']} ({e.error_count()} error(s) in the request)",
                          param=where) from None


def structured_outputs_params(req) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` body field, or OpenAI's `response_format` (vLLM:
    ChatCompletionRequest.to_sampling_params): json_object -> any JSON object, json_schema -> its
    schema; "text" -> none. Both at once -> 400 (vLLM refuses that too)."""
    fmt = req.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        if req.structured_outputs is not None:
            raise OpenAIError("give response_format or structured_outputs, not both", param="response_format")
        kind = fmt.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise OpenAIError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                                  param="response_format")
            return StructuredOutputsParams(json=schema)
        raise OpenAIError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          param="response_format")
    if req.structured_outputs is None:
        return None
    try:
        return StructuredOutputsParams(**req.structured_outputs)
    except TypeError as e:
        raise OpenAIError(f"structured_outputs: {e}", param="structured_outputs") from None


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, models):
        """models: the names clients may ask for (serving_models.py: the base model, LoRA adapters)."""
        self.engine = engine
        self.models = models
        self.max_model_len = engine.model_config.max_model_len
        self.tokenizer = engine.tokenizer
        self.defaults = engine.engine.default_sampling_params      # the model's generation_config.json

    def check_model(self, model: str | None) -> None:
        """404 for a name that is neither the base model nor a served LoRA adapter."""
        self.models.lora_request_for(model)

    def model_name(self, req) -> str:
        """The `model` a response names: the adapter's name, or the base model's."""
        return self.models.model_name(self.models.lora_request_for(req.model))

    def check_alive(self) -> None:
        if self.engine.errored:
            raise OpenAIError(f"the engine is not running: {self.engine._dead()}", HTTPStatus.SERVICE_UNAVAILABLE)

    def max_tokens_for(self, requested: int | None, prompt_len: int) -> int:
        """vLLM's rule: an explicit max_tokens must fit beside the prompt; none means 'up to the context'."""
        if prompt_len >= self.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                              f"prompt has {prompt_len} tokens. Please reduce the length of the prompt.",
                              param="prompt")
        if requested is None:
            return self.max_model_len - prompt_len
        if not isinstance(requested, int) or requested < 1:
            raise OpenAIError(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if prompt_len + requested > self.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, {requested} "
                              "in the completion). Please reduce the length of the messages or completion.",
                              param="max_tokens")
        return requested

    def sampling_params(self, req, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's fields over the model's generation_config defaults over SamplingParams'
        (vLLM: to_sampling_params with default_sampling_params). ValueError -> 400."""
        d = self.defaults

        def pick(name, fallback):
            value = getattr(req, name)
            return value if value is not None else d.get(name, fallback)

        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of is not supported here (only best_of == n)", param="best_of")
        try:
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()} if req.logit_bias else None
        except ValueError:
            raise OpenAIError("logit_bias keys must be token ids", param="logit_bias") from None
        try:
            return SamplingParams(          # (beam search: n is its width, each beam's request samples one)
                n=1 if req.use_beam_search else req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", -1),
                min_p=pick("min_p", 0.0), seed=req.seed, max_tokens=max_tokens, stop=req.stop or None,
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=pick("repetition_penalty", 1.0), min_tokens=req.min_tokens,
                logit_bias=logit_bias, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured_outputs_params(req),
                output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e)) from None

    def process(self, request_id: str, prompt_text: str | None, prompt_ids: list[int], params: SamplingParams,
                req) -> "EngineJob":
        """The engine's own validation (vocabulary, length, parameters, kv_transfer_params) -> 400 on
        failure; nothing is queued. With use_beam_search, the search's n beams (AsyncLLM.beam_search,
        vLLM's online beam search)."""
        lora_request = self.models.lora_request_for(req.model)
        try:
            if req.use_beam_search:
                if req.kv_transfer_params is not None:
                    raise ValueError("use_beam_search cannot be combined with kv_transfer_params: each beam is a "
                                     "request of its own (vLLM's beam search runs in the front end)")
                beam = BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                        length_penalty=req.length_penalty,
                                        include_stop_str_in_output=params.include_stop_str_in_output)
                prompt_text, _ = self.engine.process_request(request_id, prompt_text if prompt_text is not None
                                                             else prompt_ids, SamplingParams(max_tokens=1),
                                                             prompt_token_ids=prompt_ids, lora_request=lora_request)
                return EngineJob(request_id, prompt_text, None, beam, prompt_ids, lora_request)
            prompt_text, core_request = self.engine.process_request(
                request_id, prompt_text if prompt_text is not None else prompt_ids, params, prompt_token_ids=prompt_ids,
                priority=req.priority, kv_transfer_params=req.kv_transfer_params, lora_request=lora_request)
            return EngineJob(request_id, prompt_text, core_request)
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e)) from None

    def generate(self, job: "EngineJob") -> AsyncIterator:
        """The job's RequestOutputs (a beam search: one, finished, its beams as completions)."""
        if job.beam is not None:
            return self.engine.beam_search(job.prompt_ids, job.request_id, job.beam, prompt_token_ids=job.prompt_ids,
                                           lora_request=job.lora_request)
        return self.engine.generate(job.core_request, None, job.request_id, prompt_text=job.prompt_text)


@dataclass
class EngineJob:
    """One engine request the server validated: an EngineCoreRequest, or a beam search's parameters."""
    request_id: str
    prompt_text: str | None
    core_request: object
    beam: BeamSearchParams | None = None
    prompt_ids: list[int] | None = None
    lora_request: object = None            # a beam search's adapter (a core request carries its own)


def engine_error(e: BaseException) -> OpenAIError:
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"the engine is not running: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
    return OpenAIError(f"{type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, object]]:
    """(index, item) from several async iterators as items come (vLLM: vllm.utils.merge_async_iterators).
    One pending __anext__ per iterator, so nothing is pulled faster than it is consumed; leaving
    early cancels them all (each generator's cleanup aborts its request)."""
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(iterators[i].__anext__())] = i
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()


async def listen_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_cancellation(coro, raw_request: Request):
    """Run a non-streaming handler, cancelled if the client hangs up first (vLLM: with_cancellation):
    the cancellation reaches AsyncLLM.generate, which aborts the request and frees its blocks."""
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(listen_for_disconnect(raw_request))
    try:
        await asyncio.wait([handler, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (handler, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(handler, watcher, return_exceptions=True)
    if handler.cancelled():
        return None
    return handler.result()


def sse_error(e: BaseException) -> str:
    """An error after a stream has started (its 200 and headers are sent): reported in-band as
    one SSE event, OpenAI's error body — 400 for the request's own fault, the engine's status
    (503 when the core died) otherwise."""
    if isinstance(e, OpenAIError):
        return sse({"error": {"message": e.message, "type": "BadRequestError", "param": e.param,
                              "code": int(e.status)}})
    err = engine_error(e)
    return sse({"error": {"message": err.message, "type": "ServiceUnavailableError", "param": None,
                          "code": int(err.status)}})

