"""Prompt logprobs, the model runner's side: the log-probability of every prompt token, as it is computed.

Mirrors vLLM v1's `GPUModelRunner._get_prompt_logprobs_dict` (`vllm/v1/worker/gpu_model_runner.py`).
Position p's logits give token p + 1's logprob, its rank and the k most likely tokens — from the
raw model distribution, whatever `logprobs_mode` says. A prompt computed in chunks fills them in
over several steps (the runner keeps them in the request's state); they go out once, in the step
that completes the prompt. A request that asks for them never reads the prefix cache
(`EngineCoreRequest.to_request`: every prompt position needs its logits).
"""
from __future__ import annotations

import numpy as np
import torch

from mini_vllm.sampler import compute_logprobs


class PromptLogprobsMixin:
    """For ModelRunner: `_prompt_logprobs` after a step's forward pass (reads `self.input_batch`,
    `self.model`)."""

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: np.ndarray, num_scheduled: np.ndarray,
                         sample_rows: np.ndarray, output) -> None:
        """hidden [T, hidden] of the step's rows `rows` (each with num_scheduled[j] tokens); the rows
        among them that sampled this step (`sample_rows`) have completed their prompts."""
        batch = self.input_batch
        k = batch.num_prompt_logprobs[rows]                                            # [n]
        wanted = np.flatnonzero(k >= 0)
        if wanted.size == 0:
            return
        starts = np.cumsum(num_scheduled) - num_scheduled                              # [n] flat offsets
        flat, owners = [], []
        for j in wanted.tolist():
            row = rows[j]
            first = int(batch.num_computed_tokens[row])
            last = min(first + int(num_scheduled[j]), int(batch.num_prompt_tokens[row]) - 1)   # positions [first, last)
            flat.extend(range(int(starts[j]), int(starts[j]) + max(0, last - first)))
            owners.extend((row, p) for p in range(first, last))
        if flat:
            logits = self.model.compute_logits(hidden[torch.tensor(flat, device=hidden.device)])      # [P, V]
            targets = torch.tensor([int(batch.token_ids[row, p + 1]) for row, p in owners], device=logits.device)
            lp = compute_logprobs(logits, targets, int(k[wanted].max()))
            ids, values, ranks = lp.logprob_token_ids.tolist(), lp.logprobs.tolist(), lp.selected_token_ranks.tolist()
            for i, (row, p) in enumerate(owners):
                state, kk = batch.states[row], int(batch.num_prompt_logprobs[row])
                if state.prompt_logprobs is None:
                    state.prompt_logprobs = [None] * (len(state.prompt_token_ids) - 1)
                state.prompt_logprobs[p] = (ids[i][:kk + 1], values[i][:kk + 1], ranks[i])
        for row in set(sample_rows.tolist()) & set(rows[wanted].tolist()):           # the prompt is complete
            state = batch.states[row]
            output.prompt_logprobs[state.req_id] = list(state.prompt_logprobs or [])
            state.prompt_logprobs_sent = True
            batch.num_prompt_logprobs[row] = -1
