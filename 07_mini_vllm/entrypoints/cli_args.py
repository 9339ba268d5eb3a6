"""The server's command-line flags, vLLM's names (vLLM: `vllm/entrypoints/openai/cli_args.py`).
Apart from api_server.py so that `python -m mini_vllm --help` does not import the server."""
from __future__ import annotations

import argparse
import json


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """vLLM's server flags (vllm/entrypoints/openai/cli_args.py); the engine's come from cli.add_engine_args."""
    p.add_argument("model_tag", nargs="?", default=None, help="the model directory (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (vLLM's default is all interfaces; "
                                                      "here loopback unless asked)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients use in 'model' (default: the model directory's name)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    g.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats lines")
    g.add_argument("--uvicorn-log-level", default="warning")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each a core process with the whole model, behind one router")
    g.add_argument("--dp-router", default="cache_aware", choices=("cache_aware", "least_loaded", "round_robin"),
                   help="which replica gets a request (router.py); only with --data-parallel-size > 1")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    g.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters served by name (needs --enable-lora): name=path, or JSON "
                        '\'{"name": ..., "path": ...}\'; clients ask for one in \'model\'')


def lora_module(text: str) -> tuple[str, str]:
    """vLLM's --lora-modules entry: `name=path` or a JSON object with "name" and "path"."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
            return str(value["name"]), str(value["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f'a JSON LoRA module needs "name" and "path": {text!r}') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is name=path, got {text!r}")
    return name, path
