"""The metadata server: prefix query semantics, per-node LRU eviction, two-phase publish,
thread safety, and its TCP service (timeouts, refusals, a separate OS process)."""
import threading
import time

import pytest

from global_prefix_cache.metadata import MetadataClient, MetadataServer, MetadataServerProcess
from global_prefix_cache.rpc import RpcError, RpcServer, RpcTimeout

SPEC = {"model": "m", "block_size": 4}


def server_with(capacity=4, nodes=("a",)):
    s = MetadataServer()
    for n in nodes:
        s.register_node(n, f"127.0.0.1:{1000 + len(n)}", SPEC, [(4096, 64)], capacity)
    return s


def publish(s, node, hashes):
    slots = s.allocate(node, hashes)
    s.publish(node, [(h, slot, h * 10) for h, slot in slots], 64)
    return slots


def test_query_prefix_stops_at_the_first_miss():
    s = server_with(capacity=8)
    publish(s, "a", [1, 2, 4, 5])
    assert [m.block_hash for m in s.query_prefix([1, 2, 3, 4, 5])] == [1, 2]    # 4, 5 are past the break
    assert s.query_prefix([3, 1]) == []
    hits = s.query_prefix([1, 2])
    assert [(m.node_id, m.checksum, m.size) for m in hits] == [("a", 10, 64), ("a", 20, 64)]


def test_pending_blocks_are_invisible_until_published_and_abort_frees_them():
    s = server_with(capacity=2)
    (h, slot), = s.allocate("a", [7])
    assert s.query_prefix([7]) == []                  # bytes not copied yet
    assert s.allocate("a", [7]) == []                 # ... but nobody else reserves it twice
    s.abort("a", [7])
    assert sorted(slot for _, slot in s.allocate("a", [8, 9])) == [0, 1]


def test_already_published_hashes_are_not_stored_twice():
    s = server_with(capacity=4, nodes=("a", "b"))
    publish(s, "a", [1, 2])
    assert s.allocate("b", [1, 2, 3]) == [(3, 0)]


def test_lru_eviction_is_per_node_and_a_query_is_an_access():
    s = server_with(capacity=3, nodes=("a", "b"))
    publish(s, "a", [1, 2, 3])
    publish(s, "b", [100])
    s.query_prefix([1])                               # 1 is now the most recently used on a
    publish(s, "a", [4, 5])                           # evicts 2 then 3 (LRU), never b's block
    assert s.node_blocks("a") == [1, 4, 5]
    assert s.node_blocks("b") == [100]
    assert s.get_stats()["evicted"] == 2
    assert [m.block_hash for m in s.query_prefix([1, 2])] == [1]


def test_unpublish_and_remove_node():
    s = server_with(capacity=3, nodes=("a", "b"))
    publish(s, "a", [1, 2])
    publish(s, "b", [3])
    assert s.unpublish([2, 99]) == 1
    assert [m.block_hash for m in s.query_prefix([1, 2])] == [1]
    assert s.remove_node("b") == 1 and s.query_prefix([3]) == []
    assert s.allocate("a", [9, 10]) == [(9, 1), (10, 2)]     # the unpublished slot is reused (free list)


def test_a_node_with_another_kv_shape_cannot_join():
    s = server_with()
    with pytest.raises(ValueError, match="cannot join this pool.*block_size"):
        s.register_node("x", "h:1", {"model": "m", "block_size": 16}, [(1, 2)], 4)
    with pytest.raises(ValueError, match="unknown node"):
        s.allocate("nobody", [1])
    with pytest.raises(ValueError, match="was not allocated"):
        s.publish("a", [(1, 0, 5)], 64)


def test_concurrent_publishers_and_readers_keep_it_consistent():
    s = server_with(capacity=16, nodes=("a", "b", "c"))
    errors = []

    def worker(node, base):
        try:
            for i in range(200):
                publish(s, node, [base + i, base + i + 1])
                s.query_prefix([base + i, base + i + 1, base + i + 2])
        except Exception as e:     # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(n, k * 10_000)) for k, n in enumerate("abc")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for n in "abc":
        blocks = s.node_blocks(n)
        assert len(blocks) == 16                      # full, never over capacity
        slots = [s._blocks[h].slot for h in blocks]
        assert sorted(slots) == list(range(16))       # every slot used once


def test_service_over_tcp_and_errors(metadata_service):
    c = MetadataClient(metadata_service.address, timeout=1.0)
    c.register_node("a", "127.0.0.1:9", SPEC, [(4096, 64)], 2)
    (h, slot), = c.allocate("a", [2**200 + 5])         # sha256-sized hashes survive JSON
    c.publish("a", [(h, slot, 123)], 64)
    metas, nodes = c.query_prefix([2**200 + 5, 1])
    assert [m.block_hash for m in metas] == [2**200 + 5] and nodes["a"].regions == [[4096, 64]]
    with pytest.raises(ValueError, match="cannot join"):
        c.register_node("b", "x:1", {"model": "other"}, [], 1)
    with pytest.raises(RpcError, match="unknown node"):
        c.allocate("zzz", [1])
    c.close()


def test_unreachable_and_hung_servers_fail_within_the_timeout():
    from global_prefix_cache.rpc import free_port
    dead = MetadataClient(f"127.0.0.1:{free_port()}", timeout=0.5)
    with pytest.raises(RpcError, match="failed"):
        dead.query_prefix([1])
    hang = threading.Event()
    server = RpcServer({"query_prefix": lambda h, p: hang.wait(5) or {}})
    try:
        client = MetadataClient(server.address, timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(RpcTimeout, match="no answer within"):
            client.query_prefix([1])
        assert time.monotonic() - t0 < 2
    finally:
        hang.set()
        server.close()


def test_metadata_server_in_its_own_process():
    with MetadataServerProcess() as proc:
        c = MetadataClient(proc.address)
        c.register_node("a", "h:1", SPEC, [(1, 64)], 1)
        c.publish("a", [(h, s, 0) for h, s in c.allocate("a", [42])], 64)
        assert [m.block_hash for m in c.query_prefix([42])[0]] == [42]
        c.close()
    assert proc.proc.poll() is not None
