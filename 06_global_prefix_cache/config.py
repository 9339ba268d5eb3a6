"""`KVTransferConfig`: vLLM's `kv_transfer_config`, validated once in `__post_init__`.

Mirrors `vllm/config/kv_transfer.py` (`KVTransferConfig`: kv_connector, kv_role,
kv_connector_extra_config, engine_id, kv_load_failure_policy) and the dict form users pass
to `LLM(..., kv_transfer_config={...})`.

Roles (vLLM's names): a `kv_producer` computes K/V and offers it (a prefill node, or an
engine that only fills the pool), a `kv_consumer` only loads (a decode node), `kv_both`
does both (every engine of a shared prefix cache). A role that cannot do what a request asks
is a configuration error, reported as one — not a silent miss.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class KVConnectorRole(enum.Enum):
    """vLLM builds a connector twice: SCHEDULER in the engine core (plans loads and saves),
    WORKER in every rank (moves that rank's bytes)."""
    SCHEDULER = 0
    WORKER = 1


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")

# Extra-config keys each connector understands, with their defaults.
_COMMON = {
    "model": "",                    # K/V are only interchangeable between nodes of the same model
    "load_timeout_s": 10.0,         # a load not finished by then fails (-> local recompute)
    "rpc_timeout_s": 2.0,           # one control-plane call (metadata, side channel)
    "pool_retry_s": 5.0,            # after the pool's server failed to answer, leave it alone this long
    "send_capacity_blocks": 256,    # producer: send-buffer slots for prefill->decode pushes
    "send_keep_s": 30.0,            # producer: how long staged K/V waits for its decode node
    "save_to_pool": True,           # producer: publish full prompt blocks to the pool
}
CONNECTOR_EXTRA_KEYS: dict[str, dict[str, Any]] = {
    # From scratch: our metadata server + our transfer engine [vLLM 2.0 part 2, §7.5].
    "GlobalKVPoolConnector": {**_COMMON,
                              "metadata_server": "",          # "host:port" of a MetadataService
                              "pool_capacity_blocks": 256,     # this node's share of the pool
                              "link_latency_us": None,         # optional LinkModel for experiments
                              "link_bandwidth_gbps": None},
    # The real thing: mooncake.engine.TransferEngine + mooncake.store (mooncake_master).
    "MooncakeConnector": {**_COMMON,
                          "master_server": "",                 # "host:port" of mooncake_master
                          "global_segment_size": 64 << 20,     # bytes this node gives the store
                          "local_buffer_size": 16 << 20,
                          "protocol": "tcp"},
}


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str | None = None
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTOR_EXTRA_KEYS:
            raise ValueError(f"unknown kv_connector {self.kv_connector!r}; choose one of {sorted(CONNECTOR_EXTRA_KEYS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"unknown kv_role {self.kv_role!r}; choose one of {KV_ROLES}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"kv_connector_extra_config must be a dict, got {type(self.kv_connector_extra_config).__name__}")
        known = CONNECTOR_EXTRA_KEYS[self.kv_connector]
        unknown = sorted(set(self.kv_connector_extra_config) - set(known))
        if unknown:
            raise ValueError(f"{self.kv_connector} does not understand kv_connector_extra_config keys {unknown}; "
                             f"it knows {sorted(known)}")
        self.extra = {**known, **self.kv_connector_extra_config}
        for key in ("load_timeout_s", "rpc_timeout_s", "send_keep_s", "pool_retry_s"):
            if not isinstance(self.extra[key], (int, float)) or self.extra[key] <= 0:
                raise ValueError(f"{key} must be a number > 0, got {self.extra[key]!r}")
        for key in ("send_capacity_blocks", "pool_capacity_blocks", "global_segment_size", "local_buffer_size"):
            if key in self.extra and (not isinstance(self.extra[key], int) or self.extra[key] <= 0):
                raise ValueError(f"{key} must be a positive int, got {self.extra[key]!r}")
        if self.kv_connector == "MooncakeConnector" and self.extra["protocol"] not in ("tcp", "rdma"):
            raise ValueError(f"Mooncake protocol must be 'tcp' or 'rdma', got {self.extra['protocol']!r}")
        latency, bandwidth = self.extra.get("link_latency_us"), self.extra.get("link_bandwidth_gbps")
        if (latency is None) != (bandwidth is None):
            raise ValueError("link_latency_us and link_bandwidth_gbps go together (a LinkModel needs both)")

    @classmethod
    def from_dict(cls, config: "dict | KVTransferConfig") -> "KVTransferConfig":
        """The dict users pass as `LLM(kv_transfer_config=...)`; unknown keys are an error."""
        if isinstance(config, KVTransferConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"kv_transfer_config must be a dict or KVTransferConfig, got {type(config).__name__}")
        fields = {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id", "kv_load_failure_policy"}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(f"unknown kv_transfer_config keys {unknown}; known: {sorted(fields)}")
        missing = sorted({"kv_connector", "kv_role"} - set(config))
        if missing:
            raise ValueError(f"kv_transfer_config needs {missing}")
        return cls(**config)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def require(self, action: str) -> None:
        """ValueError if this node's role cannot `action` ("load" or "save")."""
        if action == "load" and not self.is_kv_consumer:
            raise ValueError(f"kv_role={self.kv_role!r} cannot load remote K/V (a request asked this node to); "
                             "use 'kv_consumer' or 'kv_both'")
        if action == "save" and not self.is_kv_producer:
            raise ValueError(f"kv_role={self.kv_role!r} cannot send or publish K/V (a request asked this node to); "
                             "use 'kv_producer' or 'kv_both'")
