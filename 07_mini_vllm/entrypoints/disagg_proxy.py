"""Prefill/decode disaggregation over HTTP: a proxy in front of a prefill server and a decode server.

Mirrors vLLM's `examples/online_serving/disaggregated_serving/` proxy (and the shape of its
`disagg_proxy_demo.py`): every completion or chat request goes twice —

  1. to the prefill server with `kv_transfer_params={"do_remote_decode": true}`, one token, no
     stream: it computes the prompt's K/V, stages it for the decode server (chapter 06's connector,
     kv_role kv_producer) and answers with the `kv_transfer_params` that say where it waits;
  2. to the decode server with those `kv_transfer_params`: it loads the prompt's K/V instead of
     computing it (kv_role kv_consumer) and generates the answer, streamed or not, which the proxy
     hands back as it comes.

    python -m mini_vllm serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "GlobalKVPoolConnector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"metadata_server": "127.0.0.1:5555"}}'
    python -m mini_vllm serve MODEL --port 8200 --kv-transfer-config '{..., "kv_role": "kv_consumer", ...}'
    python -m mini_vllm disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

An error of the prefill server (a bad request: 400) is the client's answer; the decode server is
then never asked.
"""
from __future__ import annotations

import copy
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("mini_vllm.disagg_proxy")


def prefill_body(body: dict, chat: bool) -> dict:
    """The request the prefill server gets: one token, not streamed, its K/V kept for a decode server."""
    body = copy.deepcopy(body)
    body["kv_transfer_params"] = {"do_remote_decode": True}
    body["stream"] = False
    body.pop("stream_options", None)
    body["max_completion_tokens" if chat else "max_tokens"] = 1
    if chat:
        body.pop("max_tokens", None)
    body["n"] = 1
    return body


def build_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    import httpx2 as httpx           # the HTTP client the openai package ships with

    client = httpx.AsyncClient(timeout=timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(lifespan=lifespan)

    async def forward(raw_request: Request, path: str, chat: bool):
        body = json.loads(await raw_request.body())
        headers = {k: v for k, v in raw_request.headers.items() if k.lower() == "authorization"}
        prefill = await client.post(prefill_url + path, json=prefill_body(body, chat), headers=headers)
        if prefill.status_code != 200:
            return Response(prefill.content, status_code=prefill.status_code, media_type="application/json")
        body["kv_transfer_params"] = prefill.json().get("kv_transfer_params")
        if not body.get("stream"):
            decode = await client.post(decode_url + path, json=body, headers=headers)
            return JSONResponse(decode.json(), status_code=decode.status_code)

        async def stream():
            async with client.stream("POST", decode_url + path, json=body, headers=headers) as decode:
                async for chunk in decode.aiter_raw():
                    yield chunk
        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(raw_request: Request):
        return await forward(raw_request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request):
        return await forward(raw_request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models():
        return JSONResponse((await client.get(decode_url + "/v1/models")).json())

    @app.get("/health")
    async def health():
        for url in (prefill_url, decode_url):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    return app


def run_proxy(args) -> None:
    import uvicorn

    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
