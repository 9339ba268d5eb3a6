"""The OpenAI-compatible HTTP server: `python -m mini_vllm serve [model] --port 8000`.

Mirrors vLLM's `vllm/entrypoints/openai/api_server.py` (`build_app`, `run_server`, the routes,
the API-key middleware, the exception handlers) over `AsyncLLM`:

    POST /v1/completions        serving_completion.py (text or token prompts, n, logprobs, SSE)
    POST /v1/chat/completions   serving_chat.py (the model's chat template)
    GET  /v1/models             the served model name(s), and each LoRA adapter (serving_models.py)
    POST /v1/load_lora_adapter  {"lora_name", "lora_path"}: serve another adapter by name; with
    POST /v1/unload_lora_adapter  VLLM_ALLOW_RUNTIME_LORA_UPDATING=true only, as in vLLM
    GET  /health                200 while the engine core is alive, 503 once it is not
    GET  /version               this package's version
    GET  /metrics               Prometheus text format, vLLM's metric names (metrics.py)

    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'

With --api-key every /v1 route needs `Authorization: Bearer <key>` (401 otherwise); /health,
/version and /metrics stay open, as in vLLM. Statuses: 400 for anything wrong in a request
(malformed JSON, wrong types, unknown parameters' values, too long, out-of-vocabulary ids),
404 for an unknown model, 503 once the engine core is dead.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mini_vllm.async_llm import AsyncLLM
from mini_vllm.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest,
                                            UnloadLoRAAdapterRequest)
from mini_vllm.entrypoints.serving_chat import OpenAIServingChat
from mini_vllm.entrypoints.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.serving_engine import OpenAIError, error_response, parse_body, with_cancellation
from mini_vllm.entrypoints.serving_models import OpenAIServingModels, runtime_lora_updating_allowed
from mini_vllm.gc_utils import freeze_gc_heap

logger = logging.getLogger("mini_vllm.api_server")


def package_version() -> str:
    try:
        return version("vllm-from-scratch")
    except PackageNotFoundError:
        return "unknown"


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              shutdown_engine: bool = True, lora_modules: list[tuple[str, str]] | None = None) -> FastAPI:
    """shutdown_engine: stop the engine (its core process) when the app stops. lora_modules: (name,
    path) adapters served from the start (--lora-modules; needs enable_lora)."""
    models = OpenAIServingModels(engine, served_model_names, lora_modules)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()                 # the output handler runs in uvicorn's event loop
        try:
            yield
        finally:
            if shutdown_engine:
                engine.shutdown()

    app = FastAPI(lifespan=lifespan)
    completion = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models)

    @app.middleware("http")
    async def authentication(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1") and request.method != "OPTIONS":
            if request.headers.get("Authorization") != f"Bearer {api_key}":
                return error_response("Unauthorized: a valid API key is required (Authorization: Bearer ...)",
                                      HTTPStatus.UNAUTHORIZED)
        return await call_next(request)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, e: OpenAIError):
        return error_response(e.message, e.status, e.param)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(f"the engine is not running: {engine._dead()}", HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    @app.get("/version")
    async def show_version():
        return {"version": package_version()}

    @app.get("/v1/models")
    async def show_models():
        return models.show_available_models().model_dump()

    if runtime_lora_updating_allowed():
        logger.warning("runtime LoRA updating is on: clients may load adapters from any path this server reads")

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw_request: Request):
            req = await parse_body(raw_request, LoadLoRAAdapterRequest)
            return PlainTextResponse(models.load_lora_adapter(req.lora_name, req.lora_path))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw_request: Request):
            req = await parse_body(raw_request, UnloadLoRAAdapterRequest)
            return PlainTextResponse(models.unload_lora_adapter(req.lora_name))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.prometheus.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request):
        req = await parse_body(raw_request, CompletionRequest)
        request_id, prepared, lengths = completion.prepare(req)
        if req.stream:
            return StreamingResponse(completion.completion_stream_generator(req, request_id, prepared, lengths),
                                     media_type="text/event-stream")
        body = await with_cancellation(completion.create_completion(req, request_id, prepared, lengths),
                                       raw_request)
        return JSONResponse(body) if body is not None else Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request):
        req = await parse_body(raw_request, ChatCompletionRequest)
        request_id, job, prompt_len = chat.prepare(req)
        if req.stream:
            return StreamingResponse(chat.chat_completion_stream_generator(req, request_id, job, prompt_len),
                                     media_type="text/event-stream")
        body = await with_cancellation(chat.chat_completion_full_generator(req, request_id, job, prompt_len),
                                       raw_request)
        return JSONResponse(body) if body is not None else Response(status_code=499)

    return app


# ------------------------------------------------------------------------------ the command
def run_server(args, engine_config) -> None:
    import uvicorn

    engine = AsyncLLM(engine_config, served_model_name=(args.served_model_name or [None])[0],
                      log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
                      data_parallel_size=getattr(args, "data_parallel_size", 1),
                      router=getattr(args, "dp_router", "cache_aware"),
                      chat_template=getattr(args, "chat_template", None))
    names = args.served_model_name or [engine.served_model_name]
    app = build_app(engine, names, args.api_key, lora_modules=getattr(args, "lora_modules", None))
    freeze_gc_heap()                         # this process's start-up heap too (gc_utils.py)
    logger.info("serving %s on http://%s:%d (engine core pid(s) %s%s)", names, args.host, args.port,
                [client.pid for client in engine.core_clients],
                f", {type(engine.router).__name__}" if engine.data_parallel_size > 1 else "")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()                    # idempotent: also when uvicorn failed to bind

