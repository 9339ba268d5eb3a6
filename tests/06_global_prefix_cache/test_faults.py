"""Faults: each ends with the request computed locally (recompute), the K/V still exactly
the reference, no block leaked, and nothing waiting past its timeout.

  node dies mid-transfer  -> the owner is SIGKILLed while serving the read
  stale metadata          -> the owner evicts and reuses the slots between query and read
  master unreachable      -> the metadata server is gone: lookups miss, publishes are skipped
  timeout                 -> the owner is SIGSTOPped (alive, silent)
  corrupted payload       -> a byte flipped in flight: the transport checksum refuses it
  prefill node gone       -> a decode node's pull of pushed K/V fails
"""
import threading
import time

import numpy as np
import pytest
import torch

from global_prefix_cache.node import KVNode
from global_prefix_cache.rpc import RpcError

SYSTEM = list(range(10, 50))          # 40 shared tokens = 10 blocks of 4


def assert_recomputed(rc, reason):
    assert rc["failed_load"].startswith(reason), rc["failed_load"]
    assert rc["external_tokens"] == 0                         # nothing counted as loaded ...
    assert rc["trace"][0][0] == "WAITING_FOR_REMOTE_KVS"
    first_run = next(t for t in rc["trace"] if t[0] == "RUNNING")
    assert first_run[2] == rc["prompt_len"]                   # num_computed_tokens went back to 0: Δ = everything
    assert np.array_equal(rc["kv"], rc["reference_kv"])       # and computed the right K/V itself


def run_in_background(node, *args, **kwargs):
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=node.run(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, box


def test_node_dies_mid_transfer(metadata_service, pool_config, nodes):
    owner = nodes(kv_transfer_config=pool_config(metadata_service.address), shuffle_seed=1, node_id="owner")
    reader = nodes(kv_transfer_config=pool_config(metadata_service.address), shuffle_seed=2, node_id="reader")
    owner.run("w", SYSTEM + [1])
    owner.call("set_faults", {"serve_delay_s": 2.0})          # the read will be in flight for 2 s
    thread, box = run_in_background(reader, "r", SYSTEM + [2, 3])
    time.sleep(0.5)
    owner.kill()                                               # SIGKILL while serving
    thread.join(15)
    assert_recomputed(box["result"], "unreachable")
    reader.call("check")
    # The dead node's entries were dropped: the next request does not even try.
    assert reader.run("r2", SYSTEM + [4])["external_tokens"] == 0


def test_stale_entry_evicted_between_query_and_read(metadata_service, pool_config):
    owner = KVNode(pool_config(metadata_service.address, pool_capacity_blocks=10), shuffle_seed=1, node_id="owner")
    reader = KVNode(pool_config(metadata_service.address), shuffle_seed=2, node_id="reader")
    try:
        owner.run("w", SYSTEM + [1])                           # fills the owner's 10 pool slots
        owner.worker_connector.layer.engine.faults.serve_delay_s = 1.0   # the read waits; the eviction does not
        reader.add_request("r", SYSTEM + [2])
        reader.step()                                          # queried (10 hits), read in flight
        assert reader.records["r"].trace[0][0] == "WAITING_FOR_REMOTE_KVS"
        owner.run("evict", list(range(600, 641)))              # 10 new blocks: every old slot reused
        deadline = time.monotonic() + 10
        while "r" in reader.requests and time.monotonic() < deadline:
            reader.step()
            time.sleep(0.01)
        rec = reader.records["r"]
        assert rec.failed_load.startswith("stale") and "checksum" in rec.failed_load
        assert torch.equal(rec.kv, reader.model.reference_kv(SYSTEM + [2]))
        reader.check_all_free()
        owner.check_all_free()
    finally:
        owner.close()
        reader.close()


def test_master_unreachable(metadata_service, pool_config):
    owner = KVNode(pool_config(metadata_service.address), shuffle_seed=1, node_id="owner")
    node = KVNode(pool_config(metadata_service.address), shuffle_seed=2, node_id="n")
    try:
        owner.run("a", SYSTEM + [1])                           # published: a hit for anyone
        metadata_service.close()                               # the metadata server goes away
        t0 = time.monotonic()
        rec = node.run("b", SYSTEM + [2])                      # lookup fails -> a miss, computed here
        assert time.monotonic() - t0 < 5
        assert rec.external_tokens == 0 and rec.trace[0] == ("RUNNING", 41, 41)
        assert torch.equal(rec.kv, node.model.reference_kv(SYSTEM + [2]))
        # The lookup failed (the scheduler half), then the publish (the worker half): once each, as
        # each half then leaves the pool alone for pool_retry_s (its circuit breaker).
        assert node.kv_stats["failures"] == {"unreachable": 2}
        assert node.kv_stats["lookups"] == 1 and node.kv_stats["saved_blocks"] == 0
        assert node.run("c", SYSTEM + [3]).external_tokens == 0
        assert node.kv_stats["failures"] == {"unreachable": 2} and node.kv_stats["lookups"] == 1
        node.check_all_free()
    finally:
        owner.close()
        node.close()
    # Joining a pool whose server is not there is an error at start-up, not a hang.
    with pytest.raises(RpcError, match="register_node"):
        KVNode(pool_config(metadata_service.address, rpc_timeout_s=0.5), node_id="late")


def test_timeout_on_a_silent_node(metadata_service, pool_config, nodes):
    owner = nodes(kv_transfer_config=pool_config(metadata_service.address), shuffle_seed=1, node_id="owner")
    reader = nodes(kv_transfer_config=pool_config(metadata_service.address, load_timeout_s=1.0),
                   shuffle_seed=2, node_id="reader")
    owner.run("w", SYSTEM + [1])
    owner.pause()                                              # SIGSTOP: alive but silent
    try:
        t0 = time.monotonic()
        rc = reader.run("r", SYSTEM + [2])
        elapsed = time.monotonic() - t0
    finally:
        owner.resume()
    assert_recomputed(rc, "timeout")
    assert 1.0 <= elapsed < 4.0                                # waited for the timeout, not forever
    reader.call("check")


def test_corrupted_payload(metadata_service, pool_config, nodes):
    owner = nodes(kv_transfer_config=pool_config(metadata_service.address), shuffle_seed=1, node_id="owner")
    reader = nodes(kv_transfer_config=pool_config(metadata_service.address), shuffle_seed=2, node_id="reader")
    owner.run("w", SYSTEM + [1])
    owner.call("set_faults", {"corrupt_payloads": 1})
    rc = reader.run("r", SYSTEM + [2])
    assert_recomputed(rc, "checksum")
    reader.call("check")


def test_prefill_node_gone_before_the_pull(metadata_service, pool_config, nodes):
    prefill = nodes(kv_transfer_config=pool_config(metadata_service.address, "kv_producer", save_to_pool=False),
                    shuffle_seed=3, node_id="P")
    decode = nodes(kv_transfer_config=pool_config(metadata_service.address, "kv_consumer"), shuffle_seed=4, node_id="D")
    prompt = list(range(300, 321))
    rp = prefill.run("r", prompt, kv_transfer_params={"do_remote_decode": True})
    prefill.kill()
    rd = decode.run("r", prompt + rp["output_token_ids"], max_tokens=3, kv_transfer_params=rp["kv_transfer_params"])
    assert_recomputed(rd, "unreachable")
    decode.call("check")
