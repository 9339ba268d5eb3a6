"""A node without a model: chapter 02's KV cache + a scheduler (KVConnectorScheduler) + a connector,
driven step by step the way an engine does — so the connector is tested end to end, across
OS processes, before any engine is wired to it.

`FakeKVModel` stands in for the attention layers' K/V projections: K/V of a position are a
deterministic function of (token, position, layer), so any node can compute what a block
must hold and compare bytes. (With a real model, K/V depend on the whole prefix; the pool
is keyed by the chained prefix hash, so nothing here relies on that simplification.)

One `KVNode.step()`, with the connector's two halves side by side (an engine puts the worker
half in every rank):
    out = scheduler.schedule()             (KVConnectorScheduler asks the scheduler half, which
                                            writes the step's loads and saves into out)
    worker.bind_connector_metadata(out.kv_connector_metadata); worker.start_load_kv()
    forward: per layer, write K/V of the scheduled tokens by slot, then worker.save_kv_layer(layer)
    worker.wait_for_save(); worker.get_connector_output() -> KVConnectorOutput
    scheduler.update_from_output(out, ModelRunnerOutput(..., finished_recving, invalid_block_ids))
        (the scheduler half reads the report; KVConnectorScheduler recomputes a failed load)
    request_finished(...) for requests that finished

`NodeProcess` runs a KVNode in a child process behind a pipe: tests and the demo use two
of them as the prefill/producer and decode/consumer nodes.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from global_prefix_cache.config import KVConnectorRole, KVTransferConfig
from global_prefix_cache.connector import KVOutputAggregator, create_connector, merge_stats, new_node_id
from global_prefix_cache.connector_scheduler import ConnectorScheduler
from global_prefix_cache.connector_worker import ConnectorWorker
from global_prefix_cache.kv_layout import NodeSpec, kv_caches_from_cache_engine
from kvcache import KVCacheManager
from kvcache.cache_engine import CacheEngine, KVCacheSpec
from global_prefix_cache.scheduler import KVConnectorScheduler
from processes import ChildProcess, serve_commands
from scheduler import ModelRunnerOutput, Request, Scheduler, SchedulerConfig


class FakeKVModel:
    """K/V[layer][pos] = sin((token * 7 + pos) * freq[h, d] + layer): deterministic, distinct
    per token, position, layer, head and channel. Vocabulary 1000."""

    VOCAB = 1000

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        h, d = spec.num_kv_heads, spec.head_dim
        self.freq = torch.linspace(0.01, 1.0, h * d, dtype=torch.float64).view(h, d)

    def kv(self, token_ids: torch.Tensor, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids, positions: [n] -> (k, v) each [n, num_kv_heads, head_dim] in the cache dtype."""
        x = (token_ids.to(torch.float64) * 7 + positions.to(torch.float64)).view(-1, 1, 1)
        k = torch.sin(x * self.freq + layer)
        v = torch.cos(x * self.freq * 0.5 - layer)
        return k.to(self.spec.dtype), v.to(self.spec.dtype)

    def next_token(self, token_ids: list[int]) -> int:
        return (token_ids[-1] * 31 + len(token_ids) * 17 + 5) % self.VOCAB

    def reference_kv(self, token_ids: list[int]) -> torch.Tensor:
        """[num_layers, 2, n, heads, head_dim]: what computing every position locally gives."""
        t = torch.tensor(token_ids)
        pos = torch.arange(len(token_ids))
        return torch.stack([torch.stack(self.kv(t, pos, layer)) for layer in range(self.spec.num_layers)])


@dataclass
class RequestRecord:
    """What happened to one request on this node (returned to tests and the demo)."""
    request_id: str
    prompt_len: int
    output_token_ids: list[int] = field(default_factory=list)
    trace: list[tuple[str, int, int]] = field(default_factory=list)   # (status, computed, scheduled) per step
    kv: Any = None                     # [num_layers, 2, prompt_len, heads, head_dim] at finish
    kv_transfer_params: dict | None = None
    local_hit_tokens: int = 0
    external_tokens: int = 0
    ttft_s: float = 0.0
    failed_load: str = ""


