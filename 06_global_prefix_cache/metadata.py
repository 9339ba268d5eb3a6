"""The global metadata server: chained block hash -> where that block's K/V lives.

The `GlobalMetadataServer` of [vLLM 2.0 part 2, §7.2, §7.5] (`block_hash -> {node_id, memory_addr, size,
access_time}`, publish / query / invalidate, LRU), and what `mooncake_master` does for
Mooncake Store (PutStart / PutEnd, Get, Remove, eviction when a segment fills).

Why a chained hash is the right key: chapter 02's hash of block i covers blocks 0..i, so
equal hashes mean equal prefixes on any node — one dict probe per block, no token compare.
Why `query_prefix` stops at the first miss: block i is useless without blocks 0..i-1
(every position attends to all before it), and because of the chain, if block i is
missing no later block of this prompt can be "the same" block anyway.

Slots: every node contributes `capacity` block slots (its pool segment). The server hands
slots out (`allocate`, like PutStart) and evicts the node's least recently used block when
the node is full; the entry becomes visible only after the node has copied the bytes and
`publish`ed the checksum (like PutEnd), so a reader never finds a slot still being written.
A reader can still race an eviction (it queried, then the slot was reused): the block's
checksum, recorded at publish, catches that stale read.
"""
from __future__ import annotations

import argparse
import heapq
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

from global_prefix_cache.rpc import RpcClient, RpcError, RpcServer, free_port, parse_address
from processes import die_with_parent


@dataclass
class KVBlockMeta:
    """One published block. `slot` is the offset in blocks into the node's segment: block
    bytes of region r start at regions[r].base + slot * regions[r].block_len."""
    block_hash: int
    node_id: str
    slot: int
    size: int
    checksum: int
    last_access: float


@dataclass
class NodeInfo:
    node_id: str
    session: str                      # transfer-engine address "host:port"
    regions: list[tuple[int, int]]    # (base address, block_len) of each K/V tensor of its segment
    capacity: int                     # slots in its pool segment


