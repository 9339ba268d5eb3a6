"""The KV connector: how K/V computed on ANOTHER node enters a request, in vLLM's shape.

Mirrors `KVConnectorBase_V1` (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`) and,
for the push path, `MooncakeConnector` (`.../v1/mooncake/mooncake_connector.py`), which is two
objects behind one name: vLLM builds the connector once per role.

  SCHEDULER, in the engine core (`connector_scheduler.ConnectorScheduler`, driven by
  `scheduler.KVConnectorScheduler`; `scheduler.KVConnectorBase` is its interface):
    get_num_new_matched_tokens(request, num_computed_tokens) -> (num_external_tokens, load_async)
    update_state_after_alloc(request, blocks, num_external_tokens)
    build_connector_meta(scheduler_output) -> GlobalPrefixCacheConnectorMetadata
    update_connector_output(model_runner_output)    request_finished(request, block_ids) -> delay_free
  WORKER, one per rank (`connector_worker.ConnectorWorker`, driven by the model runner):
    register_kv_caches(kv_caches)  bind_connector_metadata(meta)  start_load_kv()
    wait_for_layer_load(layer)  save_kv_layer(layer, ...)  wait_for_save()
    get_finished(finished_req_ids) -> (finished_sending, finished_recving)
    get_block_ids_with_load_errors()  /  get_failed_loads()

The scheduler half plans: it hashes a request's blocks, asks the pool (or reads the prefill
node's `kv_transfer_params`), and puts each step's loads and saves in the metadata. Every
worker half carries them out for ITS share of each block — its KV heads under tensor
parallelism, its stage's layers under pipeline parallelism — and reports what finished;
`KVOutputAggregator` counts a load as finished only when every rank has finished it.

Two ways K/V arrive, one code path in the scheduler ([Kwon 2025, §4.4]: a remote prefix hit):
  * pool (global prefix cache): a producer publishes the full blocks of every prompt;
    any consumer whose prompt starts with those blocks loads them instead of computing.
    Each rank publishes its share under its own key (`layers.pool_key`).
  * push (prefill/decode disaggregation): the prefill node stages a request's K/V; the
    decode node, given the prefill node's `kv_transfer_params`, asks for it over a side
    channel (one per rank), and the prefill node WRITES it into the decode node's blocks
    ([vLLM 2.0 part 2, §7.3.1]: P pushes, D does not pull), contiguous blocks grouped into one
    transfer per layer — rank r of the prefill node into rank r of the decode node.

Every load is asynchronous (the request waits in WAITING_FOR_REMOTE_KVS) and has a deadline;
a failed or late load is reported by `get_block_ids_with_load_errors()` (the model runner puts
them in `ModelRunnerOutput.invalid_block_ids`, and `scheduler.KVConnectorScheduler` recomputes the
request under `kv_load_failure_policy`), and its blocks are never written after it was given up.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from global_prefix_cache.config import KVConnectorRole, KVTransferConfig
from global_prefix_cache.kv_layout import NodeSpec
from global_prefix_cache.layers import PoolHit, ScratchLayer

__all__ = ["KVConnectorRole", "LoadSpec", "SaveSpec", "GlobalPrefixCacheConnectorMetadata", "LoadFailure",
           "KVConnectorOutput", "KVOutputAggregator", "create_connector", "merge_stats", "new_node_id", "CONNECTORS"]


@dataclass
class LoadSpec:
    """One request's load, planned on the scheduler side, executed by every worker."""
    request_id: str
    mode: str                         # "pool" | "push"
    first_block: int                  # logical index of the first block to fill
    num_blocks: int
    hits: dict[int, list[PoolHit]] = field(default_factory=dict)   # pool: rank -> its share's hits
    push: dict[str, Any] = field(default_factory=dict)          # push: the prefill node's kv_transfer_params
    expected_hashes: list[int] = field(default_factory=list)   # push: our tokens' hashes of the blocks loaded
    block_ids: list[int] = field(default_factory=list)         # local destination blocks (set after alloc)


@dataclass
class SaveSpec:
    request_id: str
    block_ids: list[int]              # local blocks to publish to the pool (full prompt blocks)
    block_hashes: list[int]
    push_block_ids: list[int] = field(default_factory=list)    # stage for a decode node (prompt complete)
    push_num_tokens: int = 0
    push_block_hashes: list[int] = field(default_factory=list)  # the staged tokens' hashes, one per block


@dataclass
class GlobalPrefixCacheConnectorMetadata:
    """vLLM's KVConnectorMetadata: what the scheduler tells every worker for one step."""
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class LoadFailure:
    reason: str
    block_ids: list[int]


