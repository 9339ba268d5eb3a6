"""The real system, on loopback: Mooncake's TransferEngine pushes prefill K/V into a decode
node in another process (batch_transfer_sync_write, contiguous blocks grouped), and Mooncake
Store (mooncake_master + MooncakeDistributedStore) is the global pool. The tests start and
stop mooncake_master themselves; nothing must be running beforehand."""
import time

import numpy as np
import pytest
import torch

from global_prefix_cache.mooncake_layer import MooncakeMaster, port_answers
from global_prefix_cache.node import KVNode
from global_prefix_cache.rpc import free_port

SYSTEM = list(range(10, 50))


def test_master_starts_and_stops_on_a_free_loopback_port():
    master = MooncakeMaster()
    try:
        assert master.address.startswith("127.0.0.1:") and port_answers(master.address)
    finally:
        master.stop()
    assert master.proc.poll() is not None and not port_answers(master.address, 0.2)


def test_transfer_engine_push_across_processes(mooncake_master, mooncake_config, nodes):
    prefill = nodes(kv_transfer_config=mooncake_config(mooncake_master.address, "kv_producer", save_to_pool=False),
                    shuffle_seed=3, node_id="P")
    decode = nodes(kv_transfer_config=mooncake_config(mooncake_master.address, "kv_consumer"), shuffle_seed=4, node_id="D")
    prompt = list(range(300, 337))
    rp = prefill.run("r", prompt, kv_transfer_params={"do_remote_decode": True})
    rd = decode.run("r", prompt + rp["output_token_ids"], max_tokens=4, kv_transfer_params=rp["kv_transfer_params"])
    assert rd["trace"][0] == ("WAITING_FOR_REMOTE_KVS", 37, 0)
    assert np.array_equal(rd["kv"][:, :, :37], rp["kv"]) and np.array_equal(rd["kv"], rd["reference_kv"])
    assert prefill.call("stats")["connector"]["pushed_blocks"] == 10
    prefill.call("check")
    decode.call("check")


def test_store_is_the_pool_across_processes(mooncake_master, mooncake_config, nodes):
    producer = nodes(kv_transfer_config=mooncake_config(mooncake_master.address), shuffle_seed=1, node_id="p")
    consumer = nodes(kv_transfer_config=mooncake_config(mooncake_master.address), shuffle_seed=2, node_id="c")
    rp = producer.run("p", SYSTEM + [1], max_tokens=2)
    rc = consumer.run("c", SYSTEM + [2, 3], max_tokens=2)
    assert rc["trace"][0] == ("WAITING_FOR_REMOTE_KVS", 40, 0) and rc["external_tokens"] == 40
    assert np.array_equal(rc["kv"][:, :, :40], rp["kv"][:, :, :40]) and np.array_equal(rc["kv"], rc["reference_kv"])
    consumer.call("check")


def test_push_grouping_makes_one_transfer_per_run(mooncake_master, mooncake_config):
    """The decode node's blocks are shuffled; the push is one batch_transfer_sync_write whose
    entries = (K/V tensors) x (runs of blocks contiguous on both sides)."""
    from global_prefix_cache.grouping import group_concurrent_contiguous
    p = KVNode(mooncake_config(mooncake_master.address, "kv_producer", save_to_pool=False), shuffle_seed=5)
    d = KVNode(mooncake_config(mooncake_master.address, "kv_consumer"), shuffle_seed=6)
    calls = []
    engine = p.worker_connector.layer.engine
    original = engine.batch_transfer_sync_write
    engine.batch_transfer_sync_write = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        prompt = list(range(64))
        rp = p.run("r", prompt, kv_transfer_params={"do_remote_decode": True})
        d.add_request("r", prompt + rp.output_token_ids, 2)
        d.requests["r"].kv_transfer_params = rp.kv_transfer_params
        d.step()
        dst = d.worker_connector._jobs["r"].spec.block_ids
        while "r" in d.requests:
            d.step()
            time.sleep(0.002)
        (target, buffers, peers, lengths), = calls
        runs = len(group_concurrent_contiguous(list(range(len(dst))), dst)[0])
        assert target == d.worker_connector.layer.engine.session_id
        assert len(lengths) == 2 * p.spec.num_layers * runs < 2 * p.spec.num_layers * len(dst)
        assert torch.equal(d.records["r"].kv, d.model.reference_kv(prompt + rp.output_token_ids))
    finally:
        p.close()
        d.close()


