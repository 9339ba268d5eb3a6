"""Parallel sampling (`SamplingParams.n > 1`): one request to the user, n ordinary requests to the engine.

Mirrors vLLM v1's `vllm/v1/engine/parallel_sampling.py: ParentRequest` (`get_child_info`,
`get_outputs`) and how `llm_engine.py` / `async_llm.py` fan a request out.

Why in the front end: n samples of one prompt differ only after the prompt. vLLM v0 forked one
sequence into n inside the scheduler and the model runner (copy-on-write blocks, chapter 02's
`BlockSpaceManager.fork`); every layer then had to know about families of sequences. vLLM v1
sends n independent requests instead — child i is request "{i}_{id}" with `n = 1` and
`seed + i` — and lets the prefix cache share the prompt: the first child computes it, the
others wait one step (chapter 02's `num_pending_tokens`) and hit its full blocks; each child then
computes only the prompt's partly filled last block itself. The scheduler, the model runner and
the KV connector see ordinary requests, so n > 1 composes with everything they do.

What it costs against copy-on-write: up to block_size - 1 prompt tokens computed once per child
instead of once, and one partial block each (a fork shares it until the first write, then copies
it). Measured: `python -m benchmarks.bench_parallel_sampling_memory`.
"""
from __future__ import annotations

import copy

from mini_vllm.outputs import CompletionOutput
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    """vLLM v1's name of the index-th child of request `parent_id`."""
    return f"{index}_{parent_id}"


class ParentRequest:
    """An n > 1 request in the front end: its children's ids and parameters, and their latest
    completions, gathered into one RequestOutput of n completions (`outputs[i]` is child i)."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.completions: dict[int, CompletionOutput] = {}
        self.finished: set[int] = set()

    @property
    def child_ids(self) -> list[str]:
        return [child_request_id(self.request_id, i) for i in range(self.n)]

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """Child `index`'s id and parameters: one sample each, and a seeded request's children
        seeded seed + index (so child i draws what a request with seed + i draws)."""
        params = copy.copy(self.params)
        params.n = 1
        if params.seed is not None:
            params.seed += index
        return child_request_id(self.request_id, index), params

    def get_outputs(self, completion: CompletionOutput) -> tuple[list[CompletionOutput] | None, bool]:
        """One child's completion (its `index` is the child's) -> (the completions the parent's
        RequestOutput carries now, or None when it has nothing to say yet; whether every child has
        finished). CUMULATIVE: every child's latest; DELTA: this child's news; FINAL_ONLY: all n,
        once the last child finishes."""
        self.completions[completion.index] = completion
        if completion.finish_reason is not None:
            self.finished.add(completion.index)
        finished = len(self.finished) == self.n
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None, False
        if kind == RequestOutputKind.DELTA:
            return [completion], finished
        return [self.completions[i] for i in sorted(self.completions)], finished
