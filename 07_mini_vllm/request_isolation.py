"""One request never takes the batch down: a step that raises is run again in halves, down to the
request that fails alone.

vLLM fails the whole engine when a forward pass raises (`EngineCore.step` -> EngineDeadError);
here the fault is isolated instead, because a request with a bad state (a malformed prompt that got
past validation, a kernel bug on one odd shape) should cost that request and nothing else. The
model runner calls `run_isolated` around its "prepare inputs -> forward -> sample" of a step's rows.

Why re-running is safe: a forward pass writes each token's K/V to the same slot again (the slot
mapping depends only on the request's position and block table), and sampling appends only after
everything of its call was read out, so a failed call leaves the batch as it was.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)


def run_isolated(run: Callable[[np.ndarray, np.ndarray], None], rows: np.ndarray, num_scheduled: np.ndarray,
                 req_ids: list, failed: dict[str, str]) -> None:
    """`run(rows, num_scheduled)` for the batch rows `rows` (each with its num_scheduled tokens);
    if it raises, run each half again, recursively. A single row that raises is reported in
    `failed` (request id -> why), and the scheduler finishes that request with the message."""
    try:
        run(rows, num_scheduled)
    except Exception as error:      # noqa: BLE001 — isolating per-request faults is the point
        if len(rows) == 1:
            req_id = req_ids[rows[0]]
            logger.exception("request %s failed in the forward pass or the sampler", req_id)
            failed[req_id] = f"the engine could not run this request: {type(error).__name__}: {error}"
            return
        half = len(rows) // 2
        run_isolated(run, rows[:half], num_scheduled[:half], req_ids, failed)
        run_isolated(run, rows[half:], num_scheduled[half:], req_ids, failed)
