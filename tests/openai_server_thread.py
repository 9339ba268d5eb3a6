"""uvicorn serving build_app(AsyncLLM) in a thread of the test process (tests of chapter 07's server and
of what later chapters add to it: LoRA adapters by name)."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

API_KEY = "test-key"
NAME = "tiny"


class ServerThread:
    """uvicorn serving build_app(AsyncLLM) in a thread, on a socket bound before it starts (no port race)."""

    def __init__(self, model_dir, api_key: str | None = API_KEY, data_parallel_size: int = 1,
                 lora_modules: list[tuple[str, str]] | None = None, **engine_kwargs):
        import uvicorn

        from mini_vllm.async_llm import AsyncLLM
        from mini_vllm.engine_config import EngineConfig
        from mini_vllm.entrypoints.api_server import build_app

        config = EngineConfig(model=str(model_dir), **{"max_model_len": 256, "num_gpu_blocks_override": 128,
                                                       **engine_kwargs})
        self.engine = AsyncLLM(config, served_model_name=NAME, log_stats_interval=None,
                               data_parallel_size=data_parallel_size)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(self.engine, [NAME], api_key, lora_modules=lora_modules)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    def call(self, coro, timeout: float = 30):
        """Run a coroutine in the server's event loop (the engine's utility calls live there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_idle(self, timeout: float = 15) -> None:
        """Every request gone from the front end, then the core's check: every KV block free."""
        deadline = time.monotonic() + timeout
        while self.engine.output_processor.has_unfinished_requests() or self.engine.collectors:
            assert time.monotonic() < deadline, f"requests left: {list(self.engine.collectors)}"
            time.sleep(0.05)
        self.call(self.engine.check_invariants())

    def stop(self):
        self.server.should_exit = True
        self.thread.join(20)
        pids = [client.pid for client in self.engine.core_clients]
        self.engine.shutdown()
        self.sock.close()
        assert not self.thread.is_alive()
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "an engine core outlived the server"
