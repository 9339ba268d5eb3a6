"""The hook through which KV computed ELSEWHERE enters a request (disaggregated prefill,
a global prefix cache): chapter 06 implements it; this chapter defines what the scheduler asks.

Mirrors the scheduler-side half of vLLM's `KVConnectorBase_V1`
(`vllm/distributed/kv_transfer/kv_connector/v1/base.py`): `get_num_new_matched_tokens` and
`update_state_after_alloc`. The worker-side half (the actual transfer) reports completed loads
back through `ModelRunnerOutput.finished_recving`.

In the two-counter view (thesis Table 4.1, "prefill disaggregation") a remote hit is just a
prefix-cache hit that lives on another machine: `num_computed_tokens <- L_local + L_external`.
With an asynchronous load the request waits in `WAITING_FOR_REMOTE_KVS`, owning the blocks
being filled, and the KV manager is told not to publish those blocks in the prefix cache yet
(`delay_cache_blocks=True`) — their contents are not there until the load finishes.
"""
from __future__ import annotations

from typing import Protocol

from scheduler.request import Request


class KVConnector(Protocol):
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens AFTER the local prefix-cache hit (`num_computed_tokens`) can be loaded
        from outside, and whether the load is asynchronous (the request must wait for it).
        Must leave at least one token of the request to compute (there must be logits to sample)."""
        ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request now owns `block_ids`; the connector may plan the load into them."""
        ...
