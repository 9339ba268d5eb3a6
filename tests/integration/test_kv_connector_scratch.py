"""The from-scratch layer in the engine, on SmolLM2: a prefill engine process (kv_producer) and
a decode engine in this process (kv_consumer) around a metadata server process.

Disaggregation (both forms), a shared pool, then every fault through the engine — each ends
with the request computed locally, its greedy tokens equal to an engine that computed
everything, no decode-engine block held (the autouse check), and the prefill engine's blocks
all free. The tests run in file order: the last ones kill the prefill engine, then the
metadata server."""
import time

import pytest

import kv_connector_cases as cases
from kv_connector_cases import BLOCK, ENGINE_KW, assert_recomputed, on_decode, on_prefill, publish
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.engine_process import worker_connector


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


def long_chat(prompts, index: int, question: str, repeats: int) -> list[int]:
    return prompts.chat(prompts.system(index) + " Follow the house rules." * repeats, question)


def test_params_of_another_prompt_never_become_its_tokens(cluster, prompts, reference):
    """A decode request for prompt Y that carries the params of the prefill node's prompt X:
    with nothing shared, nothing is loaded; with a shared system prompt, only the shared full
    blocks are. Either way Y's tokens are the plain engine's."""
    x = long_chat(prompts, 300, "Name a mineral.", 14)
    y = long_chat(prompts, 301, "How old is the oldest fossil?", 34)
    assert len(x) >= 130 and len(y) >= 230 and prompts.shared_prefix(x, y) < BLOCK
    params_x = on_prefill(cluster, "x", x, params={"do_remote_decode": True})["kv_transfer_params"]
    ry = on_decode(cluster, "y", y, 8, params_x)
    assert ry["external_tokens"] == 0 and ry["trace"][0][0] == "RUNNING"
    assert ry["token_ids"] == reference(y, 8)
    y2 = long_chat(prompts, 300, "How old is the oldest fossil?", 14)     # X's system prompt, another question
    shared = prompts.shared_prefix(x, y2) // BLOCK * BLOCK
    assert shared >= 6 * BLOCK
    ry2 = on_decode(cluster, "y2", y2, 8, params_x)
    assert ry2["external_tokens"] == shared and not ry2["failed_load"]
    assert ry2["token_ids"] == reference(y2, 8)
    cluster.prefill.check()


def test_malformed_params_are_refused_and_the_neighbour_is_served(cluster, prompts, reference):
    engine = cluster.decode
    good = prompts.chat(prompts.system(302), "What is amber?")
    params = on_prefill(cluster, "p302", good, params={"do_remote_decode": True})["kv_transfer_params"]
    engine.add_request("good", good, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for bad in ({**params, "num_tokens": "many"}, {**params, "num_tokens": None}, {**params, "spec": "smollm2"}):
        with pytest.raises(ValueError, match="kv_transfer_params"):
            engine.add_request("bad", good, SamplingParams(max_tokens=6), kv_transfer_params=bad)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finals) == ["good"] and list(finals["good"].outputs[0].token_ids) == reference(good, 6)


def test_a_consumer_of_another_model_cannot_join_the_pool(cluster, tmp_path):
    """A random model with SmolLM2's exact K/V layout (30 layers x 3 KV heads x 64, fp32), started
    as a kv_consumer of SmolLM2's pool in its own process: refused at start-up, by name."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mini_vllm.engine_process import EngineProcess
    from mini_vllm import default_model_path

    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=192, intermediate_size=64,
                                  num_hidden_layers=30, num_attention_heads=3, num_key_value_heads=3, head_dim=64,
                                  max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(tmp_path)
    kv_config = {"kv_connector": "GlobalKVPoolConnector", "kv_role": "kv_consumer",
                 "kv_connector_extra_config": {"metadata_server": cluster.server.address}}
    with pytest.raises(RuntimeError, match="cannot join this pool.*model"):
        EngineProcess(model=str(tmp_path), kv_transfer_config=kv_config, **ENGINE_KW).close()


def test_corrupted_payload(cluster, prompts, reference):
    prompt = publish(cluster, prompts, 200)
    cluster.prefill.set_faults(corrupt_payloads=1)            # one byte flipped in flight
    result = on_decode(cluster, "corrupt", prompt, 6)
    assert_recomputed(result, "checksum", prompt, reference, 6)
    cluster.prefill.check()


def test_timeout_on_a_silent_prefill_node(cluster, prompts, reference):
    prompt = publish(cluster, prompts, 201)
    extra = worker_connector(cluster.decode).config.extra                # the load's deadline is the worker's
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
