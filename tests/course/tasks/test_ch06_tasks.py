"""Chapter 06's connector regions without a network (tests/course/tasks/conftest.py): the pool's
server, the transfer engine and the K/V memory are fakes of this file, so each rule is checked on
what the task's code asked of them and what it did with the answers — `_match_pool` (which
blocks every rank can load), `ScratchLayer.pool_load` (one read per owner, grouped, into the
right blocks) and `ConnectorWorker._serve_pull` (the push of a staged prompt). The public
tests run the same code between real nodes over loopback."""
import random
import zlib

import pytest

from global_prefix_cache.config import KVTransferConfig
from global_prefix_cache.connector import CONNECTORS
from global_prefix_cache.connector_scheduler import ConnectorScheduler
from global_prefix_cache.connector_worker import ConnectorWorker, _Staged
from global_prefix_cache.grouping import Region, build_transfer_params
from global_prefix_cache.kv_layout import NodeSpec
from global_prefix_cache.layers import LoadError, PoolHit, ScratchLayer, pool_key
from global_prefix_cache.metadata import KVBlockMeta, NodeInfo
from global_prefix_cache.transfer_engine import TransferResult
from global_prefix_cache.transfer_params import encode_hashes
from scheduler import Request

BLOCK_SIZE = 4
BLOCK_BYTES = 16               # bytes of one block in one K or V tensor
NUM_REGIONS = 2                # one layer: K and V
NUM_BLOCKS = 8


def config(role="kv_both", **extra):
    return KVTransferConfig("GlobalKVPoolConnector", role,
                            {"metadata_server": "127.0.0.1:1", "model": "fake-kv", **extra})


def spec(tp_size=1):
    return NodeSpec("fake-kv", BLOCK_SIZE, 1, 2, 2, "float32", tp_size=tp_size)


# ------------------------------------------------------------------ the scheduler half: _match_pool


class FakePool:
    """The pool's server as the scheduler half sees it (CONNECTORS' layer): published keys, and
    the prefix of a query they cover."""

    def __init__(self, config, node_id, spec, role):
        self.published: set[int] = set()
        self.queries: list[list[int]] = []
        self.error: Exception | None = None
        self.answer_other = False

    def pool_query(self, keys):
        self.queries.append(list(keys))
        if self.error is not None:
            raise self.error
        hits = []
        for key in keys:
            if key not in self.published:
                break
            hits.append(PoolHit(key + 1 if self.answer_other else key, key % 1000, ("node", key)))
        return hits

    def close(self):
        pass


@pytest.fixture
def scheduler_half(monkeypatch):
    monkeypatch.setitem(CONNECTORS, "GlobalKVPoolConnector", FakePool)

    def make(tp_size=1, **extra):
        return ConnectorScheduler(config("kv_consumer", **extra), spec(tp_size), "node-a")
    return make


def publish(conn, request, blocks, ranks):
    hashes = [h.hash_value for h in conn._block_hashes(request)]
    for rank in ranks:
        conn.layer.published |= {pool_key(h, rank) for h in hashes[:blocks]}
    return hashes


def test_match_pool_loads_the_published_run_after_the_local_hit_and_leaves_one_token(scheduler_half):
    """The pool is asked, once, for the blocks after the local hit up to the last one that leaves
    a token to compute; the hit is the published prefix of them: its tokens, asynchronous, and
    the load planned into the blocks the request then owns (hits kept for the worker)."""
    def check(conn, req, hashes, computed, want_keys, want_blocks, block_ids):
        n = len(conn.layer.queries)
        got = conn.get_num_new_matched_tokens(req, computed)
        assert got == ((want_blocks * BLOCK_SIZE, True) if want_blocks else (0, False))
        assert conn.layer.queries[n:] == ([want_keys] if want_keys else [])
        if want_blocks:
            conn.update_state_after_alloc(req, block_ids, want_blocks * BLOCK_SIZE)
            load = conn.build_connector_meta(None).loads[-1]
            first = computed // BLOCK_SIZE
            assert (load.request_id, load.mode, load.first_block, load.num_blocks) == (req.request_id, "pool", first, want_blocks)
            assert load.block_ids == block_ids[first:first + want_blocks]
            assert [h.block_hash for h in load.hits[0]] == hashes[first:first + want_blocks]

    conn = scheduler_half(1)
    req = Request("r", list(range(100, 117)), 1)            # 17 tokens: 4 full blocks and one token
    hashes = publish(conn, req, 3, [0])
    check(conn, req, hashes, 0, hashes[0:4], 3, [10, 11, 12, 13, 14])
    assert conn.stats["lookups"] == 1 and conn.stats["hit_blocks"] == 3
    req2 = Request("r2", list(range(100, 117)), 1)          # a local hit of one block: ask from block 1
    check(conn, req2, hashes, 4, hashes[1:4], 2, [7, 8, 9, 10, 11])
    whole = Request("w", list(range(100, 116)), 1)          # 16 tokens, all 4 blocks published
    publish(conn, whole, 4, [0])
    check(conn, whole, hashes, 0, hashes[0:3], 3, [1, 2, 3, 4])  # the last token is computed: 3 blocks
    assert conn.stats["hit_blocks"] == 8 and conn.stats["lookups"] == 3
    short = Request("s", list(range(100, 105)), 1)          # one block and a token, the block is local
    check(conn, short, hashes, 4, None, 0, [])
    miss = Request("m", list(range(500, 517)), 1)           # nothing published: a miss after a query
    check(conn, miss, hashes, 0, [h.hash_value for h in conn._block_hashes(miss)][0:4], 0, [])
    assert conn.stats["lookups"] == 4 and conn.stats["hit_blocks"] == 8