class MetadataServer:
    """In-process, thread-safe (one lock). `MetadataService` serves it over TCP."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.spec: dict | None = None                         # the pool's K/V shape (first node sets it)
        self.nodes: dict[str, NodeInfo] = {}
        self._blocks: dict[int, KVBlockMeta] = {}             # published, visible
        self._lru: dict[str, OrderedDict[int, None]] = {}     # per node: published hashes, LRU first
        self._free: dict[str, list[int]] = {}                 # per node: free slots (a heap: lowest first,
                                                              # so a node's blocks stay in runs)
        self._pending: dict[str, dict[int, int]] = {}         # per node: hash -> slot being written
        self.stats = {"queries": 0, "query_blocks": 0, "hit_blocks": 0, "published": 0, "evicted": 0}

    # ---- nodes -------------------------------------------------------------------
    def join(self, node_id: str, spec: dict) -> None:
        """Every node that uses the pool, reader or writer, joins with its spec: the pool holds
        one model's K/V (the first node's spec), and a node of another model, block size or
        dtype is refused here, at start-up, with the fields that differ."""
        with self._lock:
            if self.spec is None:
                self.spec = dict(spec)
            elif dict(spec) != self.spec:
                diffs = {k: (spec.get(k), self.spec.get(k)) for k in set(spec) | set(self.spec)
                         if spec.get(k) != self.spec.get(k)}
                raise ValueError(f"node {node_id!r} cannot join this pool: its K/V differ {diffs} "
                                 "(node's value, pool's value) — same model, block size and dtype required")

    def register_node(self, node_id: str, session: str, spec: dict, regions: Sequence[Sequence[int]],
                      capacity: int) -> None:
        """A node that contributes pool memory (a producer): join, then its segment's slots."""
        with self._lock:
            self.join(node_id, spec)
            if node_id in self.nodes:
                self._drop_node(node_id)      # a restarted node: its old slots are gone
            self.nodes[node_id] = NodeInfo(node_id, session, [tuple(r) for r in regions], int(capacity))
            self._lru[node_id] = OrderedDict()
            self._free[node_id] = list(range(int(capacity)))
            self._pending[node_id] = {}

    def remove_node(self, node_id: str) -> int:
        """Forget a node that died or left; returns how many of its blocks were dropped."""
        with self._lock:
            return self._drop_node(node_id) if node_id in self.nodes else 0

    def _drop_node(self, node_id: str) -> int:
        hashes = list(self._lru.pop(node_id, ()))
        for h in hashes:
            del self._blocks[h]
        self.nodes.pop(node_id, None)
        self._free.pop(node_id, None)
        self._pending.pop(node_id, None)
        return len(hashes)

    def _node(self, node_id: str) -> NodeInfo:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise ValueError(f"unknown node {node_id!r}: call register_node first") from None

    # ---- writing: allocate (PutStart) -> copy bytes -> publish (PutEnd) -------------
    def allocate(self, node_id: str, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """Reserve slots on `node_id` for the hashes not already in the pool (published or
        pending anywhere). Evicts the node's least recently used blocks when it is full.
        Returns [(hash, slot)] in order; may be shorter if every slot is being written."""
        with self._lock:
            self._node(node_id)
            out = []
            free, lru, pending = self._free[node_id], self._lru[node_id], self._pending[node_id]
            for h in dict.fromkeys(block_hashes):
                if h in self._blocks or any(h in p for p in self._pending.values()):
                    continue
                if not free:
                    if not lru:
                        break                  # everything is pending: nothing to evict
                    victim, _ = lru.popitem(last=False)
                    heapq.heappush(free, self._blocks.pop(victim).slot)
                    self.stats["evicted"] += 1
                slot = heapq.heappop(free)
                pending[h] = slot
                out.append((h, slot))
            return out

    def publish(self, node_id: str, entries: Sequence[Sequence[int]], size: int) -> int:
        """Make reserved blocks visible: entries = [(hash, slot, checksum)]."""
        with self._lock:
            pending, now = self._pending[self._node(node_id).node_id], time.time()
            for h, slot, crc in entries:
                if pending.get(h) != slot:
                    raise ValueError(f"publish: block {h:#x} was not allocated to slot {slot} of node {node_id!r}")
                del pending[h]
                self._blocks[h] = KVBlockMeta(h, node_id, slot, int(size), int(crc), now)
                self._lru[node_id][h] = None
            self.stats["published"] += len(entries)
            return len(entries)

    def abort(self, node_id: str, block_hashes: Sequence[int]) -> None:
        """Release reservations whose bytes were never written."""
        with self._lock:
            pending = self._pending.get(node_id, {})
            for h in block_hashes:
                slot = pending.pop(h, None)
                if slot is not None:
                    heapq.heappush(self._free[node_id], slot)

    # ---- reading ----------------------------------------------------------------------
    def query_prefix(self, block_hashes: Sequence[int]) -> list[KVBlockMeta]:
        """The published blocks of the longest prefix of `block_hashes`; stops at the first
        miss. A hit is an access: it moves the block to its node's most-recently-used end."""
        with self._lock:
            ### BEGIN SOLUTION
            hits = []
            now = time.time()
            for h in block_hashes:
                meta = self._blocks.get(h)
                if meta is None:
                    break              # the chain is broken: no later block can be used
                meta.last_access = now
                self._lru[meta.node_id].move_to_end(h)
                hits.append(meta)
            ### END SOLUTION
            self.stats["queries"] += 1
            self.stats["query_blocks"] += len(block_hashes)
            self.stats["hit_blocks"] += len(hits)
            return hits

    def unpublish(self, block_hashes: Sequence[int]) -> int:
        """Invalidate blocks (their owner overwrote or lost them); frees their slots."""
        with self._lock:
            n = 0
            for h in block_hashes:
                meta = self._blocks.pop(h, None)
                if meta is not None:
                    del self._lru[meta.node_id][h]
                    heapq.heappush(self._free[meta.node_id], meta.slot)
                    n += 1
            return n

    def node_blocks(self, node_id: str) -> list[int]:
        """The node's published hashes, least recently used first."""
        with self._lock:
            return list(self._lru.get(node_id, ()))

    def get_stats(self) -> dict:
        with self._lock:
            return dict(self.stats, blocks=len(self._blocks), nodes=len(self.nodes))


class MetadataService:
    """A MetadataServer reachable over TCP on loopback, served from a thread of this process."""

    def __init__(self, server: MetadataServer | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server or MetadataServer()
        s = self.server
        self._rpc = RpcServer({
            "register_node": lambda h, _: (s.register_node(h["node_id"], h["session"], h["spec"], h["regions"],
                                                           h["capacity"]) or {}),
            "join": lambda h, _: (s.join(h["node_id"], h["spec"]) or {}),
            "remove_node": lambda h, _: {"removed": s.remove_node(h["node_id"])},
            "allocate": lambda h, _: {"slots": s.allocate(h["node_id"], h["hashes"])},
            "publish": lambda h, _: {"published": s.publish(h["node_id"], h["entries"], h["size"])},
            "abort": lambda h, _: (s.abort(h["node_id"], h["hashes"]) or {}),
            "query_prefix": lambda h, _: self._query(h["hashes"]),
            "unpublish": lambda h, _: {"removed": s.unpublish(h["hashes"])},
            "node_blocks": lambda h, _: {"hashes": s.node_blocks(h["node_id"])},
            "stats": lambda h, _: {"stats": s.get_stats()},
            "ping": lambda h, _: {},
        }, host, port)

    def _query(self, hashes: Sequence[int]) -> dict:
        hits = self.server.query_prefix(hashes)
        nodes = {m.node_id: asdict(self.server.nodes[m.node_id]) for m in hits}
        return {"blocks": [asdict(m) for m in hits], "nodes": nodes}

    @property
    def address(self) -> str:
        return self._rpc.address

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> "MetadataService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MetadataClient:
    """The MetadataServer API over the wire, every call bounded by `timeout` seconds.
    Raises RpcError (unreachable, timed out, or the server refused)."""

    def __init__(self, address: str, timeout: float = 2.0) -> None:
        parse_address(address)
        self.address = address
        self._rpc = RpcClient(address, timeout)

    def _call(self, op: str, **kw) -> dict:
        return self._rpc.call({"op": op, **kw})[0]

    def join(self, node_id: str, spec: dict) -> None:
        """ValueError (not an RpcError) when the pool refuses the node: a configuration error."""
        self._call_refusable("join", node_id=node_id, spec=spec)

    def register_node(self, node_id: str, session: str, spec: dict, regions, capacity: int) -> None:
        """ValueError (not an RpcError) when the pool refuses the node: a configuration error."""
        self._call_refusable("register_node", node_id=node_id, session=session, spec=spec,
                             regions=[list(r) for r in regions], capacity=capacity)

    def _call_refusable(self, op: str, **kw) -> None:
        try:
            self._call(op, **kw)
        except RpcError as e:
            if e.remote_type == "ValueError":
                raise ValueError(str(e)) from None
            raise

    def remove_node(self, node_id: str) -> int:
        return self._call("remove_node", node_id=node_id)["removed"]

    def allocate(self, node_id: str, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        return [tuple(x) for x in self._call("allocate", node_id=node_id, hashes=list(block_hashes))["slots"]]

    def publish(self, node_id: str, entries, size: int) -> int:
        return self._call("publish", node_id=node_id, entries=[list(e) for e in entries], size=size)["published"]

    def abort(self, node_id: str, block_hashes: Sequence[int]) -> None:
        self._call("abort", node_id=node_id, hashes=list(block_hashes))

    def query_prefix(self, block_hashes: Sequence[int]) -> tuple[list[KVBlockMeta], dict[str, NodeInfo]]:
        reply = self._call("query_prefix", hashes=list(block_hashes))
        nodes = {k: NodeInfo(**v) for k, v in reply["nodes"].items()}
        return [KVBlockMeta(**m) for m in reply["blocks"]], nodes

    def unpublish(self, block_hashes: Sequence[int]) -> int:
        return self._call("unpublish", hashes=list(block_hashes))["removed"]

    def node_blocks(self, node_id: str) -> list[int]:
        return self._call("node_blocks", node_id=node_id)["hashes"]

    def get_stats(self) -> dict:
        return self._call("stats")["stats"]

    def ping(self) -> None:
        self._call("ping")

    def close(self) -> None:
        self._rpc.close()


class MetadataServerProcess:
    """`python -m global_prefix_cache.metadata --port P` as a child process: a separate OS
    process, like mooncake_master. Started and stopped by this object (also on errors)."""

    def __init__(self, port: int | None = None, start_timeout: float = 30.0) -> None:
        self.port = port or free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "global_prefix_cache.metadata", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent)
        deadline = time.monotonic() + start_timeout
        client = MetadataClient(self.address, timeout=1.0)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"metadata server exited with {self.proc.returncode}: "
                                       f"{self.proc.stderr.read().decode()[-2000:]}")
                try:
                    client.ping()
                    break
                except RpcError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"metadata server not up on port {self.port} after {start_timeout} s")
                    time.sleep(0.05)
        finally:
            client.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stderr:
            self.proc.stderr.close()

    def __enter__(self) -> "MetadataServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the global prefix cache's metadata server (loopback)")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    service = MetadataService(port=args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"metadata server on {service.address} (pid {os.getpid()})", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        service.close()


if __name__ == "__main__":
    main()
