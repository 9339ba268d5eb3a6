"""The real system: Mooncake's transfer engine and store, from PyPI
(`mooncake-transfer-engine-non-cuda`, TCP transport on loopback here; RDMA on real clusters).

  * `MooncakeEngine` — `mooncake.engine.TransferEngine` behind the same small API as our
    `TransferEngine`: initialize(host, "P2PHANDSHAKE", protocol, "") with no metadata
    service (peers are found by "host:rpc_port"), `register_memory`, and
    `batch_transfer_sync_write(target, buffers, peer_buffer_addresses, lengths)` — exactly
    what vLLM's MooncakeConnector calls to push prefill K/V into a decode node.
  * `MooncakeMaster` — starts and stops `mooncake_master` (the store's metadata and
    allocation service) on a free loopback port.
  * `MooncakeLayer` — the global pool on `mooncake.store.MooncakeDistributedStore`
    (setup / put / get / batch_is_exist / remove): each node contributes
    `global_segment_size` bytes; the master places objects and evicts when segments fill.

Traps of mooncake 0.3.13.post1: `setup` with no master listening blocks for a long time
holding the GIL (so no Python timeout can interrupt it): we check that the master's port
answers first. A key cannot be removed while its read lease is held (`default_kv_lease_ttl`,
10 s by default; remove returns -706), so the master we start uses a short lease. After the
master dies, calls return errors (-900) instead of hanging, but each put still waits seconds
for it. One batch_transfer_sync_write takes at most a few thousand entries: pushes are split
into batches of MAX_BATCH.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from global_prefix_cache.config import KVConnectorRole, KVTransferConfig
from global_prefix_cache.kv_layout import KVLayout, NodeSpec
from global_prefix_cache.layers import LoadError, PoolHit
from global_prefix_cache.rpc import free_port, parse_address
from processes import die_with_parent

_HEADER = 8      # a stored block = crc32 (8 bytes, little endian) + the block's packed bytes


def _import_transfer_engine():
    """mooncake.engine.TransferEngine, its library loaded quietly. Mooncake logs through glog at
    INFO by default, benign errors included ("Local segment descriptor not found" at every set-up);
    every failure reaches us as a return code. MC_LOG_LEVEL (INFO / WARNING / ERROR) is read once,
    when the library loads: set for the import only, so the process's environment stays its own."""
    saved = os.environ.get("MC_LOG_LEVEL")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    finally:
        if saved is None:
            os.environ.pop("MC_LOG_LEVEL", None)
    return TransferEngine


def mooncake_master_binary() -> str:
    """The `mooncake_master` executable the pip package installs next to python."""
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    path = here if os.path.exists(here) else shutil.which("mooncake_master")
    if not path:
        raise FileNotFoundError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
                                "(and apt-get install libibverbs1 librdmacm1)")
    return path


