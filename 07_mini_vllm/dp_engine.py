"""DPEngine: data parallelism — N complete engine replicas behind one router, one request to one replica.

Mirrors vLLM's data-parallel deployment (`vllm/v1/engine/core_client.py: DPLBAsyncMPClient`, one
EngineCore per DP rank, the client choosing a rank per request) with the router of router.py. Each
replica is an ordinary LLMEngine (any executor: a replica may itself be tensor parallel); the
replicas share nothing — not the scheduler, not the KV cache — which is why routing decides the
prefix hit rate.

Here the replicas live in one process and are stepped in LOCKSTEP: `step()` steps every replica
that has work and the round costs the slowest replica's step (`clock` advances by the max). That is
what N replicas on N devices would take for the same steps (vLLM's DP ranks also step together when
they must, for MoE), and it keeps the comparison of routers fair on a machine with fewer cores than
replicas: a router that piles work on one replica pays for it in `clock`, not in hidden waiting.
The router is built at the engine level on purpose: the OpenAI server (or a benchmark) submits to a
DPEngine as it would to one LLMEngine.

    dp = DPEngine.from_config(2, CacheAwareRouter(...) or "cache_aware", model=..., max_model_len=...)
    dp.add_request("a", prompt, params)     # -> the replica index it went to
    while dp.has_unfinished_requests():
        outputs = dp.step()
"""
from __future__ import annotations

import time

from mini_vllm.llm_engine import LLMEngine
from mini_vllm.router import CacheAwareRouter, LeastLoadedRouter, RoundRobinRouter, Router

ROUTERS = ("round_robin", "least_loaded", "cache_aware")


class DPEngine:
    def __init__(self, replicas: list[LLMEngine], router: Router):
        if not replicas:
            raise ValueError("a DPEngine needs at least one replica")
        self.replicas, self.router = list(replicas), router
        self.clock = 0.0                                # seconds of lockstep rounds so far
        self.replica_of: dict[str, int] = {}            # request id -> replica index (while unfinished)

    @classmethod
    def from_config(cls, data_parallel_size: int, router: str | Router = "cache_aware", **engine_kwargs) -> "DPEngine":
        """`data_parallel_size` LLMEngines with the same EngineConfig fields; router by name or object."""
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        if isinstance(router, str) and router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS} or a Router, got {router!r}")
        replicas: list[LLMEngine] = []
        try:
            for _ in range(data_parallel_size):
                replicas.append(LLMEngine(**engine_kwargs))
        except BaseException:
            for r in replicas:
                r.shutdown()
            raise
        if isinstance(router, str):
            kv = replicas[0].engine_core.kv_cache_manager
            router = {"round_robin": RoundRobinRouter, "least_loaded": LeastLoadedRouter,
                      "cache_aware": lambda: CacheAwareRouter(kv.block_size, kv.hash_fn)}[router]()
        return cls(replicas, router)

    def add_request(self, request_id: str, prompt, params=None, **kwargs) -> int:
        """Tokenize once (the replicas share the model and tokenizer), route, queue; the replica index."""
        if request_id in self.replica_of:
            raise ValueError(f"request id {request_id!r} is already running")
        engine = self.replicas[0]
        params = params if params is not None else engine.get_default_sampling_params()
        prompt, token_ids = engine.processor.process_inputs(prompt, params)
        index = self.router.select(token_ids, self.replicas)
        self.replicas[index].add_request(request_id, prompt, params, prompt_token_ids=token_ids, **kwargs)
        self.replica_of[request_id] = index
        return index

    def step(self) -> list:
        """One lockstep round: every replica with work steps once; the round costs the slowest."""
        outputs, longest = [], 0.0
        for engine in self.replicas:
            if not engine.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            outputs += engine.step()
            longest = max(longest, time.perf_counter() - t0)
        self.clock += longest
        for out in outputs:
            if out.finished:
                self.replica_of.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def abort_request(self, request_ids) -> None:
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in request_ids:
            index = self.replica_of.pop(request_id, None)
            if index is not None:
                self.replicas[index].abort_request(request_id)

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()
