"""What flows between the scheduler and the model runner, each step.

Mirrors vLLM's `vllm/v1/core/sched/output.py` (`SchedulerOutput`, `NewRequestData`,
`CachedRequestData`), `vllm/v1/outputs.py` (`ModelRunnerOutput`) and `EngineCoreOutput`
(`vllm/v1/engine/__init__.py`).

Why "new" vs "cached" requests: the model runner keeps a persistent batch (token ids, block
tables) across steps, so it is sent a request's full data ONCE, when it is first scheduled
(`NewRequestData`), and afterwards only the delta: the blocks appended this step and the
updated `num_computed_tokens` (`CachedRequestData`). A request resumed after preemption is
"cached" with `resumed_from_preemption=True`: its block table is REPLACED by `new_block_ids`
(all of its blocks) and its tokens are resent in `resumed_token_ids`, because the runner
dropped it from the persistent batch when it was preempted.

Order of work in the model runner for one step: `blocks_to_swap_out` (device -> CPU) first,
then `blocks_to_swap_in` (CPU -> device), then `blocks_to_copy` (copy-on-write), then the
forward pass. The order matters: a device block freed by a swap-out can be handed to another
request in the same step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.request import FinishReason, Request


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]            # every block the request owns, prefix-cache hits first
    num_computed_tokens: int        # tokens whose KV is already there (prefix hit / remote KV)
    sampling_params: Any = None     # opaque to the scheduler; the engine's own object
    lora_request: Any = None        # the request's adapter (chapter 09), or None: the base model

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> "NewRequestData":
        return cls(request.request_id, list(request.prompt_token_ids), block_ids,
                   request.num_computed_tokens, request.sampling_params, request.lora_request)


@dataclass
class CachedRequestData:
    """Column-wise, like vLLM (one list per field, one entry per request): cheap to build
    for a thousand running requests."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)    # appended, or ALL when resumed
    num_computed_tokens: list[int] = field(default_factory=list)
    # Only for resumed requests: prompt + output so far (the runner forgot them at preemption).
    resumed_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Only with pipeline micro-batches (chapter 07): the tokens sampled since the request was last
    # scheduled, for the stages that do not sample (vLLM: new_token_ids, "used in PP only").
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # {request_id: Δ}. Δ counts the request's spec drafts too (see scheduled_spec_decode_tokens).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Finished since the previous step: the runner drops their persistent state.
    finished_req_ids: set[str] = field(default_factory=set)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)       # (src, dst) device blocks
    kv_connector_metadata: Any = None   # what the KV connector's worker side must do this step (chapter 06)
    # Structured output (chapters 07/08): the allowed tokens of this step's constrained requests,
    # computed by the engine core while the forward runs; the runner masks the logits with it.
    grammar_output: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What the model runner returns: for each scheduled request, the tokens it sampled.

    A request whose scheduled tokens did not reach the end of its sequence (a prefill chunk)
    gets an empty list. With speculative decoding a request may get up to 1 + #drafts tokens
    (the accepted drafts plus one token from the target model)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> why the runner could not run it (a per-request fault): the scheduler finishes it
    # with FINISHED_ERROR and the message, frees its blocks without caching them, and goes on.
    failed: dict[str, str] = field(default_factory=dict)
    # KV connector: requests whose remote KV finished loading this step (WAITING_FOR_REMOTE_KVS),
    # and finished requests whose K/V finished sending (their blocks can be freed now).
    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    # KV connector: blocks whose asynchronous load FAILED (vLLM: KVConnectorOutput.invalid_block_ids).
    # Their request is never reported in finished_recving; the scheduler recomputes from the
    # first invalid block (kv_load_failure_policy "recompute") or fails the request ("fail").
    invalid_block_ids: set[int] = field(default_factory=set)
    # KV connector: the ranks' whole report for the step (chapter 06's KVConnectorOutput, aggregated),
    # for the connector's scheduler half (`update_connector_output`); None without a connector.
    kv_connector_output: Any = None
    req_id_to_index: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.req_ids) != len(self.sampled_token_ids):
            raise ValueError(f"{len(self.req_ids)} req_ids but {len(self.sampled_token_ids)} sampled token lists")
        self.req_id_to_index = {req_id: i for i, req_id in enumerate(self.req_ids)}


@dataclass
class EngineCoreOutput:
    """Per request and step, what the engine forwards to the detokenizer / user."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None     # the stop token id, or why the request was ignored
    num_cached_tokens: int = 0               # prefix-cache hit length (for stats)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