@dataclass
class KVConnectorOutput:
    """One rank's report after a step (vLLM: `KVConnectorOutput`): loads and sends that finished,
    loads that failed (with the blocks they were writing), and prompts it could not stage for a
    decode node (its send buffer was full, or the forward pass failed the request)."""
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, LoadFailure] = field(default_factory=dict)
    failed_staging: set[str] = field(default_factory=set)

    @property
    def invalid_block_ids(self) -> set[int]:
        """The blocks of the failed loads (vLLM's name): what the scheduler must not trust."""
        return {b for failure in self.failed_recving.values() for b in failure.block_ids}


class KVOutputAggregator:
    """Every rank's KVConnectorOutput -> the step's one answer for the scheduler (vLLM:
    `kv_connector/utils.py: KVOutputAggregator`). A request's load is over only when every rank
    is done with it: until then another rank may still be writing its blocks, so they must not
    be freed or recomputed into. Then it is finished if every rank loaded its share, and failed
    (its blocks invalid) if any did not. A send is finished when every rank has sent; a prompt
    is unstaged as soon as one rank could not stage it (every rank stages in the same step)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._recving: dict[str, int] = {}                     # request -> ranks done loading
        self._failed: dict[str, LoadFailure] = {}              # request -> the first failure a rank reported
        self._sending: dict[str, int] = {}

    def aggregate(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        done = KVConnectorOutput()
        for out in outputs:
            done.failed_staging |= out.failed_staging
            for rid in out.finished_sending:
                if self._count(self._sending, rid):
                    done.finished_sending.add(rid)
            for rid, failure in out.failed_recving.items():
                self._failed.setdefault(rid, failure)
            for rid in out.finished_recving | set(out.failed_recving):
                if self._count(self._recving, rid):
                    failure = self._failed.pop(rid, None)
                    if failure is None:
                        done.finished_recving.add(rid)
                    else:
                        done.failed_recving[rid] = failure
        return done

    def _count(self, counts: dict[str, int], rid: str) -> bool:
        counts[rid] = counts.get(rid, 0) + 1
        if counts[rid] < self.world_size:
            return False
        del counts[rid]
        return True

    @property
    def pending(self) -> int:
        """Requests some but not all ranks are done with."""
        return len(self._recving) + len(self._sending)


class PoolHealth:
    """Both halves' circuit breaker for the pool: a failed call is counted by reason, and after the
    pool's server did not answer the half leaves it alone for `pool_retry_s` (every step would
    otherwise wait for the timeout). The host class has `config` and `stats["failures"]`."""
    last_error: str = ""
    _pool_down_until: float = 0.0

    def _pool_failed(self, error: BaseException) -> None:
        self._count_failure("unreachable")
        self.last_error = str(error)
        self._pool_down_until = time.monotonic() + self.config.extra["pool_retry_s"]

    def _pool_is_down(self) -> bool:
        return time.monotonic() < self._pool_down_until

    def _count_failure(self, reason: str) -> None:
        self.stats["failures"][reason] = self.stats["failures"].get(reason, 0) + 1


def merge_stats(*stats: dict) -> dict:
    """The connector's counters over both halves and every rank: numbers add up, failures by reason."""
    merged: dict = {"failures": {}}
    for s in stats:
        for key, value in s.items():
            if key == "failures":
                for reason, n in value.items():
                    merged["failures"][reason] = merged["failures"].get(reason, 0) + n
            else:
                merged[key] = merged.get(key, 0) + value
    return merged


def _mooncake_layer(*args):
    from global_prefix_cache.mooncake_layer import MooncakeLayer
    return MooncakeLayer(*args)


# vLLM's KVConnectorFactory registry: the config's kv_connector name picks the layer under both halves.
CONNECTORS = {
    "GlobalKVPoolConnector": ScratchLayer,      # from scratch: our metadata server + transfer engine [vLLM 2.0 part 2, §7.5]
    "MooncakeConnector": _mooncake_layer,       # the real system: Mooncake's TransferEngine (push) and Store (pool)
}


def new_node_id(config: KVTransferConfig) -> str:
    """This engine's name in the pool: `engine_id` if the config gives one. Made once per engine
    and given to both halves (rank r > 0 appends "/rank{r}": every rank is a node of the pool)."""
    return config.engine_id or f"node-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def create_connector(kv_transfer_config: KVTransferConfig | dict, role: KVConnectorRole, spec: NodeSpec, *,
                     rank: int = 0, node_id: str | None = None):
    """vLLM's KVConnectorFactory.create_connector(config, role): the scheduler half or the worker
    half of rank `rank`, for an engine whose K/V are `spec` (the whole engine's: every layer and
    head, and how its ranks split them)."""
    from global_prefix_cache.connector_scheduler import ConnectorScheduler
    from global_prefix_cache.connector_worker import ConnectorWorker
    config = KVTransferConfig.from_dict(kv_transfer_config)
    node_id = node_id or new_node_id(config)
    if role is KVConnectorRole.SCHEDULER:
        return ConnectorScheduler(config, spec, node_id)
    return ConnectorWorker(config, spec, rank, node_id)
