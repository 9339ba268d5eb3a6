"""The KV connector: how K/V computed on ANOTHER node enters a request, in vLLM's shape.

Mirrors `KVConnectorBase_V1` (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`) and,
for the push path, `MooncakeConnector` (`.../v1/mooncake/mooncake_connector.py`).

Scheduler side (called by `scheduler.KVConnectorScheduler`; `scheduler.KVConnectorBase` is its half):
  get_num_new_matched_tokens(request, num_computed_tokens) -> (num_external_tokens, load_async)
  update_state_after_alloc(request, blocks, num_external_tokens)
  build_connector_meta(scheduler_output) -> GlobalPrefixCacheConnectorMetadata
  request_finished(request, block_ids) -> delay_free_blocks  (+ take_kv_transfer_params)
Worker side (called by the model runner around the forward pass):
  register_kv_caches(kv_caches)  bind_connector_metadata(meta)  start_load_kv()
  wait_for_layer_load(layer)  save_kv_layer(layer, ...)  wait_for_save()
  get_finished(finished_req_ids) -> (finished_sending, finished_recving)
  get_block_ids_with_load_errors()  /  get_failed_loads()

Two ways K/V arrive, one code path in the scheduler ([Kwon 2025, §4.4]: a remote prefix hit):
  * pool (global prefix cache): a producer publishes the full blocks of every prompt;
    any consumer whose prompt starts with those blocks loads them instead of computing.
  * push (prefill/decode disaggregation): the prefill node stages a request's K/V; the
    decode node, given the prefill node's `kv_transfer_params`, asks for it over a side
    channel, and the prefill node WRITES it into the decode node's blocks ([vLLM 2.0 part 2, §7.3.1]:
    P pushes, D does not pull), contiguous blocks grouped into one transfer per layer.

Every load is asynchronous (the request waits in WAITING_FOR_REMOTE_KVS) and has a deadline;
a failed or late load is reported by `get_block_ids_with_load_errors()` (the model runner puts
them in `ModelRunnerOutput.invalid_block_ids`, and `scheduler.KVConnectorScheduler` recomputes the
request under `kv_load_failure_policy`), and its blocks are never written after it was given up.
"""
from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from global_prefix_cache.config import KVTransferConfig
from global_prefix_cache.grouping import Region, build_transfer_params
from global_prefix_cache.kv_layout import BlockSegment, KVLayout, NodeSpec
from global_prefix_cache.layers import LoadError, PoolHit, ScratchLayer, classify, hit_node_id
from global_prefix_cache.rpc import RpcClient, RpcError, RpcServer
from global_prefix_cache.transfer_params import check_kv_transfer_params, decode_hashes, encode_hashes
from kvcache.hashing import (BlockHash, append_block_hashes, generate_block_hash_extra_keys, hash_block_tokens,
                             sha256_hash)
from paged_attention import cdiv
from global_prefix_cache.scheduler import KVConnectorBase


class KVConnectorRole(enum.Enum):
    """vLLM builds the connector twice, once per side; here one object may play both."""
    SCHEDULER = 0
    WORKER = 1


@dataclass
class LoadSpec:
    """One request's load, planned on the scheduler side, executed on the worker side."""
    request_id: str
    mode: str                         # "pool" | "push"
    first_block: int                  # logical index of the first block to fill
    num_blocks: int
    hits: list[PoolHit] = field(default_factory=list)          # pool
    push: dict[str, Any] = field(default_factory=dict)          # push: the prefill node's kv_transfer_params
    expected_hashes: list[int] = field(default_factory=list)   # push: our tokens' hashes of the blocks loaded
    block_ids: list[int] = field(default_factory=list)         # local destination blocks (set after alloc)


@dataclass
class SaveSpec:
    request_id: str
    block_ids: list[int]              # local blocks to publish to the pool (full prompt blocks)
    block_hashes: list[int]
    push_block_ids: list[int] = field(default_factory=list)    # stage for a decode node (prompt complete)
    push_num_tokens: int = 0
    push_block_hashes: list[int] = field(default_factory=list)  # the staged tokens' hashes, one per block