def test_corrupted_stored_block_falls_back(mooncake_master, mooncake_config):
    owner = KVNode(mooncake_config(mooncake_master.address), shuffle_seed=1)
    node = KVNode(mooncake_config(mooncake_master.address), shuffle_seed=2)
    try:
        prompt = list(range(700, 741))
        owner.run("a", prompt)
        layer = owner.worker_connector.layer
        key = layer.key(node.connector._block_hashes(_Req("b", prompt + [1]))[3].hash_value)
        value = bytearray(layer.store.get(key))
        value[20] ^= 0xFF                       # a flipped byte at rest
        time.sleep(0.2)                         # the read lease (100 ms) must lapse before remove
        assert layer.store.remove(key) == 0 and layer.store.put(key, bytes(value)) == 0
        rec = node.run("b", prompt + [1])
        assert rec.failed_load.startswith("checksum") and rec.external_tokens == 0
        assert torch.equal(rec.kv, node.model.reference_kv(prompt + [1]))
        node.check_all_free()
    finally:
        owner.close()
        node.close()


def test_master_unreachable(mooncake_config, nodes):
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="does not answer"):
        KVNode(mooncake_config(dead, rpc_timeout_s=0.5))
    assert time.monotonic() - t0 < 3           # checked before setup(), which would block ~90 s
    # The master dies while nodes run (in their own processes: store clients whose master is
    # gone linger until their process exits).
    master = MooncakeMaster()
    try:
        owner = nodes(kv_transfer_config=mooncake_config(master.address), shuffle_seed=1)
        node = nodes(kv_transfer_config=mooncake_config(master.address), shuffle_seed=2)
        owner.run("a", SYSTEM + [1])
        master.stop()
        t0 = time.monotonic()
        rec = node.run("b", SYSTEM + [2])      # its lookup fails: a miss, computed here
        assert time.monotonic() - t0 < 5
        assert rec["external_tokens"] == 0 and rec["trace"][0] == ("RUNNING", 41, 41)
        assert np.array_equal(rec["kv"], rec["reference_kv"])
        # The lookup (scheduler half) and the publish (worker half) failed, once each (circuit breakers).
        assert node.call("stats")["connector"]["failures"] == {"unreachable": 2}
        node.call("check")
    finally:
        master.stop()


class _Req:
    def __init__(self, rid, tokens):
        self.request_id, self.all_token_ids, self.cache_salt = rid, tokens, None


def test_push_larger_than_one_mooncake_batch(mooncake_master, mooncake_config):
    """A push with more (src, dst, len) entries than one batch_transfer_sync_write accepts is
    split into batches (the real limit is a few thousand entries; lowered here to 7)."""
    p = KVNode(mooncake_config(mooncake_master.address, "kv_producer", save_to_pool=False), shuffle_seed=7)
    d = KVNode(mooncake_config(mooncake_master.address, "kv_consumer"), shuffle_seed=8)
    try:
        p.worker_connector.layer.engine.MAX_BATCH = 7
        prompt = list(range(50))
        rp = p.run("r", prompt, kv_transfer_params={"do_remote_decode": True})
        rd = d.run("r", prompt + rp.output_token_ids, kv_transfer_params=rp.kv_transfer_params)
        assert rd.external_tokens == 50 and not rd.failed_load
        assert torch.equal(rd.kv, d.model.reference_kv(prompt + rp.output_token_ids))
    finally:
        p.close()
        d.close()
