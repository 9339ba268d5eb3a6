"""The connector's scheduler half: which tokens' K/V exist elsewhere, and what each step moves.

vLLM: `KVConnectorBase_V1` built with `KVConnectorRole.SCHEDULER` (MooncakeConnector's
`MooncakeConnectorScheduler`), one per engine core. It never touches K/V bytes: it hashes a
request's blocks, asks the pool which of them exist — for every rank's share, since each rank
publishes its own — or reads the prefill node's `kv_transfer_params`, and writes the step's loads
and saves into the metadata every worker half receives (`connector_worker.py`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from global_prefix_cache.config import KVConnectorRole, KVTransferConfig
from global_prefix_cache.connector import (CONNECTORS, GlobalPrefixCacheConnectorMetadata, KVConnectorOutput,
                                           LoadSpec, PoolHealth, SaveSpec)
from global_prefix_cache.kv_layout import NodeSpec
from global_prefix_cache.layers import pool_key
from global_prefix_cache.rpc import RpcError
from global_prefix_cache.scheduler import KVConnectorBase
from global_prefix_cache.transfer_params import check_kv_transfer_params, decode_hashes, encode_hashes
from kvcache.hashing import BlockHash, append_block_hashes, generate_block_hash_extra_keys, hash_block_tokens, sha256_hash
from paged_attention import cdiv


@dataclass
class _SaveState:
    block_ids: list[int]
    prompt_len: int
    num_saved_blocks: int = 0
    staged: bool = False


class ConnectorScheduler(PoolHealth, KVConnectorBase):
    """The scheduler-side half (`scheduler.KVConnectorBase`): plans loads and saves for every rank."""

    role = KVConnectorRole.SCHEDULER
    MAX_FAILURE_HISTORY = 1024

    def __init__(self, config: KVTransferConfig, spec: NodeSpec, node_id: str) -> None:
        if not isinstance(spec.block_size, int) or spec.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {spec.block_size!r}")
        self.config, self.spec, self.node_id = config, spec, node_id
        self.block_size = spec.block_size
        self._root_hash = spec.root_hash()          # seeds every block-hash chain we share
        self.layer = CONNECTORS[config.kv_connector](config, node_id, spec, KVConnectorRole.SCHEDULER)
        self.worker_sessions: list[str | None] = []  # each rank's side channel (set_xfer_handshake_metadata)
        self._hashes: dict[str, list[BlockHash]] = {}
        self._requests: dict[str, Any] = {}
        self._matched: dict[str, LoadSpec] = {}      # matched, waiting for update_state_after_alloc
        self._loads_to_send: list[LoadSpec] = []
        self._loading: set[str] = set()              # loads the workers have not all reported done
        self._save_state: dict[str, _SaveState] = {}
        self._staged: dict[str, tuple[int, list[int]]] = {}   # request -> (tokens, hashes) every rank staged
        self._no_remote: set[str] = set()            # failed once: compute locally from now on
        self.finished_request_ids: set[str] = set()  # request_finished seen (the engine calls it once)
        self._params_out: dict[str, dict] = {}
        self.external_tokens: dict[str, int] = {}    # live request -> tokens planned to load (stats)
        self.load_failures: OrderedDict[str, str] = OrderedDict()   # request -> why its load failed (recent)
        self.stats = {"lookups": 0, "hit_blocks": 0, "loaded_tokens": 0, "failures": {}}

    @property
    def kv_load_failure_policy(self) -> str:
        """Read by KVConnectorScheduler when a load fails: "recompute" or "fail"."""
        return self.config.kv_load_failure_policy

    def set_xfer_handshake_metadata(self, worker_sessions: Sequence[str | None]) -> None:
        """Each rank's side channel address (None: not a producer), in rank order: what a decode
        node's rank r calls to have rank r of this node push its share (vLLM: the workers'
        handshake metadata, gathered by the executor)."""
        if len(worker_sessions) != self.spec.world_size:
            raise ValueError(f"{len(worker_sessions)} worker side channels for {self.spec.world_size} ranks")
        self.worker_sessions = list(worker_sessions)

    def validate_kv_transfer_params(self, params: dict | None) -> dict | None:
        """The canonical form of a request's kv_transfer_params (`transfer_params.py`: every
        field type- and range-checked), before the request is queued; the request must carry
        that form. ValueError if they are malformed or ask what this node cannot do: a role
        that cannot (a consumer asked to send, a producer asked to load), or a prefill node
        whose K/V is not interchangeable with ours (another model, block size, layer count,
        KV heads, head_dim, dtype or parallel layout)."""
        parsed = check_kv_transfer_params(params, self.config)
        if parsed is not None and parsed.get("do_remote_prefill"):
            self.spec.check_compatible(NodeSpec(**parsed["spec"]), "the prefill node")
        return parsed

    # ================================================================ hashes
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

    # ================================================================ matching
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the local hit (`num_computed_tokens`, block-aligned) whose K/V can be
        loaded from elsewhere, and whether the load is asynchronous (here: always, when > 0).
        vLLM may also return None ("ask again next step"); this connector always knows."""
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
        """The longest run of blocks after the local hit that the pool holds for EVERY rank (each
        rank loads its own share of a block; a block some rank lacks is no hit)."""
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
        hits = {}
        for rank in range(self.spec.world_size):
            keys = [pool_key(h, rank) for h in wanted]
            try:
                found = self.layer.pool_query(keys)
            except (RpcError, ConnectionError, OSError) as e:      # metadata/master unreachable: a miss
                self._pool_failed(e)
                return 0, False
            if [h.block_hash for h in found] != keys[:len(found)]:  # the server answered another question
                self._count_failure("mismatch")
                return 0, False
            hits[rank] = found
            wanted = wanted[:len(found)]        # no rank can load past the shortest share
            if not wanted:
                return 0, False
        num_blocks = len(wanted)
        self.stats["hit_blocks"] += num_blocks
        self._matched[request.request_id] = LoadSpec(request.request_id, "pool", first, num_blocks,
                                                     hits={r: h[:num_blocks] for r, h in hits.items()})
        return num_blocks * self.block_size, True
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
        self._loading.add(request.request_id)
        self.external_tokens[request.request_id] = num_external_tokens

    # ================================================================ each step
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
            self._staged[rid] = (save.push_num_tokens, save.push_block_hashes)
        return save if (save.block_ids or save.push_block_ids) else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the ranks reported for a step, aggregated (vLLM: update_connector_output): loads
        that landed everywhere, loads that failed, prompts some rank could not stage (no decode
        node will be told to fetch them). Called before the step's finished requests are."""
        for rid in output.finished_recving:
            self.stats["loaded_tokens"] += self.external_tokens.get(rid, 0)
        self._loading -= output.finished_recving | set(output.failed_recving)
        for rid, failure in output.failed_recving.items():
            self.load_failures[rid] = failure.reason
            while len(self.load_failures) > self.MAX_FAILURE_HISTORY:
                self.load_failures.popitem(last=False)
        for rid in output.failed_staging:
            self._staged.pop(rid, None)

    def request_finished(self, request, block_ids: Sequence[int]) -> bool:
        """The request finished: forget it, and return whether its blocks must stay allocated
        (vLLM's delay_free_blocks): True only while its load is still running on some rank (it was
        aborted while waiting for remote K/V) — the workers stop the load when they see it finished
        and report it in finished_recving, which frees the blocks. A send never holds blocks here:
        what a decode node will fetch was copied to every rank's send buffer when the prompt
        completed. (vLLM's MooncakeConnector instead pushes straight from the KV blocks, freeing
        them on finished_sending.)

        A prefill node also produces the kv_transfer_params the decode node's request must
        carry (vLLM returns them as the second element; KVConnectorScheduler takes a bool):
        read them with `take_kv_transfer_params(request_id)`."""
        rid = request.request_id
        self.finished_request_ids.add(rid)
        for d in (self._hashes, self._requests, self._matched, self._save_state):
            d.pop(rid, None)
        self._no_remote.discard(rid)
        self.external_tokens.pop(rid, None)
        staged = self._staged.pop(rid, None)
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("do_remote_decode"):
            self.config.require("save")
            if staged is not None:    # None: its prompt never completed here, nothing to fetch
                num_tokens, hashes = staged
                self._params_out[rid] = {"do_remote_prefill": True, "remote_sessions": list(self.worker_sessions),
                                         "remote_request_id": rid, "num_tokens": num_tokens,
                                         "spec": self.spec.as_dict(), "block_hashes": encode_hashes(hashes)}
        return rid in self._loading

    def take_kv_transfer_params(self, request_id: str) -> dict | None:
        """The kv_transfer_params a finished request produced (a prefill node's: where the
        decode node fetches the K/V), once; None if it produced none."""
        self.finished_request_ids.discard(request_id)
        return self._params_out.pop(request_id, None)

    def request_load_failed(self, request) -> None:
        """KVConnectorScheduler recomputes a request whose load failed: never offer it
        remote K/V again (a dead node must not make it fail in a loop)."""
        self._no_remote.add(request.request_id)
        self._matched.pop(request.request_id, None)

    def shutdown(self) -> None:
        self.layer.close()