def test_match_pool_takes_the_shortest_share_of_every_rank(scheduler_half):
    """Each rank publishes its own share under its own key (pool_key(hash, rank)): a block is a
    hit only when every rank has it, so the hit is the shortest rank's run, and every rank's hits
    are kept for that many blocks."""
    conn = scheduler_half(2)
    req = Request("r", list(range(100, 121)), 1)            # 5 full blocks and one token
    hashes = publish(conn, req, 4, [0])
    publish(conn, req, 2, [1])
    assert conn.get_num_new_matched_tokens(req, 0) == (2 * BLOCK_SIZE, True)
    assert conn.layer.queries[0] == [pool_key(h, 0) for h in hashes[:5]]
    assert conn.layer.queries[1] in ([pool_key(h, 1) for h in hashes[:4]], [pool_key(h, 1) for h in hashes[:5]])
    conn.update_state_after_alloc(req, [9, 8, 7, 6, 5, 4], 2 * BLOCK_SIZE)
    load = conn.build_connector_meta(None).loads[0]
    assert load.num_blocks == 2 and load.block_ids == [9, 8]
    assert {r: [h.block_hash for h in hits] for r, hits in load.hits.items()} == \
        {0: [pool_key(h, 0) for h in hashes[:2]], 1: [pool_key(h, 1) for h in hashes[:2]]}
    none = Request("n", list(range(100, 121)), 1)
    conn.layer.published -= {pool_key(hashes[0], 1)}        # rank 1 lacks the first block: no hit at all
    assert conn.get_num_new_matched_tokens(none, 0) == (0, False)
    assert conn.stats["hit_blocks"] == 2


def test_match_pool_an_unreachable_or_confused_pool_is_a_miss(scheduler_half):
    """A query that fails (the server is unreachable) is a miss, counted as "unreachable", and the
    pool is left alone for pool_retry_s (no query at all meanwhile); an answer for other keys
    than asked is a miss counted as "mismatch"."""
    conn = scheduler_half(1, pool_retry_s=3600.0)
    req = Request("r", list(range(100, 117)), 1)
    publish(conn, req, 4, [0])
    conn.layer.error = ConnectionError("metadata server gone")
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert conn.stats["failures"] == {"unreachable": 1} and len(conn.layer.queries) == 1
    conn.layer.error = None
    assert conn.get_num_new_matched_tokens(Request("r2", list(range(100, 117)), 1), 0) == (0, False)
    assert len(conn.layer.queries) == 1                      # down: not asked again
    other = scheduler_half(1)
    publish(other, req, 4, [0])
    other.layer.answer_other = True
    assert other.get_num_new_matched_tokens(req, 0) == (0, False)
    assert other.stats["failures"] == {"mismatch": 1} and other.stats["hit_blocks"] == 0


# ------------------------------------------------------------------ the worker half: pool_load


class Memory:
    """One node's registered K/V memory: NUM_REGIONS tensors of NUM_BLOCKS blocks at small fake
    addresses from `base` (a KVLayout for the loader: regions, block_checksums)."""

    def __init__(self, base: int, seed: int):
        self.base = base
        self.buf = bytearray(random.Random(seed).randbytes(NUM_REGIONS * NUM_BLOCKS * BLOCK_BYTES))

    @property
    def regions(self):
        return [Region(self.base + r * NUM_BLOCKS * BLOCK_BYTES, BLOCK_BYTES, NUM_BLOCKS) for r in range(NUM_REGIONS)]

    def read(self, addr: int, n: int) -> bytes:
        off = addr - self.base
        assert 0 <= off and off + n <= len(self.buf), f"address {addr} (+{n}) is not in this memory"
        return bytes(self.buf[off:off + n])

    def write(self, addr: int, data: bytes) -> None:
        off = addr - self.base
        assert 0 <= off and off + len(data) <= len(self.buf), f"address {addr} (+{len(data)}) is not in this memory"
        self.buf[off:off + len(data)] = data

    def block(self, i: int) -> bytes:
        return b"".join(self.read(r.base + i * r.block_len, r.block_len) for r in self.regions)

    def block_checksums(self, ids):
        return [zlib.crc32(self.block(i)) for i in ids]


