"""The real Mooncake layer in the engine, on SmolLM2: `mooncake_master` (started here on a free
loopback port), a prefill engine process (kv_producer, MooncakeConnector: Mooncake's
TransferEngine pushes its K/V, the DistributedStore is the pool) and a decode engine in this
process (kv_consumer). The same cases as the from-scratch layer (kv_connector_cases.py): greedy
tokens equal to one engine computing everything, every block free afterwards."""
import pytest

import kv_connector_cases as cases


@pytest.fixture(scope="module")
def cluster(engine_registry, mooncake_master):
    def config(role, **extra):
        return {"kv_connector": "MooncakeConnector", "kv_role": role,
                "kv_connector_extra_config": {"master_server": mooncake_master.address,
                                              "global_segment_size": 64 << 20, "local_buffer_size": 32 << 20,
                                              "send_capacity_blocks": 16, **extra}}
    c = cases.start_cluster("mooncake", mooncake_master, config, engine_registry, load_timeout_s=20.0)
    yield c
    cases.stop_cluster(c, engine_registry)


def test_disaggregation_decode_continues_at_l_prompt(cluster, prompts, reference):
    cases.disaggregation_thesis_state(cluster, prompts, reference)


def test_disaggregation_vllm_form_recomputes_one_token(cluster, prompts, reference):
    cases.disaggregation_vllm_form(cluster, prompts, reference)


def test_shared_pool_second_engine_skips_the_system_prompt(cluster, prompts, reference):
    cases.shared_pool(cluster, prompts, reference)
