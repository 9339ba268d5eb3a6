"""The two layers behind the connector: where pool blocks live and how bytes move.

Both give the connector's two halves the same things. The scheduler half (`KVConnectorRole.SCHEDULER`,
in the engine core) only asks `pool_query`; the worker half (one per rank) does the rest:
  engine        Mooncake's TransferEngine API (session_id, register_memory,
                batch_transfer_sync_write) — used for prefill -> decode pushes
  pool_query    longest published prefix of a list of block hashes (stops at the first miss)
  pool_begin_save / pool_copy / pool_end_save
                reserve room, copy blocks (layer by layer if the model runner wants), publish
  pool_load     copy published blocks into local KV blocks, checksums verified
  close

`ScratchLayer` ([vLLM 2.0 part 2, §7.5], built here): `MetadataServer` + our `TransferEngine`; each
node's pool share is a `BlockSegment` it serves itself, readers pull by address.
`MooncakeLayer` lives in `mooncake_layer.py`: mooncake_master + MooncakeDistributedStore.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from global_prefix_cache.config import KVConnectorRole, KVTransferConfig
from global_prefix_cache.grouping import Region, build_transfer_params
from global_prefix_cache.kv_layout import BlockSegment, KVLayout, NodeSpec
from global_prefix_cache.metadata import KVBlockMeta, MetadataClient, NodeInfo
from global_prefix_cache.rpc import RpcError
from global_prefix_cache.transfer_engine import LinkModel, TransferEngine
from kvcache.hashing import sha256_hash


class LoadError(RuntimeError):
    """A remote load failed; `reason` is one of: unreachable, timeout, checksum, stale,
    mismatch (K/V of other tokens), refused. The request falls back to computing its K/V
    locally."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class PoolHit:
    """One block found in the pool: enough to fetch and verify it."""
    block_hash: int
    checksum: int
    location: object          # layer-specific: (node session, regions, slot) or a store key


def pool_key(block_hash: int, rank: int) -> int:
    """The pool's key for rank `rank`'s share of block `block_hash` (its heads, its stage's
    layers). Every rank publishes and loads its own share under its own key; rank 0's key is the
    block's chained hash itself, so a one-rank engine's pool is keyed by chapter 02's hashes."""
    return block_hash if rank == 0 else sha256_hash(("rank", rank, block_hash))


def classify(error: str) -> str:
    """A failure's reason from an engine's error text (for LoadError and the stats)."""
    e = error.lower()
    if "checksum" in e:
        return "checksum"
    if "mismatch" in e:
        return "mismatch"
    if "within" in e or "timed out" in e or "timeout" in e:
        return "timeout"
    if "refused" in e or "closed" in e or "reset" in e or "unreachable" in e or "failed" in e:
        return "unreachable"
    return "refused"


