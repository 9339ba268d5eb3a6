"""The connector's worker half: one per rank, moving that rank's share of every block.

vLLM: `KVConnectorBase_V1` built with `KVConnectorRole.WORKER` in every worker process
(MooncakeConnector's `MooncakeConnectorWorker`), driven by the model runner around each forward
pass (`kv_connector_model_runner_mixin.py`). Under tensor parallelism a rank holds its KV heads
of every layer, under pipeline parallelism its stage's layers: it registers exactly those
tensors, publishes them to the pool under its own keys (`layers.pool_key`), serves its own side
channel to decode nodes, and loads only its share. The scheduler half (`connector_scheduler.py`)
tells every rank the same loads and saves; `KVOutputAggregator` joins their reports.
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch

from global_prefix_cache.config import KVConnectorRole, KVTransferConfig
from global_prefix_cache.connector import (CONNECTORS, GlobalPrefixCacheConnectorMetadata, KVConnectorOutput,
                                           LoadFailure, LoadSpec, PoolHealth, SaveSpec)
from global_prefix_cache.grouping import Region, build_transfer_params
from global_prefix_cache.kv_layout import BlockSegment, KVLayout, NodeSpec
from global_prefix_cache.layers import LoadError, classify, hit_node_id, pool_key
from global_prefix_cache.rpc import RpcClient, RpcError, RpcServer
from global_prefix_cache.transfer_params import decode_hashes, encode_hashes


@dataclass
class _LoadJob:
    spec: LoadSpec
    deadline: float
    future: Future | None = None
    tag: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)   # given up: write nothing
    aborted: bool = False             # its request finished while it ran: report it done, whatever happened
    started: float = 0.0
    finished: float = 0.0

    def cancel(self, engine) -> None:
        self.cancelled.set()
        engine.revoke_tag(self.tag)
        if self.future is not None:
            self.future.cancel()


@dataclass
class _Staged:
    slots: list[int]
    num_tokens: int
    expires: float
    block_hashes: list[int]           # of the staged tokens: what a decode node's request must match
    sent: bool = False


class ConnectorWorker(PoolHealth):
    """The worker-side half of rank `rank` (node `{node_id}/rank{rank}` in the pool; rank 0 is `node_id`)."""

    role = KVConnectorRole.WORKER

    def __init__(self, config: KVTransferConfig, spec: NodeSpec, rank: int, node_id: str) -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} of an engine with {spec.world_size} ranks")
        self.config, self.spec, self.rank = config, spec, rank
        self.block_size = spec.block_size
        self.node_id = node_id if rank == 0 else f"{node_id}/rank{rank}"
        self.layer = CONNECTORS[config.kv_connector](config, self.node_id, spec, KVConnectorRole.WORKER)
        self.layout: KVLayout | None = None
        self._meta = GlobalPrefixCacheConnectorMetadata()
        self._save_handles: list[tuple[SaveSpec, Any, list[int]]] | None = None
        self._saved_regions: set[int] = set()
        self._jobs: dict[str, _LoadJob] = {}
        self._failed: dict[str, LoadFailure] = {}
        self._failed_staging: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-load")
        self._tags = itertools.count()
        self.send_segment: BlockSegment | None = None
        self.side_channel: RpcServer | None = None
        self._staged: dict[str, _Staged] = {}
        self._staged_cv = threading.Condition()
        self._finished_sending: set[str] = set()
        self.load_seconds: list[float] = []          # wall time of each successful load (benchmarks)
        self.stats = {"loaded_bytes": 0, "saved_blocks": 0, "pushed_blocks": 0, "failures": {}}

    # ================================================================ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """This rank's K/V tensors ({name: [num_blocks, block_size, heads, head_dim]}, K and V of
        each local layer as separate entries): register them for remote writes, and join the
        pool / open the side channel according to the role."""
        self.layout = KVLayout(kv_caches)
        first = self.layout.tensors[0]
        dtype = str(first.dtype).removeprefix("torch.")
        if first.dim() != 4 or first.shape[1] != self.block_size or first.shape[3] != self.spec.head_dim \
                or dtype != self.spec.dtype:
            raise ValueError(f"K/V tensors must be [num_blocks, block_size={self.block_size}, heads, "
                             f"head_dim={self.spec.head_dim}] of {self.spec.dtype}, got {tuple(first.shape)} {dtype}")
        self.layer.start(self.layout)
        if self.config.is_kv_producer:
            self.send_segment = BlockSegment(self.layout, self.config.extra["send_capacity_blocks"])
            for r in self.send_segment.regions:
                self.layer.engine.register_memory(r.base, r.block_len * r.num_blocks)
            self.side_channel = RpcServer({"pull_kv": self._serve_pull})

    def get_handshake_metadata(self) -> str | None:
        """Where a decode node's rank `rank` asks for this rank's share: the side channel (producers)."""
        return self.side_channel.address if self.side_channel is not None else None

    # ================================================================ loads
    def bind_connector_metadata(self, meta: GlobalPrefixCacheConnectorMetadata) -> None:
        self._meta = meta
        self._save_handles = None
        self._saved_regions = set()

    def clear_connector_metadata(self) -> None:
        self._meta = GlobalPrefixCacheConnectorMetadata()
        self._save_handles = None

    def start_load_kv(self, forward_context: Any = None, **kwargs) -> None:
        """Start this step's loads in the background (before the forward pass)."""
        timeout = self.config.extra["load_timeout_s"]
        for spec in self._meta.loads:
            job = _LoadJob(spec, time.monotonic() + timeout, tag=f"{self.node_id}/{spec.request_id}/{next(self._tags)}")
            job.future = self._pool.submit(self._run_load, job)
            self._jobs[spec.request_id] = job

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: every load here is asynchronous (the request sits in
        WAITING_FOR_REMOTE_KVS and is not in this forward pass). A synchronous connector
        would block here until layer `layer_name` has arrived, overlapping the rest."""

    def _run_load(self, job: _LoadJob) -> int:
        spec = job.spec
        job.started = time.perf_counter()
        remaining = max(1e-3, job.deadline - time.monotonic())
        if spec.mode == "pool":
            n = self.layer.pool_load(self.layout, spec.hits[self.rank], spec.block_ids, remaining, job.cancelled)
        else:
            n = self._pull(job, remaining)
        job.finished = time.perf_counter()
        return n

    def _pull(self, job: _LoadJob, timeout: float) -> int:
        """Ask the prefill node's rank `rank` to push its share of this request's K/V into our blocks."""
        spec = job.spec
        header = {"op": "pull_kv", "request_id": spec.push["remote_request_id"], "target": self.layer.engine.session_id,
                  "regions": [[r.base, r.block_len, r.num_blocks] for r in self.layout.regions],
                  "first_block": spec.first_block, "block_ids": spec.block_ids, "tag": job.tag,
                  "spec": self.spec.as_dict(), "block_hashes": encode_hashes(spec.expected_hashes), "wait_s": timeout}
        client = RpcClient(spec.push["remote_sessions"][self.rank], timeout)
        try:
            reply, _ = client.call(header)
        except RpcError as e:
            self.layer.engine.revoke_tag(job.tag)     # a late write must not land in reused blocks
            raise LoadError(classify(str(e)), str(e)) from None
        finally:
            client.close()
        try:
            pushed = decode_hashes(reply.get("block_hashes"), "the reply's block_hashes")
        except ValueError as e:
            raise LoadError("mismatch", f"request {spec.request_id}: {e}") from None
        if pushed != spec.expected_hashes:
            # Never trust the sender's own check: these blocks hold K/V of other tokens.
            raise LoadError("mismatch", f"request {spec.request_id}: the pushed blocks are of other tokens "
                                        "(their block hashes differ from this request's)")
        if self.layout.block_checksums(spec.block_ids) != reply["checksums"]:
            raise LoadError("checksum", f"request {spec.request_id}: pushed blocks fail their checksums")
        return reply["num_bytes"]

    def get_finished(self, finished_req_ids: set[str] = frozenset()) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call. A load that failed or
        passed its deadline is NOT in finished_recving: it is in get_failed_loads(). The load of
        a request that finished meanwhile (aborted: `finished_req_ids`) is given up — nothing
        more is written — and reported in finished_recving once it has stopped, so the
        scheduler can free the blocks it held back for it."""
        for rid in finished_req_ids:
            job = self._jobs.get(rid)
            if job is not None and not job.aborted:
                job.aborted = True
                job.cancel(self.layer.engine)
        now, recving = time.monotonic(), set()
        for rid, job in list(self._jobs.items()):
            if job.future.done():
                del self._jobs[rid]
                if job.aborted:
                    recving.add(rid)
                    continue
                err = job.future.exception()
                if err is None:
                    recving.add(rid)
                    self.stats["loaded_bytes"] += job.future.result()
                    self.load_seconds.append(job.finished - job.started)
                else:
                    self._fail(job, err)
            elif now > job.deadline:
                del self._jobs[rid]
                job.cancel(self.layer.engine)
                if job.aborted:
                    recving.add(rid)
                else:
                    self._fail(job, LoadError("timeout", f"not loaded within {self.config.extra['load_timeout_s']} s"))
        return self._drain_sending(now), recving

    def _fail(self, job: _LoadJob, err: BaseException) -> None:
        reason = err.reason if isinstance(err, LoadError) else classify(str(err))
        self._count_failure(reason)
        message = str(err) if isinstance(err, LoadError) else f"{reason}: {err}"
        self._failed[job.spec.request_id] = LoadFailure(message, list(job.spec.block_ids))
        if reason == "unreachable" and job.spec.mode == "pool":
            for node in {hit_node_id(h) for h in job.spec.hits[self.rank]} - {None}:
                self.layer.forget_node(node)

    def get_failed_loads(self) -> dict[str, LoadFailure]:
        """{request_id: why, and the blocks it was writing} of loads that failed since the last call."""
        failed, self._failed = self._failed, {}
        return failed

    def get_failed_staging(self) -> set[str]:
        """Prompts this rank could not stage for a decode node since the last call."""
        failed, self._failed_staging = self._failed_staging, set()
        return failed

    def get_connector_output(self, finished_req_ids: set[str] = frozenset()) -> KVConnectorOutput:
        """This rank's report for the step, after wait_for_save (what vLLM's model runner mixin
        gathers from get_finished and get_block_ids_with_load_errors)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorOutput(sending, recving, self.get_failed_loads(), self.get_failed_staging())

    def has_pending_loads(self) -> bool:
        return bool(self._jobs)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until one of the loads in flight finishes, or `timeout` s: a step with nothing
        to compute but remote K/V on its way waits here instead of spinning (and leaves the GIL
        to the threads doing the transfer)."""
        futures = [job.future for job in self._jobs.values() if job.future is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    # ================================================================ saves
    def discard_saves(self, request_ids) -> None:
        """Requests the forward pass failed (their K/V may be half written): publish and stage
        none of their blocks this step. Call before wait_for_save."""
        drop = set(request_ids)
        if not drop or not self._meta.saves:
            return
        self._failed_staging |= {s.request_id for s in self._meta.saves if s.request_id in drop and s.push_block_ids}
        self._meta.saves = [s for s in self._meta.saves if s.request_id not in drop]
        if self._save_handles is not None:           # save_kv_layer already reserved room for them
            keep = []
            for save, handle, slots in self._save_handles:
                if save.request_id in drop:
                    self.layer.pool_abort_save(handle)
                    if slots:
                        self.send_segment.free(slots)
                else:
                    keep.append((save, handle, slots))
            self._save_handles = keep

    def _begin_saves(self) -> list[tuple[SaveSpec, Any, list[int]]]:
        if self._save_handles is None:
            self._save_handles = []
            for save in self._meta.saves:
                handle = []
                if save.block_ids and not self._pool_is_down():
                    keys = [pool_key(h, self.rank) for h in save.block_hashes]
                    try:
                        handle = self.layer.pool_begin_save(self.layout, save.block_ids, keys)
                    except (RpcError, ConnectionError, OSError) as e:
                        self._pool_failed(e)                     # the pool is down: just don't publish
                slots = []
                if save.push_block_ids:
                    slots = self.send_segment.allocate(len(save.push_block_ids)) or []
                    if not slots:
                        self._count_failure("send_buffer_full")
                        self._failed_staging.add(save.request_id)
                self._save_handles.append((save, handle, slots))
        return self._save_handles

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs) -> None:
        """Called after layer `layer_name` wrote its K/V: copy that layer's new blocks out
        now, overlapping with the next layers' compute."""
        regions = [r for r in self.layout.region_indices(layer_name) if r not in self._saved_regions]
        self._copy_saves(regions)

    def _copy_saves(self, regions: list[int]) -> None:
        if not regions:
            return
        for save, handle, slots in self._begin_saves():
            self.layer.pool_copy(self.layout, handle, regions)
            if slots:
                self.layout.copy_blocks_to(self.send_segment, save.push_block_ids, slots, regions)
        self._saved_regions.update(regions)

    def wait_for_save(self) -> None:
        """After the forward pass: copy what no save_kv_layer call covered, then publish."""
        if not self._meta.saves:
            return
        self._copy_saves([r for r in range(len(self.layout.regions)) if r not in self._saved_regions])
        keep = self.config.extra["send_keep_s"]
        for save, handle, slots in self._save_handles:
            try:
                self.stats["saved_blocks"] += self.layer.pool_end_save(self.layout, handle)
            except (RpcError, ConnectionError, OSError) as e:
                self._pool_failed(e)
                self.layer.pool_abort_save(handle)
            if slots:
                with self._staged_cv:
                    self._staged[save.request_id] = _Staged(slots, save.push_num_tokens, time.monotonic() + keep,
                                                            save.push_block_hashes)
                    self._staged_cv.notify_all()
        self._save_handles = []

    # ================================================================ prefill node: the push
    def _serve_pull(self, header: dict, _payload) -> dict:
        """Side channel (vLLM: ZMQ): a decode node's rank asks for request `request_id`'s K/V to be
        written into its blocks. Wait (bounded) until the prompt's K/V is staged, then push.
        A request for other tokens than the staged ones (its block hashes differ) is refused
        before anything moves, and the staged K/V stays for the request it belongs to."""
        rid, first, dst_ids, expected, wait_s = _check_pull_header(header)
        NodeSpec.from_dict(header["spec"]).check_compatible(self.spec, "this prefill node")
        deadline = time.monotonic() + min(wait_s, self.config.extra["send_keep_s"])
        with self._staged_cv:
            while (staged := self._staged.get(rid)) is None or staged.sent:
                left = deadline - time.monotonic()
                if staged is not None and staged.sent:
                    raise LookupError(f"request {rid}'s K/V was already sent")
                if left <= 0:
                    raise TimeoutError(f"request {rid} has no staged K/V here (not computed, or expired)")
                self._staged_cv.wait(left)
            if staged.block_hashes[first:first + len(dst_ids)] != expected:
                raise LookupError(f"request {rid}: block hash mismatch — the staged K/V is of other tokens than "
                                  "the decode request's")
            staged.sent = True
        ### BEGIN SOLUTION
        src_slots = staged.slots[first:first + len(dst_ids)]
        remote = [Region(*r) for r in header["regions"]]
        buffers, peer_addrs, lengths = build_transfer_params(self.send_segment.regions, remote, src_slots, dst_ids)
        rc = self.layer.engine.batch_transfer_sync_write(header["target"], buffers, peer_addrs, lengths, tag=header["tag"])
        ### END SOLUTION
        checksums = self.send_segment.block_checksums(src_slots)
        with self._staged_cv:
            self._staged.pop(rid, None)
            self.send_segment.free(staged.slots)
            self._finished_sending.add(rid)
        if rc != 0:
            raise IOError(f"push of request {rid} failed: {self.layer.engine.last_error}")
        self.stats["pushed_blocks"] += len(dst_ids)
        return {"checksums": checksums, "num_bytes": sum(lengths), "num_transfers": len(lengths),
                "block_hashes": encode_hashes(staged.block_hashes[first:first + len(dst_ids)])}

    def _drain_sending(self, now: float) -> set[str]:
        with self._staged_cv:
            for rid, staged in list(self._staged.items()):
                if not staged.sent and now > staged.expires:     # nobody came for it
                    del self._staged[rid]
                    self.send_segment.free(staged.slots)
                    self._finished_sending.add(rid)
            done, self._finished_sending = self._finished_sending, set()
        return done

    def get_kv_connector_stats(self) -> dict:
        """This rank's counters and load times (vLLM: get_kv_connector_stats)."""
        return {"stats": {**self.stats, "failures": dict(self.stats["failures"])},
                "load_seconds": list(self.load_seconds)}

    def shutdown(self) -> None:
        for job in self._jobs.values():
            job.cancel(self.layer.engine)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.side_channel is not None:
            self.side_channel.close()
        self.layer.close()


def _check_pull_header(header: dict) -> tuple[str, int, list[int], list[int], float]:
    """(request_id, first_block, block_ids, block_hashes, wait_s) of a decode node's pull,
    ValueError if any is malformed: it comes from another process."""
    rid, first, ids, wait_s = (header.get(k) for k in ("request_id", "first_block", "block_ids", "wait_s"))
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"pull_kv: request_id must be a non-empty str, got {rid!r}")
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ValueError(f"pull_kv: first_block must be an int >= 0, got {first!r}")
    if not isinstance(ids, list) or not ids or not all(isinstance(b, int) and b >= 0 for b in ids):
        raise ValueError(f"pull_kv: block_ids must be a non-empty list of block ids, got {ids!r}")
    if not isinstance(wait_s, (int, float)) or not wait_s > 0:
        raise ValueError(f"pull_kv: wait_s must be a positive number, got {wait_s!r}")
    hashes = decode_hashes(header.get("block_hashes"), "pull_kv: block_hashes")
    if len(hashes) != len(ids):
        raise ValueError(f"pull_kv: {len(ids)} blocks asked for with {len(hashes)} block hashes")
    return rid, first, ids, hashes, float(wait_s)
