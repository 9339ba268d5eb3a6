"""The shadow KV runner of chapter 03 (`scheduler.ShadowKVRunner`), with a KV connector whose
remote store holds the right K/V for any prefix: the scheduler's remote-KV path under the same
slot-by-slot check as the rest of its contract (every position a request attends to holds
`kv_value` of its own prefix)."""
from __future__ import annotations

import random

from global_prefix_cache.scheduler import KVConnectorBase
from scheduler import Request, RequestStatus, SchedulerOutput, ShadowKVRunner, kv_value


class ShadowKVConnector(KVConnectorBase):
    """A KV connector whose remote store holds the right K/V for ANY prefix (it can compute
    `kv_value`), and which claims a random number of external tokens after the local hit.

    `ShadowKVRunner` plays its worker side: a synchronous load is written before the forward
    of the step that admits the request; an asynchronous one lands at a random later step and
    is reported in `finished_recving`. A request that finishes before its load lands is
    dropped, so the load never writes into blocks handed to someone else.

    With `p_fail` > 0 an asynchronous load FAILS that often when it lands: the blocks before a
    random one of its blocks get the right K/V, that block and the rest get poison (as a half
    finished transfer, or bytes that failed a checksum), and they are reported in
    `invalid_block_ids` — so the shadow check catches a scheduler that trusts any of them.
    A request whose load failed is never offered external tokens again (`request_load_failed`).
    """

    def __init__(self, rng: random.Random, p_external: float = 0.5, p_async: float = 0.5,
                 claim_everything: bool = False, p_fail: float = 0.0) -> None:
        self.rng, self.p_external, self.p_async = rng, p_external, p_async
        self.claim_everything = claim_everything    # claim all remaining tokens (the scheduler must keep one)
        self.p_fail = p_fail
        self._local_hit: dict[str, int] = {}         # req -> its local prefix-cache hit when it asked
        self.pending: dict[str, tuple[list[int], int, int]] = {}   # req -> (block ids, first position, count)
        self.num_loaded_tokens = 0
        self.failed: set[str] = set()                # requests told: your load failed
        self.num_failed_loads = 0

    def request_load_failed(self, request: Request) -> None:
        self.failed.add(request.request_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self._local_hit[request.request_id] = num_computed_tokens
        if request.request_id in self.failed:
            return 0, False
        remaining = request.num_tokens - num_computed_tokens
        if self.claim_everything:
            return remaining, self.rng.random() < self.p_async
        if remaining <= 1 or self.rng.random() >= self.p_external:
            return 0, False
        return self.rng.randint(1, remaining - 1), self.rng.random() < self.p_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        first = self._local_hit.pop(request.request_id)
        self.pending[request.request_id] = (list(block_ids), first, num_external_tokens)


class ShadowKVConnectorRunner(ShadowKVRunner):
    """ShadowKVRunner + the worker side of a ShadowKVConnector."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, *,
                 connector: ShadowKVConnector, **kwargs) -> None:
        super().__init__(num_blocks, block_size, num_cpu_blocks, **kwargs)
        self.connector = connector
        connector.block_size = block_size

    def _land_external_kv(self, requests: dict[str, Request], so: SchedulerOutput) -> tuple[set[str], set[int]]:
        """The worker side of ShadowKVConnector: write the claimed external K/V. A synchronous
        load (its request was admitted this step) lands before the forward; an asynchronous
        one lands at a random step while its request waits, and is reported — as finished, or
        (p_fail) as failed from one of its blocks on. Returns (finished_recving, invalid_block_ids)."""
        landed: set[str] = set()
        invalid: set[int] = set()
        for req_id, (blocks, first, count) in list(self.connector.pending.items()):
            request = requests.get(req_id)
            if request is None or request.is_finished:
                del self.connector.pending[req_id]            # aborted: never write into freed blocks
                continue
            waiting = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if waiting and self.connector.rng.random() < 0.5:
                continue                                      # still in flight
            del self.connector.pending[req_id]
            B, tokens = self.block_size, list(request.all_token_ids)
            bad_from = first + count                           # positions >= bad_from are not valid
            if waiting and self.connector.p_fail and self.connector.rng.random() < self.connector.p_fail:
                bad_block = self.connector.rng.randint(first // B, (first + count - 1) // B)
                bad_from = max(first, bad_block * B)
                invalid.update(blocks[bad_block:(first + count - 1) // B + 1])
                self.connector.num_failed_loads += 1
            for pos in range(first, first + count):
                self.device[blocks[pos // B] * B + pos % B] = kv_value(tokens, pos) if pos < bad_from else -1
            if bad_from < first + count:
                continue                                      # reported through invalid_block_ids only
            self.connector.num_loaded_tokens += count
            if waiting:
                landed.add(req_id)
        return landed, invalid
