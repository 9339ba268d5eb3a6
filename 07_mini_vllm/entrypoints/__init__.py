"""The OpenAI-compatible server over AsyncLLM (vLLM: `vllm/entrypoints/openai/`): `api_server.py`
builds the FastAPI app, `protocol.py` holds the request/response schemas,
`serving_completion.py` / `serving_chat.py` turn requests into SamplingParams and outputs into
OpenAI responses and SSE streams, `serving_engine.py` holds what both share (errors, the model
check, token limits, disconnects)."""