@dataclass
class GlobalPrefixCacheConnectorMetadata:
    """vLLM's KVConnectorMetadata: what the scheduler tells the worker for one step."""
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _SaveState:
    block_ids: list[int]
    prompt_len: int
    num_saved_blocks: int = 0
    staged: bool = False


@dataclass
class _LoadJob:
    spec: LoadSpec
    deadline: float
    future: Future | None = None
    tag: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)   # given up: write nothing
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


class KVConnectorBase_V1(KVConnectorBase):  # noqa: N801 - vLLM's name
    """The surface the engine drives (vLLM's KVConnectorBase_V1): the scheduler-side interface
    (`scheduler.KVConnectorBase`) plus the worker side. Subclasses pick a layer."""

    layer_name = ""
    MAX_FAILURE_HISTORY = 1024

    def __init__(self, config: KVTransferConfig | dict, block_size: int, node_id: str | None = None) -> None:
        self.config = KVTransferConfig.from_dict(config)
        if type(self).layer_name and self.config.kv_connector != type(self).__name__:
            raise ValueError(f"{type(self).__name__} built with kv_connector={self.config.kv_connector!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.node_id = node_id or self.config.engine_id or f"node-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.layer = self._make_layer()
        self.layout: KVLayout | None = None
        self.spec: NodeSpec | None = None
        self._root_hash: int | None = None           # the spec's: seeds every block-hash chain we share
        # scheduler side
        self._hashes: dict[str, list[BlockHash]] = {}
        self._requests: dict[str, Any] = {}
        self._matched: dict[str, LoadSpec] = {}      # matched, waiting for update_state_after_alloc
        self._loads_to_send: list[LoadSpec] = []
        self._save_state: dict[str, _SaveState] = {}
        self._no_remote: set[str] = set()            # failed once: compute locally from now on
        self.last_error = ""
        self._pool_down_until = 0.0
        self.finished_request_ids: set[str] = set()  # request_finished seen (the engine calls it once)
        self._params_out: dict[str, dict] = {}
        self.external_tokens: dict[str, int] = {}    # live request -> tokens planned to load (stats)
        self.load_failures: OrderedDict[str, str] = OrderedDict()   # request -> why its load failed (recent)
        self.load_seconds: list[float] = []          # wall time of each successful load (benchmarks)
        # worker side
        self._meta = GlobalPrefixCacheConnectorMetadata()
        self._save_handles: list[tuple[SaveSpec, Any, list[int]]] | None = None
        self._saved_regions: set[int] = set()
        self._jobs: dict[str, _LoadJob] = {}
        self._failed: dict[str, str] = {}
        self._failed_block_ids: set[int] = set()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-load")
        self._tags = itertools.count()
        self.send_segment: BlockSegment | None = None
        self.side_channel: RpcServer | None = None
        self._staged: dict[str, _Staged] = {}
        self._staged_cv = threading.Condition()
        self._finished_sending: set[str] = set()
        self.stats = {"lookups": 0, "hit_blocks": 0, "loaded_tokens": 0, "loaded_bytes": 0, "saved_blocks": 0,
                      "pushed_blocks": 0, "failures": {}}

    def _make_layer(self):
        raise NotImplementedError

    @property
    def kv_load_failure_policy(self) -> str:
        """Read by KVConnectorScheduler when a load fails: "recompute" or "fail"."""
        return self.config.kv_load_failure_policy

    def validate_kv_transfer_params(self, params: dict | None) -> dict | None:
        """The canonical form of a request's kv_transfer_params (`transfer_params.py`: every
        field type- and range-checked), before the request is queued; the request must carry
        that form. ValueError if they are malformed or ask what this node cannot do: a role
        that cannot (a consumer asked to send, a producer asked to load), or a prefill node
        whose K/V is not interchangeable with ours (another model, block size, layer count,
        KV heads, head_dim or dtype)."""
        parsed = check_kv_transfer_params(params, self.config)
        if parsed is not None and parsed.get("do_remote_prefill") and self.spec is not None:
            self.spec.check_compatible(NodeSpec(**parsed["spec"]), "the prefill node")
        return parsed

    # ================================================================ worker: setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The model runner's K/V tensors ({name: [num_blocks, block_size, heads, head_dim]},
        K and V of each layer as separate entries): register them for remote writes, and
        join the pool / open the side channel according to the role."""
        self.layout = KVLayout(kv_caches)
        first = self.layout.tensors[0]
        if first.dim() != 4 or first.shape[1] != self.block_size:
            raise ValueError(f"K/V tensors must be [num_blocks, block_size={self.block_size}, heads, head_dim], "
                             f"got {tuple(first.shape)}")
        self.spec = NodeSpec(self.config.extra["model"], self.block_size, len(kv_caches) // 2, first.shape[2],
                             first.shape[3], str(first.dtype).removeprefix("torch."))
        self._root_hash = self.spec.root_hash()
        self.layer.start(self.layout, self.spec)
        if self.config.is_kv_producer:
            self.send_segment = BlockSegment(self.layout, self.config.extra["send_capacity_blocks"])
            for r in self.send_segment.regions:
                self.layer.engine.register_memory(r.base, r.block_len * r.num_blocks)
            self.side_channel = RpcServer({"pull_kv": self._serve_pull})

    # ================================================================ scheduler side
    def _block_hashes(self, request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks, as every node of this spec computes
        them: sha256 (Python's hash of a str is salted per process) from the spec's root (two
        models' chains never meet, whatever their tokens)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        return append_block_hashes(hashes, request, self.block_size, sha256_hash, root_hash=self._root_hash)

    def _token_hashes(self, request, num_tokens: int) -> list[int]:
        """One chained hash per block of the request's first `num_tokens` tokens, the last one
        over a partial block if num_tokens is not block-aligned (what a staged prompt is)."""
        num_full = num_tokens // self.block_size
        hashes = [h.hash_value for h in self._block_hashes(request)[:num_full]]
        if num_tokens % self.block_size:
            parent = hashes[-1] if hashes else self._root_hash
            tail = request.all_token_ids[num_full * self.block_size:num_tokens]
            extra_keys = generate_block_hash_extra_keys(request, num_full)
            hashes.append(hash_block_tokens(parent, tail, extra_keys, sha256_hash).hash_value)
        return hashes

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the local hit (`num_computed_tokens`, block-aligned) whose K/V can be
        loaded from elsewhere, and whether the load is asynchronous (here: always, when > 0).
        vLLM may also return None ("ask again next step"); this connector always knows."""
        if self.layout is None:
            raise RuntimeError("register_kv_caches() must run before the scheduler asks for matches")
        if num_computed_tokens % self.block_size:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} is not block-aligned (block_size {self.block_size})")
        rid = request.request_id
        self._requests[rid] = request
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("do_remote_prefill"):
            self.config.require("load")
            return self._match_push(request, num_computed_tokens, params)
        if not self.config.is_kv_consumer or rid in self._no_remote:
            return 0, False
        return self._match_pool(request, num_computed_tokens)

    def _match_pool(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        ### BEGIN SOLUTION
        hashes = self._block_hashes(request)
        first = num_computed_tokens // self.block_size
        # Leave at least one token to compute: the model needs its logits to sample.
        last = (request.num_tokens - 1) // self.block_size
        if last <= first:
            return 0, False
        if self._pool_is_down():
            return 0, False
        self.stats["lookups"] += 1
        wanted = [h.hash_value for h in hashes[first:last]]
        try:
            hits = self.layer.pool_query(wanted)
        except (RpcError, ConnectionError, OSError) as e:      # metadata/master unreachable: a miss
            self._pool_failed(e)
            return 0, False
        if [h.block_hash for h in hits] != wanted[:len(hits)]:  # the server answered another question
            self._count_failure("mismatch")
            return 0, False
        if not hits:
            return 0, False
        self.stats["hit_blocks"] += len(hits)
        self._matched[request.request_id] = LoadSpec(request.request_id, "pool", first, len(hits), hits=hits)
        return len(hits) * self.block_size, True
        ### END SOLUTION

    def _match_push(self, request, num_computed_tokens: int, params: dict) -> tuple[int, bool]:
        """Disaggregation: the prefill node staged K/V for params['num_tokens'] tokens (params in
        the canonical form `validate_kv_transfer_params` returned when the request was added).
        Only the staged tokens that are this request's own are loaded: K/V of another prompt
        must never become this one's, whatever request id the params name."""
        if request.request_id in self._no_remote:
            return 0, False
        staged = decode_hashes(params["block_hashes"])
        available = min(self._num_own_tokens(request, staged, params["num_tokens"]), request.num_tokens - 1)
        n = available - num_computed_tokens
        if n <= 0:
            return 0, False
        first, last = num_computed_tokens // self.block_size, cdiv(available, self.block_size)
        self._matched[request.request_id] = LoadSpec(request.request_id, "push", first, last - first,
                                                     push=dict(params), expected_hashes=staged[first:last])
        return n, True

    def _num_own_tokens(self, request, staged_hashes: list[int], num_staged: int) -> int:
        """How many of the staged tokens are this request's: the end of the last staged block
        whose hash equals the hash of our tokens over the same range. The chain makes block i's
        equality cover blocks 0..i, so the first difference ends the match."""
        ours = self._token_hashes(request, min(num_staged, request.num_tokens))
        num_own = 0
        for i, (theirs, mine) in enumerate(zip(staged_hashes, ours)):
            end = min((i + 1) * self.block_size, num_staged)
            if theirs != mine or end > request.num_tokens:
                break
            num_own = end
        return num_own

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """The request now owns its blocks: plan the load into the ones the match covers."""
        spec = self._matched.pop(request.request_id, None)
        if spec is None or num_external_tokens == 0:
            return
        block_ids = list(blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks)
        spec.block_ids = block_ids[spec.first_block:spec.first_block + spec.num_blocks]
        if len(spec.block_ids) != spec.num_blocks:
            raise ValueError(f"request {request.request_id}: {len(block_ids)} blocks allocated, the load needs "
                             f"blocks {spec.first_block}..{spec.first_block + spec.num_blocks - 1}")
        self._loads_to_send.append(spec)
        self.external_tokens[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> GlobalPrefixCacheConnectorMetadata:
        """This step's loads (planned by update_state_after_alloc) and saves: for a producer,
        the prompt blocks that become full this step, and, when a disaggregated request's
        prompt completes, all its blocks to stage for the decode node."""
        meta = GlobalPrefixCacheConnectorMetadata(loads=self._loads_to_send)
        self._loads_to_send = []
        if not self.config.is_kv_producer:
            return meta
        computed_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self._save_state[new.req_id] = _SaveState(list(new.block_ids), len(new.prompt_token_ids))
            computed_before[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._save_state.get(rid)
            if state is None:
                continue
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i])
            else:
                state.block_ids += cached.new_block_ids[i]
            computed_before[rid] = cached.num_computed_tokens[i]
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            state, request = self._save_state.get(rid), self._requests.get(rid)
            if state is None or request is None or rid not in computed_before:
                continue
            save = self._plan_save(rid, request, state, computed_before[rid] + n)
            if save is not None:
                meta.saves.append(save)
        return meta

    def _plan_save(self, rid: str, request, state: _SaveState, computed_after: int) -> SaveSpec | None:
        save = SaveSpec(rid, [], [])
        if self.config.extra["save_to_pool"]:
            num_full = min(computed_after, state.prompt_len) // self.block_size
            if num_full > state.num_saved_blocks:
                hashes = self._block_hashes(request)
                save.block_ids = state.block_ids[state.num_saved_blocks:num_full]
                save.block_hashes = [h.hash_value for h in hashes[state.num_saved_blocks:num_full]]
                state.num_saved_blocks = num_full
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("do_remote_decode") and not state.staged and computed_after >= state.prompt_len:
            self.config.require("save")
            state.staged = True
            save.push_block_ids = state.block_ids[:cdiv(state.prompt_len, self.block_size)]
            save.push_num_tokens = state.prompt_len
            save.push_block_hashes = self._token_hashes(request, state.prompt_len)
        return save if (save.block_ids or save.push_block_ids) else None

    def request_finished(self, request, block_ids: Sequence[int]) -> bool:
        """The request finished: forget it, and return whether its blocks must stay allocated
        (vLLM's delay_free_blocks). Always False here: what a decode node will fetch was
        copied to the send buffer when the prompt completed. (vLLM's MooncakeConnector instead
        returns True and pushes straight from the KV blocks, freeing them on finished_sending.)

        A prefill node also produces the kv_transfer_params the decode node's request must
        carry (vLLM returns them as the second element; KVConnectorScheduler takes a bool):
        read them with `take_kv_transfer_params(request_id)`."""
        rid = request.request_id
        self.finished_request_ids.add(rid)
        for d in (self._hashes, self._requests, self._matched, self._save_state):
            d.pop(rid, None)
        job = self._jobs.pop(rid, None)
        if job is not None:           # finished (aborted) while loading: its blocks are being freed
            job.cancel(self.layer.engine)
        self._no_remote.discard(rid)
        self.external_tokens.pop(rid, None)
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("do_remote_decode"):
            self.config.require("save")
            with self._staged_cv:
                staged = self._staged.get(rid)
            if staged is not None:    # None: its prompt never completed here, nothing to fetch
                self._params_out[rid] = {"do_remote_prefill": True, "remote_session": self.side_channel.address,
                                         "remote_request_id": rid, "num_tokens": staged.num_tokens,
                                         "spec": self.spec.as_dict(), "block_hashes": encode_hashes(staged.block_hashes)}
        return False

    def take_kv_transfer_params(self, request_id: str) -> dict | None:
        """The kv_transfer_params a finished request produced (a prefill node's: where the
        decode node fetches the K/V), once; None if it produced none."""
        self.finished_request_ids.discard(request_id)
        return self._params_out.pop(request_id, None)

    def mark_no_remote(self, request_id: str) -> None:
        """After a failed load: this request computes its K/V locally from now on."""
        self._no_remote.add(request_id)
        self._matched.pop(request_id, None)

    def request_load_failed(self, request) -> None:
        """KVConnectorScheduler recomputes a request whose load failed: never offer it
        remote K/V again (a dead node must not make it fail in a loop)."""
        self.mark_no_remote(request.request_id)

    # ================================================================ worker side: loads
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
            n = self.layer.pool_load(self.layout, spec.hits, spec.block_ids, remaining, job.cancelled)
        else:
            n = self._pull(job, remaining)
        job.finished = time.perf_counter()
        return n

    def _pull(self, job: _LoadJob, timeout: float) -> int:
        """Ask the prefill node to push this request's K/V into our blocks."""
        spec = job.spec
        header = {"op": "pull_kv", "request_id": spec.push["remote_request_id"], "target": self.layer.engine.session_id,
                  "regions": [[r.base, r.block_len, r.num_blocks] for r in self.layout.regions],
                  "first_block": spec.first_block, "block_ids": spec.block_ids, "tag": job.tag,
                  "spec": self.spec.as_dict(), "block_hashes": encode_hashes(spec.expected_hashes), "wait_s": timeout}
        client = RpcClient(spec.push["remote_session"], timeout)
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
        passed its deadline is NOT in finished_recving: it is in get_failed_loads()."""
        now, recving = time.monotonic(), set()
        for rid, job in list(self._jobs.items()):
            if job.future.done():
                del self._jobs[rid]
                err = job.future.exception()
                if err is None:
                    recving.add(rid)
                    self.stats["loaded_tokens"] += self.external_tokens.get(rid, 0)
                    self.stats["loaded_bytes"] += job.future.result()
                    self.load_seconds.append(job.finished - job.started)
                else:
                    self._fail(job, err)
            elif now > job.deadline:
                del self._jobs[rid]
                job.cancel(self.layer.engine)
                self._fail(job, LoadError("timeout", f"not loaded within {self.config.extra['load_timeout_s']} s"))
        return self._drain_sending(now), recving

    def _fail(self, job: _LoadJob, err: BaseException) -> None:
        reason = err.reason if isinstance(err, LoadError) else classify(str(err))
        self._count_failure(reason)
        message = str(err) if isinstance(err, LoadError) else f"{reason}: {err}"
        self._failed[job.spec.request_id] = message
        self.load_failures[job.spec.request_id] = message
        while len(self.load_failures) > self.MAX_FAILURE_HISTORY:
            self.load_failures.popitem(last=False)
        self._failed_block_ids.update(job.spec.block_ids)
        if reason == "unreachable" and job.spec.mode == "pool":
            for node in {hit_node_id(h) for h in job.spec.hits} - {None}:
                self.layer.forget_node(node)

    def _pool_failed(self, error: BaseException) -> None:
        """The pool's server did not answer: count it, and leave the pool alone for
        `pool_retry_s` (a circuit breaker: every step would otherwise wait for the timeout)."""
        self._count_failure("unreachable")
        self.last_error = str(error)
        self._pool_down_until = time.monotonic() + self.config.extra["pool_retry_s"]

    def _pool_is_down(self) -> bool:
        return time.monotonic() < self._pool_down_until

    def _count_failure(self, reason: str) -> None:
        self.stats["failures"][reason] = self.stats["failures"].get(reason, 0) + 1

    def get_failed_loads(self) -> dict[str, str]:
        """{request_id: reason} of loads that failed since the last call (then forgotten)."""
        failed, self._failed = self._failed, {}
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM's name: the local blocks whose load failed since the last call."""
        ids, self._failed_block_ids = self._failed_block_ids, set()
        return ids

    def has_pending_loads(self) -> bool:
        return bool(self._jobs)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until one of the loads in flight finishes, or `timeout` s: an engine with
        nothing to compute but remote K/V on its way waits here instead of spinning (and
        leaves the GIL to the threads doing the transfer)."""
        futures = [job.future for job in self._jobs.values() if job.future is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def discard_saves(self, request_ids) -> None:
        """Requests the forward pass failed (their K/V may be half written): publish and stage
        none of their blocks this step. Call before wait_for_save."""
        drop = set(request_ids)
        if not drop or not self._meta.saves:
            return
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

    # ================================================================ worker side: saves
    def _begin_saves(self) -> list[tuple[SaveSpec, Any, list[int]]]:
        if self._save_handles is None:
            self._save_handles = []
            for save in self._meta.saves:
                handle = []
                if save.block_ids and not self._pool_is_down():
                    try:
                        handle = self.layer.pool_begin_save(self.layout, save.block_ids, save.block_hashes)
                    except (RpcError, ConnectionError, OSError) as e:
                        self._pool_failed(e)                     # the pool is down: just don't publish
                slots = []
                if save.push_block_ids:
                    slots = self.send_segment.allocate(len(save.push_block_ids)) or []
                    if not slots:
                        self._count_failure("send_buffer_full")
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
        """Side channel (vLLM: ZMQ): a decode node asks for request `request_id`'s K/V to be
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

    # ================================================================ shutdown
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


class GlobalKVPoolConnector(KVConnectorBase_V1):
    """From scratch: our metadata server + our transfer engine [vLLM 2.0 part 2, §7.5]."""
    layer_name = "scratch"

    def _make_layer(self):
        return ScratchLayer(self.config, self.node_id)


class MooncakeConnector(KVConnectorBase_V1):
    """The real system: Mooncake's TransferEngine (push) and Store (pool)."""
    layer_name = "mooncake"

    def _make_layer(self):
        from global_prefix_cache.mooncake_layer import MooncakeLayer
        return MooncakeLayer(self.config, self.node_id)


CONNECTORS = {"GlobalKVPoolConnector": GlobalKVPoolConnector, "MooncakeConnector": MooncakeConnector}


def create_connector(kv_transfer_config: KVTransferConfig | dict, block_size: int,
                     node_id: str | None = None) -> KVConnectorBase_V1:
    """vLLM's KVConnectorFactory.create_connector: the config's name picks the class."""
    config = KVTransferConfig.from_dict(kv_transfer_config)
    return CONNECTORS[config.kv_connector](config, block_size, node_id)