class ReadEngine:
    """Our TransferEngine's reads (submit / wait) between fake memories: session -> Memory."""

    def __init__(self, local: Memory, peers: dict):
        self.local, self.peers = local, peers
        self.batches: list[tuple[str, list[int], list[int], list[int]]] = []
        self.failing: set[str] = set()

    def submit(self, op, target, buffers, peer_buffer_addresses, lengths, tag=None, timeout=None, cancelled=None):
        assert op == "read", f"a load reads, got op {op!r}"
        self.batches.append((target, list(buffers), list(peer_buffer_addresses), list(lengths)))
        return len(self.batches) - 1

    def wait(self, batch_id, timeout=None):
        target, buffers, peers, lengths = self.batches[batch_id]
        if target in self.failing:
            return TransferResult(False, f"connection refused by {target}")
        for local, peer, n in zip(buffers, peers, lengths):
            self.local.write(local, self.peers[target].read(peer, n))
        return TransferResult(True, num_bytes=sum(lengths), num_transfers=len(lengths))


def pool_fixture():
    local = Memory(1024, 1)
    owners = {"A": Memory(4096, 2), "B": Memory(8192, 3)}
    infos = {s: NodeInfo(f"node-{s}", s, [(r.base, r.block_len) for r in m.regions], NUM_BLOCKS)
             for s, m in owners.items()}
    layer = ScratchLayer.__new__(ScratchLayer)
    layer.engine = ReadEngine(local, owners)

    def hit(session, slot, checksum=None):
        crc = owners[session].block_checksums([slot])[0] if checksum is None else checksum
        meta = KVBlockMeta(1000 + slot, infos[session].node_id, slot, NUM_REGIONS * BLOCK_BYTES, crc, 0.0)
        return PoolHit(1000 + slot, crc, (infos[session], meta))
    return local, owners, layer, hit


def test_pool_load_reads_each_owners_blocks_in_one_batch_grouped_into_runs():
    """Hits of several owners, interleaved: one read per owner (in the order owners first appear),
    each pulling that owner's slots into its own destination blocks with contiguous runs merged
    (build_transfer_params: our blocks are the destination, the owner's segment the peer); the
    bytes land, the checksums hold, and the bytes moved are returned."""
    local, owners, layer, hit = pool_fixture()
    before = bytes(local.buf)
    hits = [hit("A", 3), hit("A", 4), hit("B", 0), hit("A", 6), hit("B", 1)]
    dst = [5, 6, 2, 7, 3]
    n = layer.pool_load(local, hits, dst, timeout=5.0)
    assert n == len(hits) * NUM_REGIONS * BLOCK_BYTES
    assert [b[0] for b in layer.engine.batches] == ["A", "B"]
    for session, slots, blocks in (("A", [3, 4, 6], [5, 6, 7]), ("B", [0, 1], [2, 3])):
        want = build_transfer_params(local.regions, owners[session].regions, blocks, slots)
        got = next(b[1:] for b in layer.engine.batches if b[0] == session)
        assert sorted(zip(*got)) == sorted(zip(*want))
        for slot, block in zip(slots, blocks):
            assert local.block(block) == owners[session].block(slot)
    untouched = [i for i in range(NUM_BLOCKS) if i not in dst]
    fresh = Memory(1024, 1)
    fresh.buf[:] = before
    assert [local.block(i) for i in untouched] == [fresh.block(i) for i in untouched]


def test_pool_load_a_failed_read_or_a_wrong_checksum_is_a_load_error():
    """A read the engine reports failed raises LoadError with the failure's reason (a refused
    connection: "unreachable"); a block whose bytes do not match its published checksum raises
    LoadError "stale"."""
    local, owners, layer, hit = pool_fixture()
    layer.engine.failing.add("B")
    with pytest.raises(LoadError) as e:
        layer.pool_load(local, [hit("A", 1), hit("B", 2)], [0, 1], timeout=5.0)
    assert e.value.reason == "unreachable" and "node-B" in str(e.value)
    local, owners, layer, hit = pool_fixture()
    with pytest.raises(LoadError) as e:
        layer.pool_load(local, [hit("A", 1), hit("A", 2, checksum=7)], [4, 5], timeout=5.0)
    assert e.value.reason == "stale"
    assert local.block(4) == owners["A"].block(1)


