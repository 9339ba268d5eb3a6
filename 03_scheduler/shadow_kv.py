"""A model runner that keeps a SHADOW of the KV cache, so a test can prove the scheduler never
lets a request attend to K/V that is not its own prefix's.

A real runner writes each new token's K/V into the slot its block table gives, and attention
reads every earlier position through the same table. Nothing checks that what it reads was
written for *this* request's tokens: a prefix-cache hit on a block nobody computed, a block
freed and reused while still referenced, a swap mapping off by one, a remote load that lands
in the wrong block — each silently yields plausible but wrong text. This runner replaces K/V
by one number per slot, `kv_value(tokens, pos)`, a function of the WHOLE prefix
tokens[0..pos] (as real K/V is), and before every forward pass checks, for every scheduled
request, every position it is about to attend to:

    cache[slot(pos)] == kv_value(request tokens, pos)    for pos < num_computed_tokens

Then it writes this step's tokens (drafts included: a rejected draft's slot holds the K/V of a
prefix that is then abandoned, and must be rewritten before anyone reads it again).

It builds its block tables ONLY from the SchedulerOutput deltas (new requests, appended
blocks, resumed requests' full tables), executes blocks_to_swap_out -> swap_in -> copy in the
model runner's order, and loads remote K/V for `ShadowKVConnector` the way a worker-side
connector would — so the scheduler's whole contract with a model runner is under test, not
just its own bookkeeping.
"""
from __future__ import annotations

import random
from typing import Callable

from scheduler.kv_connector import KVConnectorBase
from scheduler.mock_runner import MockModelRunner
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus


def kv_value(tokens, pos: int) -> int:
    """The shadow 'K/V' of position pos: depends on every token up to pos (like real K/V)."""
    h = 0
    for t in tokens[:pos + 1]:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h


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


class ShadowKVRunner(MockModelRunner):
    """MockModelRunner + a shadow KV cache checked before, and written during, every step."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 next_token: Callable[[Request], int] = lambda request: 1,
                 num_accepted: Callable[[Request, list[int]], int] = lambda request, drafts: len(drafts),
                 connector: ShadowKVConnector | None = None) -> None:
        super().__init__(next_token, num_accepted)
        self.block_size = block_size
        self.device: list[int | None] = [None] * (num_blocks * block_size)    # slot -> shadow K/V (None: never written)
        self.cpu: list[int | None] = [None] * (num_cpu_blocks * block_size)
        self.block_ids: dict[str, list[int]] = {}                            # the runner's own block tables
        self.connector = connector
        if connector is not None:
            connector.block_size = block_size
        self.num_checked = 0                                                 # positions verified (tests assert > 0)

    # ------------------------------------------------------------------ the runner's contract
    def execute(self, requests: dict[str, Request], so: SchedulerOutput) -> ModelRunnerOutput:
        computed_before = self._update_block_tables(so)
        self._move_blocks(so)
        finished_recving, invalid_block_ids = self._land_remote_loads(requests, so)
        written: dict[int, str] = {}
        for req_id, num_new in so.num_scheduled_tokens.items():
            request = requests[req_id]
            start = computed_before[req_id]
            tokens = list(request.all_token_ids) + list(so.scheduled_spec_decode_tokens.get(req_id, []))
            for pos in range(start):                       # everything this step's queries attend to
                got = self.device[self._slot(req_id, pos)]
                assert got == kv_value(tokens, pos), (
                    f"request {req_id} attends to position {pos} (slot {self._slot(req_id, pos)}), which holds "
                    f"{'nothing' if got is None else 'K/V of another prefix'}: blocks {self.block_ids[req_id]}")
            self.num_checked += start
            for pos in range(start, start + num_new):
                slot = self._slot(req_id, pos)
                assert slot not in written, f"requests {written[slot]} and {req_id} write slot {slot} in one step"
                written[slot] = req_id
                self.device[slot] = kv_value(tokens, pos)
        output = super().execute(requests, so)
        output.finished_recving |= finished_recving
        output.invalid_block_ids |= invalid_block_ids
        return output

    def _slot(self, req_id: str, pos: int) -> int:
        blocks = self.block_ids[req_id]
        assert pos // self.block_size < len(blocks), (
            f"request {req_id}: position {pos} is past its {len(blocks)} blocks of {self.block_size}")
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _update_block_tables(self, so: SchedulerOutput) -> dict[str, int]:
        """Apply the output's deltas as the real runner does; returns num_computed_tokens BEFORE the step."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.block_ids.pop(req_id, None)
        computed = {}
        for new in so.scheduled_new_reqs:
            self.block_ids[new.req_id] = list(new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, resumed, new_ids, n in zip(cached.req_ids, cached.resumed_from_preemption,
                                               cached.new_block_ids, cached.num_computed_tokens):
            self.block_ids[req_id] = list(new_ids) if resumed else self.block_ids[req_id] + list(new_ids)
            computed[req_id] = n
        return computed

    def _move_blocks(self, so: SchedulerOutput) -> None:
        B = self.block_size
        for src_pool, dst_pool, pairs in ((self.device, self.cpu, so.blocks_to_swap_out),
                                          (self.cpu, self.device, so.blocks_to_swap_in),
                                          (self.device, self.device, so.blocks_to_copy)):
            for src, dst in pairs:
                dst_pool[dst * B:(dst + 1) * B] = src_pool[src * B:(src + 1) * B]

    def _land_remote_loads(self, requests: dict[str, Request], so: SchedulerOutput) -> tuple[set[str], set[int]]:
        """The worker side of ShadowKVConnector: write the claimed external K/V. A synchronous
        load (its request was admitted this step) lands before the forward; an asynchronous
        one lands at a random step while its request waits, and is reported — as finished, or
        (p_fail) as failed from one of its blocks on. Returns (finished_recving, invalid_block_ids)."""
        landed: set[str] = set()
        invalid: set[int] = set()
        if self.connector is None:
            return landed, invalid
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
