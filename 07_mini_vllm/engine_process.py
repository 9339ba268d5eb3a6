"""This chapter's engine as a node of chapter 06's global prefix cache: an LLMEngine with a KV
connector, in its own OS process (`EngineProcess`) or in this one, driven request by request
(`run_requests`) with a trace of the two counters. The benchmark (benchmarks/bench_global_pool.py)
and the tests (tests/integration/test_kv_connector_*.py) use it to show the connector in the
engine: a remote prefix hit and a prefill/decode split on a real model.

The process plumbing is the `processes` package's (`ChildProcess`, `serve_commands`); the engine
module is preloaded into its forkserver through `EngineProcess.preload`.

    with EngineProcess(kv_transfer_config={...}, max_model_len=512) as p:      # the prefill node
        rp, = p.generate([{"request_id": "r", "prompt_token_ids": ids, "max_tokens": 1,
                           "kv_transfer_params": {"do_remote_decode": True}}])
    # on the decode node: prompt + rp["token_ids"], kv_transfer_params=rp["kv_transfer_params"]
"""
from __future__ import annotations

import os
import time
from typing import Any

from processes import ChildProcess, serve_commands
from mini_vllm.sampling_params import SamplingParams


def run_requests(engine, requests: list[dict], timeout: float = 120.0, on_step=None) -> list[dict]:
    """Add `requests` to an LLMEngine and step it until all finish (greedy). Each request:
    {"request_id", "prompt_token_ids", "max_tokens", "kv_transfer_params" (optional),
    "ignore_eos" (default True: fixed lengths compare token for token)}.

    Returns one dict per request: token_ids, finish_reason, kv_transfer_params (what it
    produced), ttft_s, num_cached_tokens (local + remote hit), external_tokens (loaded from
    another node; 0 if the load failed), failed_load (the reason, or ""), and trace — after
    each step it was alive: (status, num_computed_tokens, tokens computed in that step).
    `on_step(i)`, if given, runs after step i (a test injects a fault between two steps)."""
    core = engine.engine_core
    connector = core.kv_connector          # the scheduler half: what each request was planned to load
    results: dict[str, dict[str, Any]] = {}
    for spec in requests:
        rid = spec["request_id"]
        params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8),
                                ignore_eos=spec.get("ignore_eos", True))
        engine.add_request(rid, list(spec["prompt_token_ids"]), params,
                           kv_transfer_params=spec.get("kv_transfer_params"))
        results[rid] = {"request_id": rid, "prompt_len": len(spec["prompt_token_ids"]), "trace": [],
                        "external_tokens": 0, "failed_load": ""}
    deadline = time.monotonic() + timeout
    pending = set(results)
    num_steps = 0
    while pending:
        if time.monotonic() > deadline:
            engine.abort_request(sorted(pending))
            raise TimeoutError(f"requests {sorted(pending)} not finished within {timeout} s")
        outputs = engine.step()
        scheduled = engine.last_step.scheduler_output.num_scheduled_tokens
        for rid in pending:
            request = core.scheduler.requests.get(rid)
            if request is not None:
                results[rid]["trace"].append((request.status.name, request.num_computed_tokens,
                                              scheduled.get(rid, 0)))
            if connector is not None and rid in connector.external_tokens:
                results[rid]["external_tokens"] = connector.external_tokens[rid]
        if on_step is not None:
            on_step(num_steps)
        num_steps += 1
        for out in outputs:
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                r = results[out.request_id]
                r.update(token_ids=list(out.outputs[0].token_ids), finish_reason=out.outputs[0].finish_reason,
                         stop_reason=out.outputs[0].stop_reason, kv_transfer_params=out.kv_transfer_params,
                         ttft_s=out.metrics.time_to_first_token, num_cached_tokens=out.num_cached_tokens)
    for r in results.values():
        if connector is not None and r["request_id"] in connector.load_failures:
            r["failed_load"] = connector.load_failures[r["request_id"]]
            r["external_tokens"] = 0
    return [results[spec["request_id"]] for spec in requests]


