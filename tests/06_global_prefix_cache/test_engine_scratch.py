"""The from-scratch layer in the engine, on SmolLM2: a prefill engine process (kv_producer) and
a decode engine in this process (kv_consumer) around a metadata server process.

Disaggregation (both forms), a shared pool, then every fault through the engine — each ends
with the request computed locally, its greedy tokens equal to an engine that computed
everything, no decode-engine block held (the autouse check), and the prefill engine's blocks
all free. The tests run in file order: the last ones kill the prefill engine, then the
metadata server."""
import time

import pytest

import gpc_engine_cases as cases
from gpc_engine_cases import assert_recomputed, on_decode, on_prefill, publish


@pytest.fixture(scope="module")
def cluster(engine_registry):
    from global_prefix_cache.metadata import MetadataServerProcess

    server = MetadataServerProcess()

    def config(role, **extra):
        return {"kv_connector": "GlobalKVPoolConnector", "kv_role": role,
                "kv_connector_extra_config": {"metadata_server": server.address, "pool_capacity_blocks": 16,
                                              "send_capacity_blocks": 16, **extra}}
    try:
        c = cases.start_cluster("scratch", server, config, engine_registry, load_timeout_s=8.0)
    except BaseException:
        server.stop()
        raise
    yield c
    cases.stop_cluster(c, engine_registry)
    server.stop()


def test_disaggregation_decode_continues_at_l_prompt(cluster, prompts, reference):
    cases.disaggregation_thesis_state(cluster, prompts, reference)


def test_disaggregation_vllm_form_recomputes_one_token(cluster, prompts, reference):
    cases.disaggregation_vllm_form(cluster, prompts, reference)


def test_shared_pool_second_engine_skips_the_system_prompt(cluster, prompts, reference):
    cases.shared_pool(cluster, prompts, reference)


def test_corrupted_payload(cluster, prompts, reference):
    prompt = publish(cluster, prompts, 200)
    cluster.prefill.set_faults(corrupt_payloads=1)            # one byte flipped in flight
    result = on_decode(cluster, "corrupt", prompt, 6)
    assert_recomputed(result, "checksum", prompt, reference, 6)
    cluster.prefill.check()


def test_timeout_on_a_silent_prefill_node(cluster, prompts, reference):
    prompt = publish(cluster, prompts, 201)
    extra = cluster.connector.config.extra
    extra["load_timeout_s"], saved = 1.0, extra["load_timeout_s"]     # this test waits 1 s, not 8
    cluster.prefill.pause()                                            # SIGSTOP: alive, silent
    try:
        t0 = time.monotonic()
        result = on_decode(cluster, "silent", prompt, 6)
        elapsed = time.monotonic() - t0
    finally:
        cluster.prefill.resume()
        extra["load_timeout_s"] = saved
    assert_recomputed(result, "timeout", prompt, reference, 6)
    assert elapsed < 1.0 + 15                                          # waited for the timeout, not forever
    cluster.prefill.check()


def test_stale_entry_evicted_between_query_and_read(cluster, prompts, reference):
    """The owner's pool slots are evicted and reused by its next request while our read is in
    flight (slowed down): the bytes no longer match the published checksum."""
    prompt = publish(cluster, prompts, 202)
    cluster.prefill.set_faults(serve_delay_s=3.0)
    evict = prompts.chat(prompts.system(203) + " " + "Extra rules follow. " * 52, "Hello?")
    assert len(evict) >= 16 * 16                                       # 16 new blocks: the owner's whole share

    def reuse_the_slots(step):
        if step == 0:                                                  # queried and reading: now evict
            on_prefill(cluster, "evict", evict)
    try:
        result = on_decode(cluster, "stale", prompt, 6, on_step=reuse_the_slots)
    finally:
        cluster.prefill.set_faults(serve_delay_s=0.0)
    assert_recomputed(result, "stale", prompt, reference, 6)
    assert "checksum" in result["failed_load"]
    cluster.prefill.check()


def test_node_dies_mid_transfer(cluster, prompts, reference):
    prompt = publish(cluster, prompts, 204)
    cluster.prefill.set_faults(serve_delay_s=2.0)                    # the read will be in flight

    def kill_the_owner(step):
        if step == 0:
            time.sleep(0.3)
            cluster.prefill.kill()                                     # SIGKILL while serving
    result = on_decode(cluster, "dies", prompt, 6, on_step=kill_the_owner)
    assert_recomputed(result, "unreachable", prompt, reference, 6)
    # The dead node (the only one in the pool) and its entries were dropped: nobody tries it again.
    from global_prefix_cache.metadata import MetadataClient
    client = MetadataClient(cluster.server.address)
    try:
        assert client.get_stats()["nodes"] == 0 and client.get_stats()["blocks"] == 0
    finally:
        client.close()


def test_metadata_server_unreachable(cluster, prompts, reference):
    cluster.server.stop()
    prompt = prompts.chat(prompts.system(205), "What is a geode?")
    t0 = time.monotonic()
    result = on_decode(cluster, "nomaster", prompt, 6)
    assert time.monotonic() - t0 < 30
    assert result["trace"][0][0] == "RUNNING" and result["external_tokens"] == 0   # a miss, computed here
    assert result["token_ids"] == reference(prompt, 6)
    assert cluster.connector.stats["failures"].get("unreachable", 0) >= 1
