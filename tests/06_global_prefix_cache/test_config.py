"""KVTransferConfig and the connector's configuration errors: each one clear, none silent."""
import pytest

from global_prefix_cache.config import KVTransferConfig
from global_prefix_cache.kv_layout import NodeSpec


def test_vllm_dict_form_and_defaults():
    c = KVTransferConfig.from_dict({"kv_connector": "GlobalKVPoolConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"metadata_server": "127.0.0.1:1"}})
    assert c.is_kv_producer and c.is_kv_consumer and c.kv_load_failure_policy == "recompute"
    assert c.extra["pool_capacity_blocks"] == 256 and c.extra["metadata_server"] == "127.0.0.1:1"
    assert KVTransferConfig.from_dict(c) is c
    assert not KVTransferConfig("MooncakeConnector", "kv_consumer").is_kv_producer


@pytest.mark.parametrize("config, match", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "unknown kv_connector 'NixlConnector'; choose one of"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "decoder"}, "unknown kv_role 'decoder'"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"metadata_server": "x"}},
     r"MooncakeConnector does not understand kv_connector_extra_config keys \['metadata_server'\]"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"load_timeout_s": 0}},
     "load_timeout_s must be a number > 0"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"protocol": "udp"}},
     "protocol must be 'tcp' or 'rdma'"),
    ({"kv_connector": "GlobalKVPoolConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"link_latency_us": 5}}, "go together"),
    ({"kv_connector": "GlobalKVPoolConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
     "kv_load_failure_policy must be one of"),
    ({"kv_connector": "GlobalKVPoolConnector"}, r"needs \['kv_role'\]"),
    ({"kv_connector": "GlobalKVPoolConnector", "kv_role": "kv_both", "kv_port": 1}, r"unknown kv_transfer_config keys \['kv_port'\]"),
])
def test_bad_configs_are_refused_with_a_reason(config, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.from_dict(config)


def test_roles_that_cannot_do_what_is_asked():
    with pytest.raises(ValueError, match="kv_role='kv_producer' cannot load"):
        KVTransferConfig("MooncakeConnector", "kv_producer").require("load")
    with pytest.raises(ValueError, match="kv_role='kv_consumer' cannot send or publish"):
        KVTransferConfig("MooncakeConnector", "kv_consumer").require("save")


def test_node_spec_mismatch_names_every_difference():
    a = NodeSpec("SmolLM2", 16, 30, 3, 64, "float32")
    b = NodeSpec("SmolLM2", 32, 30, 3, 64, "float16")
    with pytest.raises(ValueError, match=r"block_size: here 16, the prefill node 32; dtype: here 'float32'"):
        a.check_compatible(b, "the prefill node")
    a.check_compatible(NodeSpec(**a.as_dict()))
    # Rank r moves bytes to rank r: two engines must split heads and layers the same way.
    with pytest.raises(ValueError, match=r"tp_size: here 1, the prefill node 2"):
        a.check_compatible(NodeSpec("SmolLM2", 16, 30, 3, 64, "float32", tp_size=2), "the prefill node")


def test_remote_sessions_name_one_side_channel_per_prefill_rank():
    from global_prefix_cache.transfer_params import parse_kv_transfer_params
    spec = NodeSpec("SmolLM2", 4, 30, 3, 64, "float32", tp_size=2).as_dict()
    params = {"do_remote_prefill": True, "remote_sessions": ["127.0.0.1:1"], "remote_request_id": "x",
              "num_tokens": 8, "spec": spec, "block_hashes": ["0" * 64] * 2}
    with pytest.raises(ValueError, match="has 1 addresses for a prefill node of 2 ranks"):
        parse_kv_transfer_params(params)
    both = dict(params, remote_sessions=["127.0.0.1:1", "127.0.0.1:2"])
    assert parse_kv_transfer_params(both)["remote_sessions"] == ["127.0.0.1:1", "127.0.0.1:2"]


def test_connector_level_errors(metadata_service, pool_config):
    from global_prefix_cache.node import KVNode
    with pytest.raises(ValueError, match="needs kv_connector_extra_config\\['metadata_server'\\]"):
        KVNode({"kv_connector": "GlobalKVPoolConnector", "kv_role": "kv_both"})
    a = KVNode(pool_config(metadata_service.address), block_size=4, node_id="a")
    try:
        # Same pool, different block size: refused when the node joins.
        with pytest.raises(ValueError, match="cannot join this pool.*block_size"):
            KVNode(pool_config(metadata_service.address), block_size=8, node_id="b")
        # A producer-only node asked to load (a decode-side request): refused.
        prod = KVNode(pool_config(metadata_service.address, role="kv_producer", save_to_pool=False), block_size=4)
        try:
            params = {"do_remote_prefill": True, "remote_sessions": ["127.0.0.1:1"], "remote_request_id": "x",
                      "num_tokens": 8, "spec": prod.connector.spec.as_dict(), "block_hashes": ["0" * 64] * 2}
            with pytest.raises(ValueError, match="cannot load remote K/V"):
                prod.run("r", list(range(10)), kv_transfer_params=params)
        finally:
            prod.close()
        # A decode node told to fetch K/V from a prefill node of another model: refused.
        bad = dict(a.connector.spec.as_dict(), model="another-model")
        params = {"do_remote_prefill": True, "remote_sessions": ["127.0.0.1:1"], "remote_request_id": "x",
                  "num_tokens": 8, "spec": bad, "block_hashes": ["0" * 64] * 2}
        with pytest.raises(ValueError, match="model: here 'fake-kv', the prefill node 'another-model'"):
            a.run("r2", list(range(10)), kv_transfer_params=params)
    finally:
        a.close()
