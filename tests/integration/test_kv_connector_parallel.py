"""Chapter 06's connector in tensor- and pipeline-parallel engines: the scheduler half in the engine
core, a worker half in every rank, each moving only its own heads (TP) or layers (PP).

The oracle is the plain engine's greedy tokens; what shows that every rank moved its own share is
the prefill engine's counters (each rank pushes every block of its share) and the pool's contents
(each rank publishes its share under its own key)."""
from __future__ import annotations

import math
import time

import pytest

from mini_vllm.engine_process import run_requests
from mini_vllm.sampling_params import SamplingParams

PROMPT = [(17 * i) % 3000 + 200 for i in range(23)]          # 23 tokens: 5 full blocks of 4 and a partial one
LAYOUTS = {"TP=2": dict(tensor_parallel_size=2), "PP=2": dict(pipeline_parallel_size=2)}


@pytest.fixture
def pool():
    from global_prefix_cache.metadata import MetadataService
    service = MetadataService()
    yield service
    service.close()


def scratch(pool, role: str, **extra) -> dict:
    return {"kv_connector": "GlobalKVPoolConnector", "kv_role": role,
            "kv_connector_extra_config": {"metadata_server": pool.address, "load_timeout_s": 20.0, **extra}}


def greedy(engine, rid, prompt, max_tokens, params=None) -> dict:
    result, = run_requests(engine, [{"request_id": rid, "prompt_token_ids": prompt, "max_tokens": max_tokens,
                                     "kv_transfer_params": params}])
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_and_decode_move_every_ranks_share(make_engine, pool, layout):
    """Disaggregation between two engines of the same layout: rank r of the prefill engine pushes
    its share of every block into rank r of the decode engine, which computes one token."""
    plain = greedy(make_engine(), "plain", PROMPT, 6)["token_ids"]
    prefill = make_engine(kv_transfer_config=scratch(pool, "kv_producer", save_to_pool=False), **LAYOUTS[layout])
    decode = make_engine(kv_transfer_config=scratch(pool, "kv_consumer"), **LAYOUTS[layout])
    rp = greedy(prefill, "r", PROMPT, 1, {"do_remote_decode": True})
    params = rp["kv_transfer_params"]
    assert len(params["remote_sessions"]) == 2 and len(set(params["remote_sessions"])) == 2     # one per rank
    rd = greedy(decode, "r", PROMPT + rp["token_ids"], 5, params)
    assert rd["trace"][0] == ("WAITING_FOR_REMOTE_KVS", len(PROMPT), 0) and not rd["failed_load"]
    assert rd["num_cached_tokens"] == len(PROMPT)
    assert rp["token_ids"] + rd["token_ids"] == plain
    blocks = math.ceil(len(PROMPT) / 4)
    assert prefill.engine_core.kv_connector_stats()["connector"]["pushed_blocks"] == 2 * blocks   # each rank, all


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_pool_holds_every_ranks_share_and_another_engine_loads_them(make_engine, pool, layout):
    plain = greedy(make_engine(), "plain", PROMPT, 4)["token_ids"]
    a = make_engine(kv_transfer_config=scratch(pool, "kv_both"), **LAYOUTS[layout])
    b = make_engine(kv_transfer_config=scratch(pool, "kv_both"), **LAYOUTS[layout])
    assert greedy(a, "a", PROMPT, 4)["token_ids"] == plain
    assert pool.server.get_stats()["blocks"] == 2 * (len(PROMPT) // 4)      # 5 full blocks, two shares each
    rb = greedy(b, "b", PROMPT, 4)
    assert rb["external_tokens"] == 20 and rb["num_cached_tokens"] == 20 and not rb["failed_load"]
    assert rb["token_ids"] == plain


def test_a_prefill_node_split_another_way_is_refused(make_engine, pool):
    """Rank r's bytes go to rank r: a decode engine of another tensor-parallel size refuses the params
    when the request is added, naming the difference, and goes on serving."""
    prefill = make_engine(kv_transfer_config=scratch(pool, "kv_producer", save_to_pool=False))
    decode = make_engine(kv_transfer_config=scratch(pool, "kv_consumer"), tensor_parallel_size=2)
    params = greedy(prefill, "r", PROMPT, 1, {"do_remote_decode": True})["kv_transfer_params"]
    with pytest.raises(ValueError, match=r"tp_size: here 2, the prefill node 1"):
        decode.add_request("r", PROMPT, SamplingParams(max_tokens=2), kv_transfer_params=params)
    assert greedy(decode, "next", PROMPT, 2)["token_ids"]


@pytest.mark.parametrize("tp", [1, 2])
def test_abort_while_loading_frees_the_blocks_only_once_every_rank_stopped(make_engine, pool, tp):
    """A request aborted while its K/V is on its way: its blocks stay allocated until every rank
    has given the load up (a rank may still be writing them), then they are free — and the engine
    serves the next request with the right tokens."""
    slow = dict(link_latency_us=1_500_000, link_bandwidth_gbps=10.0)       # every push takes 1.5 s
    prefill = make_engine(kv_transfer_config=scratch(pool, "kv_producer", save_to_pool=False, **slow),
                          tensor_parallel_size=tp)
    decode = make_engine(kv_transfer_config=scratch(pool, "kv_consumer"), tensor_parallel_size=tp)
    params = greedy(prefill, "r", PROMPT, 1, {"do_remote_decode": True})["kv_transfer_params"]
    decode.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=4), kv_transfer_params=params)
    decode.step()                                                           # the load starts
    core = decode.engine_core
    held = core.kv_cache_manager.num_blocks - core.kv_cache_manager.num_free_blocks
    assert held == math.ceil(len(PROMPT) / 4)
    decode.abort_request("r")
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks - held   # not yet
    deadline = time.monotonic() + 30
    while core.scheduler.has_unfinished_requests():
        assert time.monotonic() < deadline, "the aborted load never stopped"
        decode.step()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    assert not any(core.model_executor.collective_rpc("has_pending_kv_loads"))
    plain = greedy(make_engine(), "plain", PROMPT, 3)["token_ids"]
    assert greedy(decode, "next", PROMPT, 3)["token_ids"] == plain
