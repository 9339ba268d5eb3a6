"""Pipeline parallelism, the model runner's side: only the last stage samples; the others learn the tokens.

Mirrors what vLLM v1's `GPUModelRunner` does for pipeline parallelism (`get_pp_group().is_last_rank`:
only the last stage computes logits and samples; `_update_states` appends
`CachedRequestData.new_token_ids` on the other ranks, "used in PP only"). The scheduler sends each
running request's tokens sampled since it was last scheduled (async_scheduler.py), so no stage waits
for the last one's logits: with micro-batches (EngineConfig.max_concurrent_batches > 1) stage 0 runs
batch B while stage 1 runs batch A.
"""
from __future__ import annotations

from model_executor.parallel_state import get_pp_group
from scheduler import SchedulerOutput


class PipelineStageMixin:
    """For ModelRunner: `self.samples` (does this stage sample?) and the new tokens of a stage that does not."""

    def _init_pipeline_stage(self) -> None:
        self.samples = get_pp_group().is_last_rank

    def _apply_new_token_ids(self, so: SchedulerOutput) -> None:
        """A stage that does not sample appends the tokens the last stage sampled for a request since
        it was last scheduled; the last stage, which appended them when it sampled, checks that the
        scheduler agrees (a mismatch fails the step, never goes unseen)."""
        batch = self.input_batch
        for req_id, tokens in so.scheduled_cached_reqs.new_token_ids.items():
            state = self.requests.get(req_id)
            if state is None or not tokens:
                continue
            if self.samples:
                if state.output_token_ids[-len(tokens):] != list(tokens):
                    raise RuntimeError(f"request {req_id}: the scheduler's new tokens {tokens} are not the ones "
                                       f"sampled ({state.output_token_ids[-len(tokens):]})")
                continue
            state.output_token_ids.extend(tokens)
            row = batch.req_id_to_index.get(req_id)
            if row is not None:                          # still has its row: append there too
                for token in tokens:
                    batch.append_token(row, token)