def engine_stats(engine) -> dict:
    """The connector's counters (both halves, every rank) and the KV cache's free blocks."""
    core = engine.engine_core
    kv = core.kv_cache_manager
    return {**core.kv_connector_stats(), "free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks}


def worker_connector(engine):
    """The worker half of the connector of an engine whose model runner is in this process
    (distributed_executor_backend='uni'): where faults are injected."""
    runner = engine.engine_core.model_executor.model_runner
    if runner is None:
        raise ValueError("the model runner is in worker processes: no worker-side connector here")
    return runner.kv_connector


# ==================================================================== an engine in its own process
class _EngineHost:
    def __init__(self, kwargs: dict) -> None:
        kwargs = dict(kwargs)
        num_threads = kwargs.pop("num_threads", None)
        if num_threads:
            import torch
            torch.set_num_threads(num_threads)
        from mini_vllm.llm_engine import LLMEngine   # in the child only (preloaded by the forkserver)
        self.engine = LLMEngine(**kwargs)

    def close(self) -> None:
        self.engine.shutdown()


def _make_host(kwargs: dict):
    host = _EngineHost(kwargs)
    c = host.engine.engine_core.kv_connector and worker_connector(host.engine)
    return host, {"pid": os.getpid(), "session": c.layer.engine.session_id if c is not None else None,
                  "num_blocks": host.engine.engine_core.kv_cache_manager.num_blocks}


def _engine_main(conn, kwargs: dict) -> None:
    serve_commands(conn, lambda: _make_host(kwargs), _COMMANDS, _EngineHost.close)


def _cmd_generate(host: _EngineHost, requests: list[dict], timeout: float) -> list[dict]:
    return run_requests(host.engine, requests, timeout)


def _cmd_check(host: _EngineHost) -> dict:
    """Idle, every block free, bookkeeping consistent (raises otherwise); returns the stats."""
    host.engine.engine_core.check_invariants()
    assert not host.engine.has_unfinished_requests(), "requests left running"
    return engine_stats(host.engine)


def _cmd_set_faults(host: _EngineHost, faults: dict) -> None:
    """Fault injection on this node's transfer engine (from-scratch layer: corrupt_payloads,
    serve_delay_s) or Mooncake layer (load_delay_s)."""
    layer = worker_connector(host.engine).layer
    target = layer.faults if hasattr(layer, "faults") else layer.engine.faults
    for k, v in faults.items():
        if not hasattr(target, k):
            raise ValueError(f"unknown fault {k!r} for the {layer.name} layer")
        setattr(target, k, v)


def _cmd_reset_prefix_cache(host: _EngineHost) -> bool:
    return host.engine.engine_core.kv_cache_manager.reset_prefix_cache()


_COMMANDS = {"generate": _cmd_generate, "check": _cmd_check, "stats": lambda h: engine_stats(h.engine),
             "set_faults": _cmd_set_faults, "reset_prefix_cache": _cmd_reset_prefix_cache}


class EngineProcess(ChildProcess):
    """An LLMEngine in a child process: `EngineProcess(**EngineConfig fields, num_threads=n)`.
    Loading SmolLM2 takes a few seconds; every call has a timeout."""

    preload = ("mini_vllm.llm_engine",)     # imported once by the forkserver, not per engine

    def __init__(self, start_timeout: float = 180.0, wait: bool = True, **engine_kwargs) -> None:
        super().__init__(_engine_main, engine_kwargs, start_timeout, wait)

    def _started(self) -> None:
        self.session, self.num_blocks = self.info["session"], self.info["num_blocks"]

    def generate(self, requests: list[dict], timeout: float = 120.0) -> list[dict]:
        return self.call("generate", requests, timeout, timeout=timeout + 15)

    def check(self) -> dict:
        return self.call("check")

    def stats(self) -> dict:
        return self.call("stats")

    def set_faults(self, **faults) -> None:
        self.call("set_faults", faults)

    def reset_prefix_cache(self) -> bool:
        return self.call("reset_prefix_cache")
