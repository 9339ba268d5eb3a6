"""Separate OS processes on loopback, the embedded layer: a producer node publishes, a
consumer node in another process gets the remote hit; a prefill node pushes into a decode
node. K/V compared byte for byte across the process boundary."""
import numpy as np


def test_pool_hit_across_processes(metadata_service, pool_config, nodes):
    producer = nodes(kv_transfer_config=pool_config(metadata_service.address), shuffle_seed=1, node_id="prod")
    consumer = nodes(kv_transfer_config=pool_config(metadata_service.address), shuffle_seed=2, node_id="cons")
    assert producer.pid != consumer.pid
    system = list(range(1, 41))                                  # a 40-token "system prompt"
    rp = producer.run("p", system + [900, 901], max_tokens=3)
    rc = consumer.run("c", system + [777, 778, 779], max_tokens=3)
    assert rc["trace"][0][0] == "WAITING_FOR_REMOTE_KVS" and rc["external_tokens"] == 40
    # Byte-identical K/V: the consumer's == the producer's on the shared 40 tokens == reference.
    assert np.array_equal(rc["kv"][:, :, :40], rp["kv"][:, :, :40])
    assert np.array_equal(rc["kv"], rc["reference_kv"])
    stats = consumer.call("stats")
    assert stats["connector"]["loaded_tokens"] == 40 and stats["connector"]["failures"] == {}
    producer.call("check")
    consumer.call("check")


def test_disaggregation_across_processes(metadata_service, pool_config, nodes):
    prefill = nodes(kv_transfer_config=pool_config(metadata_service.address, "kv_producer", save_to_pool=False),
                    shuffle_seed=3, node_id="P")
    decode = nodes(kv_transfer_config=pool_config(metadata_service.address, "kv_consumer"), shuffle_seed=4, node_id="D")
    prompt = list(range(300, 337))                                # 37 tokens
    rp = prefill.run("r", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    first = rp["output_token_ids"]
    rd = decode.run("r", prompt + first, max_tokens=4, kv_transfer_params=rp["kv_transfer_params"])
    assert rd["trace"][0] == ("WAITING_FOR_REMOTE_KVS", 37, 0)
    assert np.array_equal(rd["kv"][:, :, :37], rp["kv"])
    assert np.array_equal(rd["kv"], rd["reference_kv"])
    prefill.call("check")
    decode.call("check")
    assert prefill.call("stats")["connector"]["pushed_blocks"] == 10
