"""A from-scratch transfer engine with Mooncake's API: registered memory, batched
(src address, peer address, length) writes and reads, between OS processes over TCP.

Mirrors `mooncake.engine.TransferEngine` (what vLLM's MooncakeConnector calls):
`initialize`, `register_memory`, `batch_transfer_sync_write(target, buffers,
peer_buffer_addresses, lengths)`, `batch_transfer_sync_read`, plus the async
`submit` / `wait` / `is_complete` of [vLLM 2.0 part 2, §7.5]. [vLLM 2.0 part 2, §7.4.2] maps these onto RDMA verbs:
register_memory = ibv_reg_mr (pin memory, hand out a key), a write = IBV_WR_RDMA_WRITE
straight into the peer's registered memory, "sync" = poll the completion queue.

Here the NIC is a thread: each engine serves its registered memory on a loopback port, and a
peer's write lands in that memory by address — but only inside a registered range (the
rkey check: a bad address is refused, not written). Every payload carries a crc32 per
transfer (RDMA has link-level CRCs; TCP's 16-bit checksum is weak), verified before the
bytes land. Optional `LinkModel`: pace each batch to latency * transfers + bytes / bandwidth
([vLLM 2.0 part 2, §7.4.4]: 5 µs + bytes / 100 Gbps) to run the cost-model experiments on loopback.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Sequence

from global_prefix_cache.rpc import RpcClient, RpcError, RpcServer


def memory_view(addr: int, length: int) -> memoryview:
    """Writable bytes at a raw address (what a NIC's DMA engine sees)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


@dataclass(frozen=True)
class LinkModel:
    """Time one batch of transfers is made to take at least: a fixed cost per transfer
    (descriptor, doorbell, completion) plus serialisation at the link's bandwidth."""
    latency_s: float = 5e-6
    bandwidth_Bps: float = 100e9 / 8

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_Bps <= 0:
            raise ValueError(f"LinkModel needs latency >= 0 and bandwidth > 0, got {self}")

    def seconds(self, num_bytes: int, num_transfers: int = 1) -> float:
        return num_transfers * self.latency_s + num_bytes / self.bandwidth_Bps


@dataclass
class TransferResult:
    ok: bool
    error: str = ""
    num_bytes: int = 0
    num_transfers: int = 0
    seconds: float = 0.0


@dataclass
class _Faults:
    """Fault injection for tests and demos, applied by the engine that SENDS a payload."""
    corrupt_payloads: int = 0      # flip one byte in the next N payloads sent (after the checksum)
    serve_delay_s: float = 0.0     # sleep before answering a peer (a slow or dying node)


@dataclass
class _Batch:
    future: Future
    cancelled: threading.Event = field(default_factory=threading.Event)


class TransferEngine:
    def __init__(self, link: LinkModel | None = None, timeout: float = 5.0, max_workers: int = 4) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 s, got {timeout}")
        self.link, self.timeout = link, timeout
        self.faults = _Faults()
        self._regions: dict[int, int] = {}           # base address -> length
        self._revoked_tags: set[str] = set()
        self._lock = threading.Lock()
        self._server: RpcServer | None = None
        self._clients: dict[str, RpcClient] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="xfer")
        self._batches: dict[int, _Batch] = {}
        self._ids = itertools.count()
        self.last_error = ""

    # ---- setup -----------------------------------------------------------------------
    def initialize(self, hostname: str = "127.0.0.1", port: int = 0) -> int:
        """Start serving this engine's registered memory. Returns 0 (Mooncake's convention)."""
        if self._server is None:
            self._server = RpcServer({"read": self._serve_read, "write": self._serve_write}, hostname, port)
        return 0

    @property
    def session_id(self) -> str:
        """What peers pass as `target` (Mooncake: "host:rpc_port" under P2PHANDSHAKE)."""
        if self._server is None:
            raise RuntimeError("TransferEngine.initialize() first")
        return self._server.address

    def register_memory(self, addr: int, length: int) -> int:
        if addr <= 0 or length <= 0:
            raise ValueError(f"register_memory: bad range addr={addr:#x} length={length}")
        with self._lock:
            self._regions[addr] = length
        return 0

    def unregister_memory(self, addr: int) -> int:
        with self._lock:
            return 0 if self._regions.pop(addr, None) is not None else -1

    def revoke_tag(self, tag: str) -> None:
        """Refuse every later write carrying `tag`: a load that timed out gives its blocks
        back, and a late write from a slow peer must not land in them once reused."""
        with self._lock:
            self._revoked_tags.add(tag)

    def _check_range(self, addr: int, length: int) -> None:
        for base, n in self._regions.items():
            if base <= addr and addr + length <= base + n:
                return
        raise PermissionError(f"[{addr:#x}, +{length}) is not inside memory registered with this engine")

    # ---- serving side (the "NIC" of the peer) --------------------------------------------
    def _outgoing(self, parts: list[memoryview]) -> list[memoryview | bytes]:
        if self.faults.corrupt_payloads > 0 and parts and len(parts[0]):
            self.faults.corrupt_payloads -= 1
            bad = bytearray(parts[0])
            bad[len(bad) // 2] ^= 0xFF
            return [bytes(bad), *parts[1:]]
        return parts

    def _serve_read(self, header: dict, _payload: bytearray):
        if self.faults.serve_delay_s:
            time.sleep(self.faults.serve_delay_s)
        addrs, lengths = header["addrs"], header["lengths"]
        with self._lock:
            for a, n in zip(addrs, lengths):
                self._check_range(a, n)
        parts = [memory_view(a, n) for a, n in zip(addrs, lengths)]
        crcs = [zlib.crc32(p) for p in parts]
        return {"crcs": crcs}, self._outgoing(parts)

    def _serve_write(self, header: dict, payload: bytearray):
        if self.faults.serve_delay_s:
            time.sleep(self.faults.serve_delay_s)
        addrs, lengths, crcs = header["addrs"], header["lengths"], header["crcs"]
        with self._lock:
            if header.get("tag") in self._revoked_tags:
                raise PermissionError(f"write tagged {header['tag']!r} arrived after its load was given up")
            for a, n in zip(addrs, lengths):
                self._check_range(a, n)
        view, offset = memoryview(payload), 0
        for n, crc in zip(lengths, crcs):          # verify everything before anything lands
            if zlib.crc32(view[offset:offset + n]) != crc:
                raise IOError("transport checksum mismatch: payload corrupted in flight, nothing written")
            offset += n
        view.release()
        offset = 0
        for a, n in zip(addrs, lengths):
            ctypes.memmove(a, (ctypes.c_char * n).from_buffer(payload, offset), n)
            offset += n
        return {}

    # ---- initiating side -----------------------------------------------------------------
    def _client(self, target: str) -> RpcClient:
        with self._lock:
            client = self._clients.get(target)
            if client is None:
                client = self._clients[target] = RpcClient(target, self.timeout)
            return client

    @staticmethod
    def _check_args(buffers: Sequence[int], peer_addrs: Sequence[int], lengths: Sequence[int]) -> None:
        if not len(buffers) == len(peer_addrs) == len(lengths):
            raise ValueError(f"{len(buffers)} buffers, {len(peer_addrs)} peer addresses, {len(lengths)} lengths")
        if any(n <= 0 for n in lengths):
            raise ValueError(f"transfer lengths must be > 0, got {list(lengths)}")

    def _write(self, target, buffers, peer_addrs, lengths, tag, timeout, cancelled) -> TransferResult:
        t0 = time.perf_counter()
        parts = [memory_view(b, n) for b, n in zip(buffers, lengths)]
        header = {"op": "write", "addrs": list(peer_addrs), "lengths": list(lengths),
                  "crcs": [zlib.crc32(p) for p in parts], "tag": tag}
        self._client(target).call(header, self._outgoing(parts), timeout=timeout)
        return self._finish(t0, sum(lengths), len(lengths))

    def _read(self, target, buffers, peer_addrs, lengths, tag, timeout, cancelled) -> TransferResult:
        t0 = time.perf_counter()
        reply, payload = self._client(target).call(
            {"op": "read", "addrs": list(peer_addrs), "lengths": list(lengths)}, timeout=timeout)
        view, offset = memoryview(payload), 0
        for n, crc in zip(lengths, reply["crcs"]):
            if zlib.crc32(view[offset:offset + n]) != crc:
                raise IOError("transport checksum mismatch: payload corrupted in flight, nothing written")
            offset += n
        view.release()
        if cancelled is not None and cancelled.is_set():
            raise TimeoutError("the read was given up before its bytes arrived; nothing written")
        offset = 0
        for b, n in zip(buffers, lengths):
            ctypes.memmove(b, (ctypes.c_char * n).from_buffer(payload, offset), n)
            offset += n
        return self._finish(t0, sum(lengths), len(lengths))

    def _finish(self, t0: float, num_bytes: int, num_transfers: int) -> TransferResult:
        if self.link is not None:                   # pace to the modelled link
            remaining = self.link.seconds(num_bytes, num_transfers) - (time.perf_counter() - t0)
            if remaining > 0:
                time.sleep(remaining)
        return TransferResult(True, "", num_bytes, num_transfers, time.perf_counter() - t0)

    def _run(self, op, target, buffers, peer_addrs, lengths, tag=None, timeout=None, cancelled=None) -> TransferResult:
        self._check_args(buffers, peer_addrs, lengths)
        fn = self._write if op == "write" else self._read
        try:
            return fn(target, buffers, peer_addrs, lengths, tag, timeout or self.timeout, cancelled)
        except (RpcError, OSError, TimeoutError, PermissionError) as e:
            self.last_error = str(e)
            return TransferResult(False, str(e), 0, len(lengths))

    def batch_transfer_sync_write(self, target: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], tag: str | None = None) -> int:
        """Copy local [buffers[i], +lengths[i]) to the peer's registered memory at
        peer_buffer_addresses[i]. Returns 0, or -1 with the reason in `last_error`."""
        return 0 if self._run("write", target, buffers, peer_buffer_addresses, lengths, tag).ok else -1

    def batch_transfer_sync_read(self, target: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                                 lengths: Sequence[int]) -> int:
        return 0 if self._run("read", target, buffers, peer_buffer_addresses, lengths).ok else -1

    # ---- asynchronous form [vLLM 2.0 part 2, §7.5] ---------------------------------------------------
    def submit(self, op: str, target: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
               lengths: Sequence[int], tag: str | None = None, timeout: float | None = None,
               cancelled: threading.Event | None = None) -> int:
        """Start a batch in the background; returns its id for wait / is_complete. Setting
        `cancelled` (or a wait that times out) stops a read from writing our buffers."""
        if op not in ("read", "write"):
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        self._check_args(buffers, peer_buffer_addresses, lengths)
        cancelled = cancelled or threading.Event()
        future = self._pool.submit(self._run, op, target, list(buffers), list(peer_buffer_addresses),
                                   list(lengths), tag, timeout, cancelled)
        batch_id = next(self._ids)
        self._batches[batch_id] = _Batch(future, cancelled)
        return batch_id

    def is_complete(self, batch_id: int) -> bool:
        return self._batch(batch_id).future.done()

    def wait(self, batch_id: int, timeout: float | None = None) -> TransferResult:
        """The batch's result; a failed TransferResult (never a hang) if it is not done
        within `timeout` — then its bytes will not be written into our buffers."""
        batch = self._batch(batch_id)
        try:
            result = batch.future.result(timeout=self.timeout if timeout is None else timeout)
        except FutureTimeout:
            batch.cancelled.set()
            return TransferResult(False, f"transfer {batch_id} not complete within {timeout} s")
        self._batches.pop(batch_id, None)
        return result

    def _batch(self, batch_id: int) -> _Batch:
        try:
            return self._batches[batch_id]
        except KeyError:
            raise ValueError(f"unknown transfer batch {batch_id} (already waited for?)") from None

    def close(self) -> None:
        for batch in self._batches.values():
            batch.cancelled.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            self._regions.clear()
        for c in clients:
            c.close()
