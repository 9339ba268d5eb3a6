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
blocks, resumed requests' full tables) and executes blocks_to_swap_out -> swap_in -> copy in the
model runner's order — so the scheduler's whole contract with a model runner is under test,
not just its own bookkeeping. (Chapter 06's `ShadowKVConnectorRunner` also lands remote K/V.)
"""
from __future__ import annotations

from typing import Callable

from scheduler.mock_runner import MockModelRunner
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request


def kv_value(tokens, pos: int) -> int:
    """The shadow 'K/V' of position pos: depends on every token up to pos (like real K/V)."""
    h = 0
    for t in tokens[:pos + 1]:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h


class ShadowKVRunner(MockModelRunner):
    """MockModelRunner + a shadow KV cache checked before, and written during, every step."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 next_token: Callable[[Request], int] = lambda request: 1,
                 num_accepted: Callable[[Request, list[int]], int] = lambda request, drafts: len(drafts)) -> None:
        super().__init__(next_token, num_accepted)
        self.block_size = block_size
        self.device: list[int | None] = [None] * (num_blocks * block_size)    # slot -> shadow K/V (None: never written)
        self.cpu: list[int | None] = [None] * (num_cpu_blocks * block_size)
        self.block_ids: dict[str, list[int]] = {}                            # the runner's own block tables
        self.num_checked = 0                                                 # positions verified (tests assert > 0)

    # ------------------------------------------------------------------ the runner's contract
    def execute(self, requests: dict[str, Request], so: SchedulerOutput) -> ModelRunnerOutput:
        computed_before = self._update_block_tables(so)
        self._move_blocks(so)
        finished_recving, invalid_block_ids = self._land_external_kv(requests, so)
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

    def _land_external_kv(self, requests: dict[str, Request], so: SchedulerOutput) -> tuple[set[str], set[int]]:
        """Hook: K/V written into the cache from outside before the forward (chapter 06 loads
        remote K/V here). Returns (finished_recving, invalid_block_ids) for the output."""
        return set(), set()
