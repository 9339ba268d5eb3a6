"""The KV connector, the model runner's side: load before the forward pass, save after it.

Mirrors vLLM v1's `vllm/v1/worker/kv_connector_model_runner_mixin.py: KVConnectorModelRunnerMixin`
(`maybe_setup_kv_connector`, `maybe_wait_for_kv_save`, `get_finished_kv_transfers`). The connector
(chapter 06) is driven around the step in vLLM's order: `bind_connector_metadata` + `start_load_kv`
after the block moves (its loads are asynchronous: their requests are not in this forward),
`wait_for_save` + `get_finished` after the forward, and what they report goes into the
ModelRunnerOutput (`finished_recving`, `finished_sending`, `invalid_block_ids`). The model itself
is untouched: the pool copies a step's blocks once the whole forward is done (`wait_for_save`),
not layer by layer.
"""
from __future__ import annotations

import logging

from global_prefix_cache.kv_layout import kv_caches_from_cache_engine
from scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class KVConnectorModelRunnerMixin:
    """For ModelRunner: `self.kv_connector` (None: no connector) around each step."""

    kv_connector = None

    def register_kv_connector(self, connector) -> None:
        """Give a KV connector this runner's K/V tensors (vLLM: register_kv_caches), as
        {"layers.{i}.k_cache" / "v_cache": [num_blocks, block_size, kv_heads, head_dim]}."""
        connector.register_kv_caches(kv_caches_from_cache_engine(self.cache_engine))
        self.kv_connector = connector

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
        it — and report finished sends and loads, and the blocks of failed loads."""
        connector = self.kv_connector
        if connector is None:
            return output
        if output.failed:
            connector.discard_saves(output.failed)
        connector.wait_for_save()
        output.finished_sending, output.finished_recving = connector.get_finished(so.finished_req_ids)
        for req_id, reason in connector.get_failed_loads().items():
            logger.warning("request %s: loading its remote K/V failed (%s); it is computed here", req_id, reason)
        output.invalid_block_ids = connector.get_block_ids_with_load_errors()
        connector.clear_connector_metadata()
        return output
