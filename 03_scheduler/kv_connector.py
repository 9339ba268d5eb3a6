"""The hook through which KV computed ELSEWHERE enters a request (disaggregated prefill,
a global prefix cache): chapter 06 implements it; this chapter defines what the scheduler asks.

Mirrors the scheduler-side half of vLLM's `KVConnectorBase_V1`
(`vllm/distributed/kv_transfer/kv_connector/v1/base.py`): `get_num_new_matched_tokens`,
`update_state_after_alloc`, `build_connector_meta` and `request_finished`. The worker-side
half (the actual transfer, chapter 06) reports completed loads back through
`ModelRunnerOutput.finished_recving`, and completed sends through `finished_sending`.

In the two-counter view (thesis Table 4.1, "prefill disaggregation") a remote hit is just a
prefix-cache hit that lives on another machine: `num_computed_tokens <- L_local + L_external`.
With an asynchronous load the request waits in `WAITING_FOR_REMOTE_KVS`, owning the blocks
being filled. Nothing is published in the prefix cache until it has landed: the scheduler
registers a request's blocks only after a step in which it ran (`KVCacheManager.cache_blocks`).

A load can FAIL (the remote node died, timed out, sent bytes that fail their checksum): the
worker reports the blocks it could not fill in `ModelRunnerOutput.invalid_block_ids`, and the
scheduler applies the connector's `kv_load_failure_policy` (vLLM's names): "recompute" rewinds
`num_computed_tokens` to the first invalid block (at most the local hit, for a connector that
reports all of a failed load's blocks) and lets the request compute the rest itself, in the
blocks it already owns; "fail" finishes it with an error. Either way the invalid blocks never
enter the prefix cache, and `request_load_failed` tells the connector not to offer that
request remote K/V again (a dead node must not make it fail in a loop).

The scheduler always keeps at least the last token to compute — even if a connector could
load every token, the logits of the next token come from a forward pass over the last one.
"""
from __future__ import annotations

from typing import Any

from scheduler.request import Request


class KVConnectorBase:
    """The scheduler-side connector interface. Subclasses implement the two matching methods;
    the others default to "nothing to tell the workers", "free the blocks now" and "nothing
    to remember about a failed load"."""

    # What the scheduler does with a request whose asynchronous load failed (vLLM:
    # KVTransferConfig.kv_load_failure_policy): "recompute" or "fail".
    kv_load_failure_policy: str = "recompute"

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens AFTER the local prefix-cache hit (`num_computed_tokens`) can be loaded
        from outside, and whether the load is asynchronous (the request must wait for it).
        None: cannot tell yet (ask again next step). The scheduler caps the answer so that at
        least one token is left to compute."""
        raise NotImplementedError

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request now owns `block_ids` (its whole table, the local hit first); the connector
        plans the load of `num_external_tokens` tokens into them."""
        raise NotImplementedError

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """What the worker-side connector must do this step (loads to start, blocks to save)."""
        return None

    def request_load_failed(self, request: Request) -> None:
        """The worker reported this request's load as failed and the scheduler recomputes it
        (policy "recompute"). From now on `get_num_new_matched_tokens` should answer 0 for it:
        it is asked again if the request is ever reset to zero computed tokens (preemption)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """The request finished. True: its blocks are still being read (sent to another node):
        free them only when the worker reports the request in `finished_sending`."""
        return False


# The name chapter 03's scheduler type-hints with (kept short: a connector is a connector).
KVConnector = KVConnectorBase