def port_answers(address: str, timeout: float = 1.0) -> bool:
    host, port = parse_address(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


class MooncakeMaster:
    """`mooncake_master` on 127.0.0.1:<free port>, stopped on close (or with the `with`)."""

    def __init__(self, rpc_port: int | None = None, lease_ttl_ms: int = 100, start_timeout: float = 20.0) -> None:
        self.rpc_port = rpc_port or free_port()
        metrics_port = free_port()
        self.proc = subprocess.Popen(
            [mooncake_master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             f"--metrics_port={metrics_port}", "--metrics_host=127.0.0.1", f"--default_kv_lease_ttl={lease_ttl_ms}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
            preexec_fn=die_with_parent)
        deadline = time.monotonic() + start_timeout
        while not port_answers(self.address, 0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start on {self.address} "
                                   f"(exit code {self.proc.returncode})")
            time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def __enter__(self) -> "MooncakeMaster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class MooncakeEngine:
    """mooncake.engine.TransferEngine with our engine's surface (session_id, last_error)."""

    # One batch takes a bounded number of entries (a few thousand; more returns -1).
    # (K/V tensors x runs reaches that quickly: 60 tensors x 65 scattered blocks = 3900.)
    MAX_BATCH = 1024

    def __init__(self, protocol: str = "tcp", hostname: str = "127.0.0.1") -> None:
        self._te = _import_transfer_engine()()
        rc = self._te.initialize(hostname, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"mooncake TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}) = {rc}")
        self.session_id = f"{hostname}:{self._te.get_rpc_port()}"
        self._registered: list[int] = []
        self.last_error = ""

    def register_memory(self, addr: int, length: int) -> int:
        rc = self._te.register_memory(addr, length)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory({addr:#x}, {length}) = {rc}")
        self._registered.append(addr)
        return rc

    def batch_transfer_sync_write(self, target: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], tag: str | None = None) -> int:
        """One call, many (src, dst, len) entries. `tag` is ignored: Mooncake has no way to
        refuse a late write, so a decode node must not reuse blocks while a push may land."""
        buffers, peers, lengths = list(buffers), list(peer_buffer_addresses), list(lengths)
        for i in range(0, len(lengths), self.MAX_BATCH):
            j = i + self.MAX_BATCH
            rc = self._te.batch_transfer_sync_write(target, buffers[i:j], peers[i:j], lengths[i:j])
            if rc != 0:
                self.last_error = f"mooncake batch_transfer_sync_write to {target} returned {rc}"
                return rc
        self.last_error = ""
        return 0

    def revoke_tag(self, tag: str) -> None:
        pass

    def close(self) -> None:
        for addr in self._registered:
            self._te.unregister_memory(addr)
        self._registered.clear()


@dataclass
class MooncakeFaults:
    """Fault injection for tests and demos (Mooncake has none we can reach from Python)."""
    load_delay_s: float = 0.0      # wait before reading pool blocks: a slow store, or time for a race


class MooncakeLayer:
    """The pool on Mooncake Store: one object per block, key = namespace + chained hash."""

    name = "mooncake"

    def __init__(self, config: KVTransferConfig, node_id: str, spec: NodeSpec, role: KVConnectorRole) -> None:
        extra = config.extra
        if not extra["master_server"]:
            raise ValueError("MooncakeConnector needs kv_connector_extra_config['master_server'] = 'host:port' "
                             "of a running mooncake_master (global_prefix_cache.MooncakeMaster starts one)")
        if not port_answers(extra["master_server"], extra["rpc_timeout_s"]):
            raise ConnectionError(f"mooncake_master at {extra['master_server']} does not answer")
        self.config, self.node_id = config, node_id
        self.faults = MooncakeFaults()
        worker = role is KVConnectorRole.WORKER
        # The scheduler half only asks which keys exist: a client that gives the store no memory.
        self.engine = MooncakeEngine(extra["protocol"]) if worker else None
        from mooncake.store import MooncakeDistributedStore
        self.store = MooncakeDistributedStore()
        segment, buffer = (extra["global_segment_size"], extra["local_buffer_size"]) if worker else (0, 1 << 20)
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment, buffer, extra["protocol"], "",
                              extra["master_server"])
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup(master={extra['master_server']}) = {rc}")
        # Different models / block sizes / parallel layouts never share keys; the store itself cannot tell.
        self.namespace = (f"{spec.model}|bs{spec.block_size}|{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim}"
                          f"|{spec.dtype}|tp{spec.tp_size}pp{spec.pp_size}")

    def start(self, layout: KVLayout) -> None:
        for r in layout.regions:
            self.engine.register_memory(r.base, r.block_len * r.num_blocks)

    def key(self, block_hash: int) -> str:
        return f"{self.namespace}|{block_hash:064x}"

    def pool_query(self, block_hashes: Sequence[int]) -> list[PoolHit]:
        if not block_hashes:
            return []
        exists = self.store.batch_is_exist([self.key(h) for h in block_hashes])
        if any(e < 0 for e in exists):
            raise ConnectionError(f"mooncake batch_is_exist failed ({exists[:4]}...): master unreachable?")
        hits = []
        for h, e in zip(block_hashes, exists):
            if e != 1:
                break
            hits.append(PoolHit(h, -1, self.key(h)))     # checksum travels with the object
        return hits

    def pool_begin_save(self, layout: KVLayout, block_ids: Sequence[int], block_hashes: Sequence[int]):
        if not block_hashes:
            return []
        exists = self.store.batch_is_exist([self.key(h) for h in block_hashes])
        if any(e < 0 for e in exists):
            # Master unreachable: don't try the puts (each would wait seconds for its RPC).
            raise ConnectionError(f"mooncake batch_is_exist failed ({exists[:4]}...): master unreachable?")
        return [(b, h, None) for b, h, e in zip(block_ids, block_hashes, exists) if e != 1]

    def pool_copy(self, layout: KVLayout, handle, regions=None) -> None:
        pass      # a store object holds the whole block: it is built at pool_end_save

    def pool_end_save(self, layout: KVLayout, handle) -> int:
        n = 0
        for b, h, _ in handle:
            packed = layout.pack([b]).numpy().tobytes()
            value = zlib.crc32(packed).to_bytes(_HEADER, "little") + packed
            rc = self.store.put(self.key(h), value)
            if rc == 0:
                n += 1
            elif rc <= -900:       # RPC errors: the master is gone, stop trying
                raise ConnectionError(f"mooncake put failed with {rc}: master unreachable?")
            # other errors (e.g. -200: no space left) just mean this block is not pooled
        return n

    def pool_abort_save(self, handle) -> None:
        pass

    def pool_load(self, layout: KVLayout, hits: Sequence[PoolHit], dst_block_ids: Sequence[int],
                  timeout: float, cancelled: threading.Event | None = None) -> int:
        num_bytes = 0
        expected = _HEADER + layout.bytes_per_block
        if self.faults.load_delay_s and cancelled is not None:
            cancelled.wait(self.faults.load_delay_s)
        for hit, dst in zip(hits, dst_block_ids):
            value = self.store.get(hit.location)
            if len(value) != expected:
                raise LoadError("stale", f"{hit.location}: got {len(value)} bytes, expected {expected} "
                                         "(evicted since the query, or master unreachable)")
            crc = int.from_bytes(value[:_HEADER], "little")
            payload = torch.frombuffer(bytearray(value[_HEADER:]), dtype=torch.uint8)
            if zlib.crc32(payload.numpy()) != crc:
                raise LoadError("checksum", f"{hit.location}: stored block fails its checksum")
            if cancelled is not None and cancelled.is_set():
                raise LoadError("timeout", "the load was given up; nothing more written")
            layout.unpack(payload.view(1, -1), [dst])
            num_bytes += len(value)
        return num_bytes

    def forget_node(self, node_id: str) -> None:
        pass      # the master tracks its clients' liveness itself (client_ttl)

    def close(self) -> None:
        try:
            # close() unmounts our segment at the master: with the master gone it retries for
            # seconds, so only say goodbye to a master that answers.
            if port_answers(self.config.extra["master_server"], 0.5):
                self.store.close()
        finally:
            if self.engine is not None:
                self.engine.close()
