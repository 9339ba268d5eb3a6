"""A failed remote load falls back to local recompute, leaking no block.

vLLM: `kv_load_failure_policy="recompute"` and `Scheduler._update_requests_with_invalid_blocks`
(`vllm/v1/core/sched/scheduler.py`), fed by `get_block_ids_with_load_errors()`.

In the two-counter view it is preemption by recompute (thesis Table 4.1): the request gave
its blocks back and `num_computed_tokens <- 0`; it stays in the waiting queue, finds its
local prefix-cache hit again, and computes the rest — the connector is told not to offer
the remote copy again for it (`mark_no_remote`), so a broken node cannot make it loop.

This lives here until chapter 03's scheduler takes failed loads itself (see the README).
"""
from __future__ import annotations

from typing import Iterable

from scheduler.request import RequestStatus


def recover_failed_loads(scheduler, connector, failed_request_ids: Iterable[str]) -> list[str]:
    """Put each request whose load failed back to plain WAITING with no blocks.
    Returns the ids it recovered (unknown / already finished ones are skipped)."""
    recovered = []
    for rid in failed_request_ids:
        connector.mark_no_remote(rid)
        request = scheduler.requests.get(rid)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            continue
        scheduler.kv_cache_manager.free(request)      # the blocks it was loading into, and its local hits
        request.num_computed_tokens = 0
        if hasattr(request, "num_external_computed_tokens"):
            request.num_external_computed_tokens = 0
        request.status = RequestStatus.WAITING        # still in the waiting queue: rescheduled next step
        scheduler.finished_recving_kv_req_ids.discard(rid)
        recovered.append(rid)
    return recovered
