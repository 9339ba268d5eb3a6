"""A tiny request/response protocol over TCP on loopback: the control plane of this chapter.

The metadata server, the transfer engine's data port and the prefill node's side channel
all speak it. Mooncake uses etcd/HTTP for metadata, its own RPC for handshakes and ZMQ for
vLLM's side channel; one small framed protocol teaches the same thing without three stacks.

A message is a JSON header plus an optional raw payload (K/V bytes never go through JSON):

    [4 bytes: header length][header JSON][8 bytes: payload length][payload bytes]

Why JSON and not pickle: a server must never execute what a peer sends it, and the headers
are small (ids, offsets, checksums). Why a timeout on every socket: a peer that died or hung
must turn into an error the caller can act on (fall back to recompute), never a hang.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Callable, Iterable

_HDR = struct.Struct(">I")
_LEN = struct.Struct(">Q")
MAX_HEADER_BYTES = 64 << 20


class RpcError(RuntimeError):
    """The peer answered with an error (`remote_type` names the exception it raised), or
    could not be reached / timed out (`remote_type` is None)."""

    def __init__(self, message: str, remote_type: str | None = None) -> None:
        super().__init__(message)
        self.remote_type = remote_type


class RpcTimeout(RpcError, TimeoutError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host, int(port)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def send_msg(sock: socket.socket, header: dict, payload: Iterable[memoryview | bytes] = ()) -> None:
    parts = [memoryview(p).cast("B") for p in payload]
    head = json.dumps(header).encode()
    sock.sendall(_HDR.pack(len(head)) + head + _LEN.pack(sum(len(p) for p in parts)))
    for p in parts:
        sock.sendall(p)


def recv_msg(sock: socket.socket) -> tuple[dict, bytearray]:
    raw = bytearray(_HDR.size)
    _recv_exact(sock, memoryview(raw))
    (n,) = _HDR.unpack(raw)
    if n > MAX_HEADER_BYTES:
        raise ConnectionError(f"header of {n} bytes: not our protocol")
    head = bytearray(n)
    _recv_exact(sock, memoryview(head))
    raw = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(raw))
    (m,) = _LEN.unpack(raw)
    payload = bytearray(m)
    _recv_exact(sock, memoryview(payload))
    return json.loads(head), payload


Handler = Callable[[dict, bytearray], "tuple[dict, list] | dict"]


class RpcServer:
    """Threaded server: one thread per connection, handlers looked up by header["op"].

    A handler returns a reply header (dict) or (header, payload parts). An exception in a
    handler becomes {"ok": False, "error": ...} for the caller instead of killing the thread.
    """

    def __init__(self, handlers: dict[str, Handler], host: str = "127.0.0.1", port: int = 0) -> None:
        self.handlers = dict(handlers)
        self._sock = socket.create_server((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=f"rpc-{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                try:
                    header, payload = recv_msg(conn)
                except (ConnectionError, OSError):
                    return
                handler = self.handlers.get(header.get("op"))
                try:
                    if handler is None:
                        raise RpcError(f"unknown op {header.get('op')!r}; this server knows {sorted(self.handlers)}")
                    reply = handler(header, payload)
                    reply_header, parts = reply if isinstance(reply, tuple) else (reply, [])
                    reply_header.setdefault("ok", True)
                except Exception as e:      # noqa: BLE001 - reported to the caller
                    reply_header, parts = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                           "error_type": type(e).__name__}, []
                try:
                    send_msg(conn, reply_header, parts)
                except OSError:
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)     # wakes the thread blocked in accept()
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._thread.join(timeout=2.0)


class RpcClient:
    """One persistent connection to one server; calls are serialised by a lock.

    Every call has a timeout. After a failure the connection is dropped (its stream may be
    mid-message) and the next call reconnects.
    """

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.address, self.timeout = address, timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self, timeout: float) -> socket.socket:
        host, port = parse_address(self.address)
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def call(self, header: dict, payload: Iterable[memoryview | bytes] = (),
             timeout: float | None = None) -> tuple[dict, bytearray]:
        """Send one request, return (reply header, reply payload); RpcError if the server
        said ok=False, RpcTimeout / RpcError if it could not be reached in time."""
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = self._connect(timeout)
                self._sock.settimeout(timeout)
                send_msg(self._sock, header, payload)
                reply, data = recv_msg(self._sock)
            except socket.timeout as e:
                self._drop()
                raise RpcTimeout(f"{header.get('op')} to {self.address}: no answer within {timeout:.3g} s") from e
            except (ConnectionError, OSError) as e:
                self._drop()
                raise RpcError(f"{header.get('op')} to {self.address} failed: {e}") from e
        if not reply.get("ok", False):
            raise RpcError(f"{header.get('op')} at {self.address}: {reply.get('error', 'failed')}",
                           reply.get("error_type", "RuntimeError"))
        return reply, data

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
