"""Chapter 06: a global prefix cache across engines, and prefill/decode disaggregation —
from scratch (metadata server + transfer engine over loopback TCP) and on the real Mooncake
(TransferEngine + Store), behind one vLLM-shaped KV connector.

Names are imported on first use (PEP 562): the metadata server runs as its own small
process and must not pay for importing torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "KVTransferConfig": "config", "KV_ROLES": "config",
    "group_concurrent_contiguous": "grouping", "build_transfer_params": "grouping", "Region": "grouping",
    "KVLayout": "kv_layout", "BlockSegment": "kv_layout", "NodeSpec": "kv_layout",
    "kv_caches_from_cache_engine": "kv_layout",
    "MetadataServer": "metadata", "MetadataService": "metadata", "MetadataClient": "metadata",
    "MetadataServerProcess": "metadata", "KVBlockMeta": "metadata",
    "TransferEngine": "transfer_engine", "LinkModel": "transfer_engine", "TransferResult": "transfer_engine",
    "KVConnectorBase": "scheduler", "KVConnectorScheduler": "scheduler",
    "ShadowKVConnector": "shadow_connector", "ShadowKVConnectorRunner": "shadow_connector",
    "KVConnectorRole": "config", "GlobalPrefixCacheConnectorMetadata": "connector", "create_connector": "connector",
    "KVConnectorOutput": "connector", "KVOutputAggregator": "connector", "merge_stats": "connector",
    "ConnectorScheduler": "connector_scheduler", "ConnectorWorker": "connector_worker",
    "LoadError": "layers", "ScratchLayer": "layers",
    "MooncakeMaster": "mooncake_layer", "MooncakeEngine": "mooncake_layer", "MooncakeLayer": "mooncake_layer",
    "KVNode": "node", "NodeProcess": "node", "FakeKVModel": "node",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'global_prefix_cache' has no attribute {name!r}")
    return getattr(importlib.import_module(f"global_prefix_cache.{module}"), name)


def __dir__() -> list[str]:
    return __all__