class KVNode:
    def __init__(self, kv_transfer_config: dict | None = None, *, num_blocks: int = 64, block_size: int = 4,
                 num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.float16,
                 max_model_len: int = 256, shuffle_seed: int | None = None, node_id: str | None = None,
                 step_delay_s: float = 0.0) -> None:
        self.spec = KVCacheSpec(num_layers, block_size, num_kv_heads, head_dim, dtype)
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size)
        if shuffle_seed is not None:
            self._shuffle_free_blocks(shuffle_seed)
        self.cache = CacheEngine(self.spec, num_blocks)
        self.model = FakeKVModel(self.spec)
        self.connector: ConnectorScheduler | None = None        # the scheduler half
        self.worker_connector: ConnectorWorker | None = None    # the worker half (one rank)
        if kv_transfer_config is not None:
            self._make_connector(KVTransferConfig.from_dict(kv_transfer_config), node_id)
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_model_len, max_model_len=max_model_len)
        self.scheduler = (Scheduler(config, self.kv_cache_manager) if self.connector is None else
                          KVConnectorScheduler(config, self.kv_cache_manager, connector=self.connector))
        self.step_delay_s = step_delay_s          # a stand-in for prefill compute time (demo)
        self.requests: dict[str, Request] = {}
        self.records: dict[str, RequestRecord] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._t0: dict[str, float] = {}

    def _make_connector(self, config: KVTransferConfig, node_id: str | None) -> None:
        node_id = node_id or new_node_id(config)
        spec = NodeSpec.from_kv_spec(config.extra["model"], self.spec)
        self.worker_connector = create_connector(config, KVConnectorRole.WORKER, spec, node_id=node_id)
        try:
            self.worker_connector.register_kv_caches(kv_caches_from_cache_engine(self.cache))
            self.connector = create_connector(config, KVConnectorRole.SCHEDULER, spec, node_id=node_id)
        except BaseException:
            self.worker_connector.shutdown()
            raise
        self.connector.set_xfer_handshake_metadata([self.worker_connector.get_handshake_metadata()])
        self.kv_output_aggregator = KVOutputAggregator(world_size=1)

    @property
    def kv_stats(self) -> dict:
        """The connector's counters, both halves together."""
        if self.connector is None:
            return {}
        return merge_stats(self.connector.stats, self.worker_connector.stats)

    def _shuffle_free_blocks(self, seed: int) -> None:
        """Scatter the free queue so this node's allocations are not 0, 1, 2, ...: block ids
        then differ between nodes and runs are short (the grouping has work to do)."""
        pool = self.kv_cache_manager.block_pool
        blocks = pool.get_new_blocks(pool.get_num_free_blocks())
        random.Random(seed).shuffle(blocks)
        pool.free_blocks(blocks)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 1,
                    kv_transfer_params: dict | None = None) -> None:
        if kv_transfer_params is not None:
            if self.connector is None:
                raise ValueError("kv_transfer_params given to a node without a KV connector")
            kv_transfer_params = self.connector.validate_kv_transfer_params(kv_transfer_params)
        request = Request(request_id, prompt_token_ids, max_tokens, ignore_eos=True,
                          kv_transfer_params=kv_transfer_params)
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        self.records[request_id] = RequestRecord(request_id, len(prompt_token_ids))
        self._t0[request_id] = time.perf_counter()

    def step(self) -> None:
        out = self.scheduler.schedule()
        worker = self.worker_connector
        if worker is not None:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv()
        self._update_block_tables(out)
        for rid, request in self.scheduler.requests.items():
            self.records[rid].trace.append((request.status.name, request.num_computed_tokens,
                                            out.num_scheduled_tokens.get(rid, 0)))
        sampled = self._forward(out)
        kv_output = None
        if worker is not None:
            worker.wait_for_save()
            kv_output = self.kv_output_aggregator.aggregate([worker.get_connector_output(out.finished_req_ids)])
            worker.clear_connector_metadata()
            for rid, failure in kv_output.failed_recving.items():
                if rid in self.records:
                    self.records[rid].failed_load = failure.reason
        req_ids = list(out.num_scheduled_tokens)
        runner_out = ModelRunnerOutput(req_ids, [sampled.get(r, []) for r in req_ids])
        if kv_output is not None:
            runner_out.finished_recving, runner_out.finished_sending = kv_output.finished_recving, kv_output.finished_sending
            runner_out.invalid_block_ids, runner_out.kv_connector_output = kv_output.invalid_block_ids, kv_output
        for o in self.scheduler.update_from_output(out, runner_out):
            record = self.records[o.request_id]
            if o.new_token_ids and not record.output_token_ids:
                record.ttft_s = time.perf_counter() - self._t0[o.request_id]
            record.output_token_ids += o.new_token_ids
            if o.finished:
                self._finish(o.request_id)

    def _update_block_tables(self, out) -> None:
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = list(new.block_ids)
            rec = self.records[new.req_id]
            loaded = 0
            if self.connector is not None and not rec.failed_load:
                loaded = self.connector.external_tokens.get(new.req_id, 0)
            rec.external_tokens = loaded
            rec.local_hit_tokens = new.num_computed_tokens - loaded
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            if c.resumed_from_preemption[i]:
                self.block_tables[rid] = list(c.new_block_ids[i])
            else:
                self.block_tables[rid] += c.new_block_ids[i]

    def _forward(self, out) -> dict[str, list[int]]:
        """Write K/V of every scheduled token by slot (layer by layer, as attention would),
        and 'sample' a token for requests whose scheduled tokens reach their end."""
        if out.is_empty:
            return {}
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        computed.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        tokens, positions, slots, sampled = [], [], [], {}
        bs = self.spec.block_size
        for rid, n in out.num_scheduled_tokens.items():
            start, request = computed[rid], self.requests[rid]
            pos = torch.arange(start, start + n)
            table = torch.tensor(self.block_tables[rid])
            tokens.append(torch.tensor(request.all_token_ids[start:start + n]))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)          # chapter 01's slot mapping
            if start + n >= request.num_tokens:
                sampled[rid] = [self.model.next_token(list(request.all_token_ids))]
        t, p, s = torch.cat(tokens), torch.cat(positions), torch.cat(slots)
        for layer in range(self.spec.num_layers):
            k, v = self.model.kv(t, p, layer)
            self.cache.key_caches[layer].view(-1, self.spec.num_kv_heads, self.spec.head_dim)[s] = k
            self.cache.value_caches[layer].view(-1, self.spec.num_kv_heads, self.spec.head_dim)[s] = v
            if self.worker_connector is not None:
                self.worker_connector.save_kv_layer(f"layers.{layer}")
        if self.step_delay_s:
            time.sleep(self.step_delay_s * out.total_num_scheduled_tokens)
        return sampled

    def gather_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """[num_layers, 2, num_tokens, heads, head_dim]: the K/V of positions 0..num_tokens-1
        of a request with block table `block_ids`."""
        bs = self.spec.block_size
        pos = torch.arange(num_tokens)
        slots = torch.tensor(block_ids)[pos // bs] * bs + pos % bs
        h, d = self.spec.num_kv_heads, self.spec.head_dim
        return torch.stack([torch.stack([self.cache.key_caches[layer].view(-1, h, d)[slots],
                                         self.cache.value_caches[layer].view(-1, h, d)[slots]])
                            for layer in range(self.spec.num_layers)])

    def _finish(self, rid: str) -> None:
        request, record = self.requests.pop(rid), self.records[rid]
        table = self.block_tables.pop(rid)
        # Freed just now, but nothing has reused them yet: snapshot the prompt's K/V.
        record.kv = self.gather_kv(table, record.prompt_len)
        if self.connector is not None:
            if rid not in self.connector.finished_request_ids:    # a scheduler that does not call it
                self.connector.request_finished(request, table)
            record.kv_transfer_params = self.connector.take_kv_transfer_params(rid)

    def run(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 1,
            kv_transfer_params: dict | None = None, timeout: float = 30.0) -> RequestRecord:
        """Add one request and step until it finishes (bounded by `timeout`)."""
        self.add_request(request_id, prompt_token_ids, max_tokens, kv_transfer_params)
        deadline = time.monotonic() + timeout
        while request_id in self.requests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id} not finished within {timeout} s: "
                                   f"{self.records[request_id].trace[-3:]}")
            self.step()
            if self.worker_connector is not None and self.worker_connector.has_pending_loads():
                time.sleep(0.002)        # waiting for remote K/V: don't spin on the CPU
        return self.records[request_id]

    def check_all_free(self) -> None:
        """No request left and every block back in the pool, bookkeeping consistent."""
        self.kv_cache_manager.check_invariants()
        assert not self.scheduler.has_unfinished_requests(), self.scheduler.requests
        assert self.kv_cache_manager.num_free_blocks == self.kv_cache_manager.num_blocks, "KV blocks leaked"

    def close(self) -> None:
        for half in (self.connector, self.worker_connector):
            if half is not None:
                half.shutdown()


