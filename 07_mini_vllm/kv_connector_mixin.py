"""The KV connector, the model runner's side: load before the forward pass, save after it.

Mirrors vLLM v1's `vllm/v1/worker/kv_connector_model_runner_mixin.py: KVConnectorModelRunnerMixin`
(`maybe_setup_kv_connector`, `maybe_wait_for_kv_save`, `get_finished_kv_transfers`). Every rank's
runner holds its own worker-side connector (chapter 06's `ConnectorWorker`), built from the same
config and registered with this rank's K/V tensors only — its KV heads under tensor parallelism,
its stage's layers under pipeline parallelism. It is driven around the step in vLLM's order:
`bind_connector_metadata` + `start_load_kv` after the block moves (its loads are asynchronous:
their requests are not in this forward), `wait_for_save` after the forward, and the rank's report
(`KVConnectorOutput`) goes into its ModelRunnerOutput; the executor joins the ranks' reports
(`KVOutputAggregator`). The model itself is untouched: the pool copies a step's blocks once the
whole forward is done (`wait_for_save`), not layer by layer.
"""
from __future__ import annotations

import logging

from global_prefix_cache.config import KVConnectorRole
from global_prefix_cache.connector import create_connector
from global_prefix_cache.kv_layout import kv_caches_from_cache_engine
from scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class KVConnectorModelRunnerMixin:
    """For ModelRunner: `self.kv_connector` (None: no connector) around each step."""

    kv_connector = None

    def init_kv_connector(self, kv_transfer_config, spec, rank: int, node_id: str) -> str | None:
        """This rank's worker half (vLLM: ensure_kv_transfer_initialized + register_kv_caches), given
        {"layers.{i}.k_cache" / "v_cache": [num_blocks, block_size, kv_heads, head_dim]}. Returns its
        handshake (the side channel a decode node's rank `rank` calls; None for a consumer)."""
        connector = create_connector(kv_transfer_config, KVConnectorRole.WORKER, spec, rank=rank, node_id=node_id)
        try:
            connector.register_kv_caches(kv_caches_from_cache_engine(self.cache_engine))
        except BaseException:
            connector.shutdown()
            raise
        self.kv_connector = connector
        return connector.get_handshake_metadata()

    def _kv_connector_start(self, so: SchedulerOutput) -> None:
        """Before the forward (vLLM: bind_connector_metadata, start_load_kv): this step's loads
        start in the background, into blocks of requests waiting for them."""
        connector = self.kv_connector
        if connector is not None:
            connector.bind_connector_metadata(so.kv_connector_metadata)
            connector.start_load_kv()

    def _kv_connector_finish(self, so: SchedulerOutput, output):
        """After the forward (vLLM: wait_for_save, get_finished, get_block_ids_with_load_errors):
        publish / stage what this step computed — never the blocks of a request that failed in
        it — and report finished sends and loads, and failed loads with their blocks."""
        connector = self.kv_connector
        if connector is None:
            return output
        if so.is_empty and connector.has_pending_loads():
            # Nothing to compute, remote K/V on its way: wait for it (bounded) instead of spinning.
            connector.wait_for_loads(timeout=0.01)
        if output.failed:
            connector.discard_saves(output.failed)
        connector.wait_for_save()
        output.kv_connector_output = report = connector.get_connector_output(so.finished_req_ids)
        for req_id, failure in report.failed_recving.items():
            logger.warning("request %s: loading its remote K/V failed (%s); it is computed here", req_id,
                           failure.reason)
        connector.clear_connector_metadata()
        return output

    def shutdown_kv_connector(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None

    def has_pending_kv_loads(self) -> bool:
        return self.kv_connector is not None and self.kv_connector.has_pending_loads()

    def get_kv_connector_stats(self) -> dict:
        return self.kv_connector.get_kv_connector_stats() if self.kv_connector is not None else {}