# ------------------------------------------------------------------ the prefill node's push: _serve_pull


class Segment(Memory):
    """The worker's send buffer (a BlockSegment): staged prompts' slots."""

    def __init__(self, base, seed):
        super().__init__(base, seed)
        self.freed: list[list[int]] = []

    def free(self, slots):
        self.freed.append(list(slots))


class PushEngine:
    """Mooncake's batch_transfer_sync_write into the decode node's memory."""

    def __init__(self, send: Segment, decode: Memory, rc: int = 0):
        self.send, self.decode, self.rc = send, decode, rc
        self.writes: list[tuple] = []
        self.last_error = "peer closed the connection"

    def batch_transfer_sync_write(self, target, buffers, peer_buffer_addresses, lengths, tag=None):
        self.writes.append((target, list(buffers), list(peer_buffer_addresses), list(lengths), tag))
        if self.rc == 0:
            for src, dst, n in zip(buffers, peer_buffer_addresses, lengths):
                self.decode.write(dst, self.send.read(src, n))
        return self.rc


class PushLayer:
    def __init__(self, config, node_id, spec, role):
        self.engine = None

    def close(self):
        pass


def producer(monkeypatch, rc=0):
    monkeypatch.setitem(CONNECTORS, "GlobalKVPoolConnector", PushLayer)
    worker = ConnectorWorker(config("kv_producer"), spec(), 0, "prefill")
    send, decode = Segment(2048, 4), Memory(16384, 5)
    worker.send_segment = send
    worker.layer.engine = PushEngine(send, decode, rc)
    hashes = [11, 22, 33, 44]
    worker._staged["x"] = _Staged(slots=[6, 7, 2, 3], num_tokens=15, expires=1e18, block_hashes=hashes)
    return worker, send, decode, hashes


def header(decode, first, block_ids, hashes):
    return {"request_id": "x", "first_block": first, "block_ids": block_ids, "wait_s": 1.0,
            "block_hashes": encode_hashes(hashes), "spec": spec().as_dict(),
            "regions": [(r.base, r.block_len, r.num_blocks) for r in decode.regions],
            "target": "decode:1", "tag": "t-1"}


def test_serve_pull_pushes_the_asked_blocks_of_the_staged_prompt_into_the_decode_nodes_blocks(monkeypatch):
    """A pull for the staged blocks from its first_block on (their hashes match): one batch_transfer_sync_write to the
    puller's target with its tag, from the staged slots of those blocks to the puller's block
    ids in its regions (contiguous runs merged); the staged slots are freed, the request is
    finished sending, and the answer holds the blocks' checksums and what moved."""
    worker, send, decode, hashes = producer(monkeypatch)
    answer = worker._serve_pull(header(decode, 1, [4, 5, 0], hashes[1:4]), None)
    engine = worker.layer.engine
    assert len(engine.writes) == 1
    target, buffers, peers, lengths, tag = engine.writes[0]
    assert (target, tag) == ("decode:1", "t-1")
    want = build_transfer_params(send.regions, decode.regions, [7, 2, 3], [4, 5, 0])
    assert sorted(zip(buffers, peers, lengths)) == sorted(zip(*want))
    for slot, block in zip([7, 2, 3], [4, 5, 0]):
        assert decode.block(block) == send.block(slot)
    assert answer["checksums"] == send.block_checksums([7, 2, 3])
    assert answer["num_bytes"] == 3 * NUM_REGIONS * BLOCK_BYTES and answer["num_transfers"] == len(lengths)
    assert send.freed == [[6, 7, 2, 3]] and "x" not in worker._staged
    assert worker._drain_sending(0.0) == {"x"} and worker.stats["pushed_blocks"] == 3


def test_serve_pull_a_failed_push_is_an_error_and_frees_the_staged_slots(monkeypatch):
    """The engine's non-zero return code: IOError naming the request and the engine's last error;
    the staged slots are freed all the same and nothing counts as pushed."""
    worker, send, decode, hashes = producer(monkeypatch, rc=-1)
    with pytest.raises(IOError, match="push of request x failed: peer closed"):
        worker._serve_pull(header(decode, 0, [1, 2], hashes[0:2]), None)
    assert len(worker.layer.engine.writes) == 1
    assert send.freed == [[6, 7, 2, 3]] and worker.stats["pushed_blocks"] == 0
