"""Fixtures for chapter 06: servers and node processes on loopback, always cleaned up.

Every process a test starts is reaped by a finalizer (stop -> terminate -> kill), also when
the test fails; every server listens on a port the OS picked.
"""
import pytest

from global_prefix_cache.metadata import MetadataService

MODEL = "fake-kv"


def pool_config(address: str, role: str = "kv_both", **extra) -> dict:
    return {"kv_connector": "GlobalKVPoolConnector", "kv_role": role,
            "kv_connector_extra_config": {"metadata_server": address, "model": MODEL, "load_timeout_s": 5.0,
                                          **extra}}


def mooncake_config(master: str, role: str = "kv_both", **extra) -> dict:
    return {"kv_connector": "MooncakeConnector", "kv_role": role,
            "kv_connector_extra_config": {"master_server": master, "model": MODEL, "load_timeout_s": 5.0,
                                          "global_segment_size": 16 << 20, "local_buffer_size": 16 << 20, **extra}}


@pytest.fixture(name="pool_config")
def _pool_config():
    return pool_config


@pytest.fixture(name="mooncake_config")
def _mooncake_config():
    return mooncake_config


@pytest.fixture
def metadata_service():
    service = MetadataService()
    yield service
    service.close()


@pytest.fixture
def nodes():
    """nodes(**KVNode kwargs) -> a NodeProcess, closed after the test whatever happens."""
    from global_prefix_cache.node import NodeProcess
    started = []

    def start(**kwargs):
        node = NodeProcess(**kwargs)
        started.append(node)
        return node
    yield start
    for node in started:          # all shut down at once (closing a Mooncake client takes ~2 s)
        node.request_stop()
    for node in reversed(started):
        node.close()


@pytest.fixture(scope="module")
def mooncake_master():
    from global_prefix_cache.mooncake_layer import MooncakeMaster
    master = MooncakeMaster()
    yield master
    master.stop()