class ScratchLayer:
    """The from-scratch pool: metadata over RPC, bytes pulled from the owner's segment."""

    name = "scratch"

    def __init__(self, config: KVTransferConfig, node_id: str, spec: NodeSpec, role: KVConnectorRole) -> None:
        extra = config.extra
        if not extra["metadata_server"]:
            raise ValueError("GlobalKVPoolConnector needs kv_connector_extra_config['metadata_server'] = 'host:port' "
                             "(start one with global_prefix_cache.MetadataService or MetadataServerProcess)")
        self.node_id, self.config, self.spec = node_id, config, spec
        self.metadata = MetadataClient(extra["metadata_server"], timeout=extra["rpc_timeout_s"])
        self.segment: BlockSegment | None = None
        self.engine = None                     # the scheduler half moves no bytes
        if role is KVConnectorRole.WORKER:
            link = None
            if extra["link_latency_us"] is not None:
                link = LinkModel(extra["link_latency_us"] * 1e-6, extra["link_bandwidth_gbps"] * 1e9 / 8)
            self.engine = TransferEngine(link=link, timeout=extra["load_timeout_s"])

    def start(self, layout: KVLayout) -> None:
        """The worker half's K/V are registered: open the transfer engine, and join the pool
        (a producer with a segment of its own, a consumer as a reader)."""
        spec = self.spec
        self.engine.initialize("127.0.0.1")
        for r in layout.regions:
            self.engine.register_memory(r.base, r.block_len * r.num_blocks)
        if self.config.is_kv_producer and self.config.extra["save_to_pool"]:
            self.segment = BlockSegment(layout, self.config.extra["pool_capacity_blocks"])
            for r in self.segment.regions:
                self.engine.register_memory(r.base, r.block_len * r.num_blocks)
            regions = [(r.base, r.block_len) for r in self.segment.regions]
            # A refused node (different model/block size) is a configuration error: raise.
            self.metadata.register_node(self.node_id, self.engine.session_id, spec.as_dict(), regions,
                                        self.segment.capacity)
        elif self.config.is_kv_consumer:
            # A reader joins too: another model's node must not read this pool (its block hashes
            # could never hit, being seeded with its spec, but the mistake deserves an error).
            # An unreachable server is not fatal for a reader: it computes until the pool is back.
            try:
                self.metadata.join(self.node_id, spec.as_dict())
            except RpcError:
                pass

    # ---- pool ------------------------------------------------------------------------
    def pool_query(self, block_hashes: Sequence[int]) -> list[PoolHit]:
        metas, nodes = self.metadata.query_prefix(block_hashes)
        return [PoolHit(m.block_hash, m.checksum, (nodes[m.node_id], m)) for m in metas]

    def pool_begin_save(self, layout: KVLayout, block_ids: Sequence[int], block_hashes: Sequence[int]):
        """Reserve pool slots for the blocks the pool lacks (PutStart). Returns a save handle:
        [(local block, hash, slot)], possibly empty."""
        if self.segment is None or not block_hashes:
            return []
        slots = self.metadata.allocate(self.node_id, block_hashes)      # new hashes only, LRU evicted
        by_hash = dict(zip(block_hashes, block_ids))
        return [(by_hash[h], h, s) for h, s in slots]

    def pool_copy(self, layout: KVLayout, handle, regions=None) -> None:
        """Copy (some K/V tensors of) the reserved blocks into their slots: a local memcpy."""
        if handle:
            layout.copy_blocks_to(self.segment, [b for b, _, _ in handle], [s for _, _, s in handle], regions)

    def pool_end_save(self, layout: KVLayout, handle) -> int:
        """Checksum the slots and publish them (PutEnd): from now on other nodes hit them."""
        if not handle:
            return 0
        crcs = self.segment.block_checksums([s for _, _, s in handle])
        return self.metadata.publish(self.node_id, [(h, s, c) for (_, h, s), c in zip(handle, crcs)],
                                     layout.bytes_per_block)

    def pool_abort_save(self, handle) -> None:
        if handle:
            try:
                self.metadata.abort(self.node_id, [h for _, h, _ in handle])
            except RpcError:
                pass

    def pool_load(self, layout: KVLayout, hits: Sequence[PoolHit], dst_block_ids: Sequence[int],
                  timeout: float, cancelled: threading.Event | None = None) -> int:
        """Pull each hit from its owner's segment into dst_block_ids (grouped per owner and
        contiguous run), then verify every block against its published checksum."""
        ### BEGIN SOLUTION
        by_node: dict[str, list[tuple[PoolHit, int]]] = {}
        for hit, dst in zip(hits, dst_block_ids):
            info, meta = hit.location
            by_node.setdefault(info.session, []).append((hit, dst))
        num_bytes = 0
        for session, items in by_node.items():
            info: NodeInfo = items[0][0].location[0]
            remote = [Region(base, block_len, info.capacity) for base, block_len in info.regions]
            slots = [h.location[1].slot for h, _ in items]
            dsts = [d for _, d in items]
            # Our blocks are the destination: the "peer" of a read is the owner's segment.
            local, peer, lengths = build_transfer_params(layout.regions, remote, dsts, slots)
            batch = self.engine.submit("read", session, local, peer, lengths, timeout=timeout, cancelled=cancelled)
            result = self.engine.wait(batch, timeout=timeout)
            if not result.ok:
                raise LoadError(classify(result.error), f"reading from node {info.node_id}: {result.error}")
            num_bytes += result.num_bytes
        ### END SOLUTION
        got = layout.block_checksums(dst_block_ids)
        for hit, crc in zip(hits, got):
            if crc != hit.checksum:
                # The owner reused that slot after our query (evicted), or its memory is bad.
                raise LoadError("stale", f"block {hit.block_hash:#x}: checksum {crc:#x} != published "
                                         f"{hit.checksum:#x} (slot evicted and reused since the query?)")
        return num_bytes

    def forget_node(self, node_id: str) -> None:
        """A node we could not reach: drop its entries so nobody else tries it."""
        try:
            self.metadata.remove_node(node_id)
        except RpcError:
            pass

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.metadata.close()


def hit_node_id(hit: PoolHit) -> str | None:
    loc = hit.location
    if isinstance(loc, tuple) and len(loc) == 2 and isinstance(loc[1], KVBlockMeta):
        return loc[1].node_id
    return None
