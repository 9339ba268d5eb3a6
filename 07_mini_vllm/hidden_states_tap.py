"""HiddenStatesTap: the target's last hidden state at every position the engine computes, kept per
request — what an EAGLE head trains on (`python -m mini_vllm.self_distill`).

An EAGLE head learns f_p -> f_{p+1} over the target's own text. A separate teacher-forced pass to
get those features costs as much as generating the text; the engine already computes every
position's hidden state while it writes the text (prefill chunks, then one row per decode step),
so the tap copies them out as they go, with the greedy token at every row the engine samples
(the argmax of the raw logits: the target's prediction, whatever the request's sampling drew).

    runner.hidden_states_tap = HiddenStatesTap()       # in-process engine, no drafter
    ... generate ...
    hidden, greedy = tap.pop(req_id)     # [L, H] rows for positions 0..L-1; {position: greedy token}

A position computed twice (a recompute preemption) keeps its last copy; rows are stored in
float16 (half the memory; the features' rounding stays far below the noise EAGLE trains with).
"""
from __future__ import annotations

import numpy as np
import torch


class HiddenStatesTap:
    def __init__(self, dtype: torch.dtype = torch.float16):
        self.dtype = dtype
        self._rows: dict[str, dict[int, torch.Tensor]] = {}      # req_id -> {first position: [n, H]}
        self._greedy: dict[str, dict[int, int]] = {}             # req_id -> {position: greedy next token}
        self._pending: dict[str, int] = {}                       # req_id -> this step's greedy token

    def observe_hidden(self, req_ids, num_computed: np.ndarray, num_scheduled: np.ndarray,
                       hidden: torch.Tensor) -> None:
        """One forward's rows: request j's num_scheduled[j] rows (positions num_computed[j] ...)
        follow request j-1's in `hidden` [T, H]."""
        start = 0
        for req_id, first, n in zip(req_ids, num_computed.tolist(), num_scheduled.tolist()):
            self._rows.setdefault(req_id, {})[first] = hidden[start:start + n].to("cpu", self.dtype)
            if req_id in self._pending:                          # it sampled at its last row this step
                self._greedy.setdefault(req_id, {})[first + n - 1] = self._pending.pop(req_id)
            start += n

    def observe_greedy(self, req_ids, logits: torch.Tensor) -> None:
        """The step's sampled rows: request req_ids[j]'s raw logits [S, V] at its last position this
        step (observe_hidden, called after sampling, tells which position that is)."""
        for req_id, tok in zip(req_ids, logits.argmax(-1).tolist()):
            self._pending[req_id] = tok

    def pop(self, req_id: str) -> tuple[torch.Tensor, dict[int, int]]:
        """The request's rows for positions 0, 1, ... in order (a gap is an error: the engine skips
        no position it keeps K/V for, prefix-cache hits aside — turn prefix caching off)."""
        chunks = self._rows.pop(req_id, {})
        greedy = self._greedy.pop(req_id, {})
        rows, end = [], 0
        for first in sorted(chunks):
            if first > end:
                raise ValueError(f"request {req_id}: no hidden states for positions [{end}, {first}) (a prefix-cache "
                                 "hit skips them: run the tap with enable_prefix_caching=False)")
            rows.append(chunks[first][end - first:])
            end = first + chunks[first].shape[0]
        return (torch.cat(rows) if rows else torch.empty(0)), greedy

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self._rows.pop(r, None)
            self._greedy.pop(r, None)
            self._pending.pop(r, None)