# ==================================================================== a node in its own process
def _make_node(kwargs: dict):
    node = KVNode(**kwargs)
    return node, {"pid": os.getpid(),
                  "side_channel": node.worker_connector and node.worker_connector.get_handshake_metadata()}


def _node_main(conn, kwargs: dict) -> None:
    serve_commands(conn, lambda: _make_node(kwargs), _COMMANDS, KVNode.close)


def _cmd_run(node: KVNode, rid, prompt, max_tokens, params, timeout) -> dict:
    rec = node.run(rid, prompt, max_tokens, params, timeout)
    d = dict(rec.__dict__)
    d["kv"] = rec.kv.numpy()
    d["reference_kv"] = node.model.reference_kv(prompt).numpy()
    return d


def _cmd_set_faults(node: KVNode, faults: dict) -> None:
    for k, v in faults.items():
        setattr(node.worker_connector.layer.engine.faults, k, v)


def _cmd_stats(node: KVNode) -> dict:
    return {"connector": node.kv_stats,
            "load_seconds": list(node.worker_connector.load_seconds) if node.worker_connector else [],
            "free_blocks": node.kv_cache_manager.num_free_blocks, "num_blocks": node.kv_cache_manager.num_blocks}


def _cmd_check(node: KVNode) -> None:
    node.check_all_free()


def _cmd_publish_fill(node: KVNode, rid_prefix: str, num_prompts: int, length: int, seed: int) -> None:
    """Push other prompts through the pool (to evict, or to warm it)."""
    rng = random.Random(seed)
    for i in range(num_prompts):
        node.run(f"{rid_prefix}{i}", [rng.randrange(FakeKVModel.VOCAB) for _ in range(length)])


_COMMANDS = {"run": _cmd_run, "set_faults": _cmd_set_faults, "stats": _cmd_stats, "check": _cmd_check,
             "publish_fill": _cmd_publish_fill}



class NodeProcess(ChildProcess):
    """A KVNode in a child process."""

    preload = ("global_prefix_cache.node",)     # the forkserver imports torch and this chapter once

    def __init__(self, start_timeout: float = 60.0, **node_kwargs) -> None:
        super().__init__(_node_main, node_kwargs, start_timeout)

    def _started(self) -> None:
        self.side_channel = self.info["side_channel"]

    def run(self, rid: str, prompt: list[int], max_tokens: int = 1, kv_transfer_params: dict | None = None,
            timeout: float = 30.0) -> dict:
        return self.call("run", rid, prompt, max_tokens, kv_transfer_params, timeout, timeout=timeout + 10)
