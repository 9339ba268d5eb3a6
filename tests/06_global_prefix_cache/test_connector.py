"""The connector driven by this chapter's KVConnectorScheduler over chapter 02's KV cache (KVNode), two
nodes in this process, real K/V bytes through the real sockets: the scheduler's path
(WAITING_FOR_REMOTE_KVS, then num_computed_tokens advanced), byte-identical K/V in the
consumer's own shuffled blocks, the one-token rule, and no block leaked."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from global_prefix_cache.node import KVNode


@pytest.fixture
def two_nodes(metadata_service, pool_config):
    made = []

    def make(role_a="kv_both", role_b="kv_both", **kw):
        a = KVNode(pool_config(metadata_service.address, role_a), shuffle_seed=1, node_id="A", **kw)
        b = KVNode(pool_config(metadata_service.address, role_b), shuffle_seed=2, node_id="B", **kw)
        made.extend([a, b])
        return a, b
    yield make
    for n in made:
        n.close()


def test_remote_prefix_hit_follows_the_scheduler_path(two_nodes):
    a, b = two_nodes()
    prompt = list(range(100, 130))                     # 30 tokens: 7 full blocks of 4
    ra = a.run("a", prompt, max_tokens=2)
    assert ra.external_tokens == 0 and torch.equal(ra.kv, a.model.reference_kv(prompt))
    rb = b.run("b", prompt + [7, 8], max_tokens=2)     # 32 tokens: may load 7 blocks, computes 4
    assert rb.trace[0] == ("WAITING_FOR_REMOTE_KVS", 28, 0)
    running = [t for t in rb.trace if t[0] == "RUNNING"]
    assert running[0] == ("RUNNING", 32, 4)            # admitted at 28 computed, Δ = 4, advanced to 32
    assert rb.external_tokens == 28 and rb.local_hit_tokens == 0
    assert torch.equal(rb.kv, b.model.reference_kv(prompt + [7, 8]))     # byte-identical K/V
    assert rb.output_token_ids == KVNode(shuffle_seed=3).run("c", prompt + [7, 8], max_tokens=2).output_token_ids
    assert b.kv_stats["loaded_tokens"] == 28 and b.kv_stats["failures"] == {}
    a.check_all_free()
    b.check_all_free()


def test_blocks_land_in_the_consumers_own_block_ids(two_nodes):
    a, b = two_nodes()
    prompt = list(range(40))
    a.run("a", prompt)
    b.add_request("b", prompt + [1])
    b.step()                                           # matched and allocated, load started
    spec = b.worker_connector._jobs["b"].spec
    owner_slots = [h.location[1].slot for h in spec.hits[0]]
    assert spec.block_ids != owner_slots and len(spec.block_ids) == 10
    while "b" in b.requests:
        b.step()
    assert torch.equal(b.records["b"].kv, b.model.reference_kv(prompt + [1]))


def test_local_hit_then_remote_rest_and_the_last_token_is_always_computed(two_nodes):
    a, b = two_nodes()
    prompt = list(range(200, 224))                     # 24 tokens = 6 full blocks
    a.run("a", prompt)
    warm = b.run("warm", prompt[:8])                   # 8 tokens: block 0 from the pool, block 1 computed
    assert (warm.local_hit_tokens, warm.external_tokens) == (0, 4)
    rb = b.run("b", prompt)
    # 6 full blocks exist, but the last token must be computed: 5 blocks usable, 2 of them local.
    assert (rb.local_hit_tokens, rb.external_tokens) == (8, 12)
    assert torch.equal(rb.kv, b.model.reference_kv(prompt))
    b.check_all_free()


def test_roles(two_nodes):
    a, b = two_nodes(role_a="kv_producer", role_b="kv_consumer")
    prompt = list(range(300, 320))
    a.run("a", prompt)
    a.run("a2", prompt)                                # a producer never loads, not even its own blocks
    assert a.kv_stats["lookups"] == 0 and a.kv_stats["saved_blocks"] == 5
    rb = b.run("b", prompt + [1])
    assert rb.external_tokens == 20
    assert b.kv_stats["saved_blocks"] == 0             # a consumer never publishes
    assert b.run("b2", list(range(900, 920))).external_tokens == 0


def test_disaggregation_prefill_pushes_into_decode(metadata_service, pool_config):
    p = KVNode(pool_config(metadata_service.address, "kv_producer", save_to_pool=False), shuffle_seed=5, node_id="P")
    d = KVNode(pool_config(metadata_service.address, "kv_consumer"), shuffle_seed=6, node_id="D")
    try:
        prompt = list(range(500, 523))                 # 23 tokens: a partial last block
        rp = p.run("x", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = rp.kv_transfer_params
        assert params["num_tokens"] == 23 and params["do_remote_prefill"]
        rd = d.run("x", prompt + rp.output_token_ids, max_tokens=5, kv_transfer_params=params)
        # [Kwon 2025, Table 4.1]: the decode node starts at num_computed = L_prompt, num_tokens = L_prompt + 1.
        assert rd.trace[0] == ("WAITING_FOR_REMOTE_KVS", 23, 0)
        assert ("RUNNING", 24, 1) in rd.trace
        whole = KVNode(shuffle_seed=7).run("x", prompt, max_tokens=6)
        assert rp.output_token_ids + rd.output_token_ids == whole.output_token_ids
        assert torch.equal(rd.kv, d.model.reference_kv(prompt + rp.output_token_ids))
        assert p.kv_stats["pushed_blocks"] == 6
        p.check_all_free()
        d.check_all_free()
        segment = p.worker_connector.send_segment
        assert segment.num_free == segment.capacity    # staging given back
    finally:
        p.close()
        d.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 14), st.integers(1, 3)), min_size=1, max_size=6),
       st.integers(0, 1000))
def test_random_shared_prefixes_always_give_the_reference_kv(metadata_service, pool_config, plan, seed):
    """Requests on two nodes drawn from 4 'system prompts' + random suffixes: whatever hits,
    every request's K/V equals computing it alone, and every block comes back."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
    nodes = [KVNode(pool_config(metadata_service.address), shuffle_seed=seed + i, node_id=f"n{seed}-{i}",
                    num_blocks=48) for i in range(2)]
    try:
        for i, (sys_id, extra, max_tokens) in enumerate(plan):
            prompt = systems[sys_id] + [rng.randrange(1000) for _ in range(extra)]
            node = nodes[i % 2]
            rec = node.run(f"r{i}", prompt, max_tokens=max_tokens)
            assert torch.equal(rec.kv, node.model.reference_kv(prompt))
        for n in nodes:
            n.check_all_free()
    finally:
        for n in nodes:
            n.close()
