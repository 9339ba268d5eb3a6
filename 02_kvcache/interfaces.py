"""The small types the KV cache manager exchanges with its callers (the scheduler, tests,
benchmarks): what it reads from a request, what it returns, and its errors.

kvcache never imports the scheduler: a request is anything with the attributes of
`KVCacheRequest` (chapter 03's `Request` is one; `SimpleRequest` is the one chapter 02's
own tests, notebook and hit-rate simulations drive the manager with).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

from kvcache.block import KVCacheBlock


@runtime_checkable
class KVCacheRequest(Protocol):
    """What KVCacheManager reads from a request.

    `all_token_ids` / `num_tokens` are prompt + verified output: they must NOT include
    unverified speculative draft tokens (vLLM keeps those apart: `num_tokens` vs
    `num_tokens_with_spec`), or blocks holding rejected drafts would be cached.
    Optional, read with getattr: `cache_salt: str | None`, `lora_request` (its `lora_name` and
    `lora_path`, chapter 09) or a bare `lora_int_id: int | None`,
    `skip_reading_prefix_cache: bool` (True: every token must be computed — e.g. a request that
    wants the logprobs of its prompt — though what it computes is still cached for others).
    """
    request_id: str
    all_token_ids: Sequence[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...


@dataclass
class SimpleRequest:
    """A minimal request: enough state for the manager, nothing a scheduler would add."""
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_int_id: int | None = None
    skip_reading_prefix_cache: bool = False

    def __post_init__(self):
        self.all_token_ids = list(self.all_token_ids)
        if not self.all_token_ids:
            raise ValueError(f"request {self.request_id!r} has no tokens")
        if not 0 <= self.num_computed_tokens <= len(self.all_token_ids):
            raise ValueError(f"num_computed_tokens={self.num_computed_tokens} outside [0, {len(self.all_token_ids)}]")

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        self.all_token_ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)


@dataclass
class KVCacheBlocks:
    """A list of blocks handed to the scheduler (vLLM: `vllm/v1/core/kv_cache_manager.py`)."""
    blocks: list[KVCacheBlock] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blocks)

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @classmethod
    def create_empty(cls) -> KVCacheBlocks:
        return cls([])


class RequestTooLargeError(ValueError):
    """The request needs more blocks than the whole pool has: it can never be scheduled.
    Raised (never returned as None) so a scheduler reports it instead of retrying forever."""
