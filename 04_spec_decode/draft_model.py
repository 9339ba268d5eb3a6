"""Model drafters: a separate small model, or the target's own first layers (LayerSkip).

Mirrors vLLM's `vllm/v1/spec_decode/draft_model.py` (a draft model with its own forward
passes and KV cache) and the self-speculative idea of LayerSkip [Elhoushi 2024]:
exit after the first N layers, reuse the target's final norm and LM head.

The model is injected; the proposer only needs the engine's model protocol

    model.forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, H]
    model.compute_logits(hidden [N, H]) -> logits [N, V] fp32

so any of chapter 07's models (or `LayerSkipDraftModel` around one) plugs in unchanged.

The draft keeps its OWN paged KV cache, managed by chapter 02's `KVCacheManager` over its
own blocks — and its own two counters per request, exactly like the target's ([Kwon 2025,
Table 4.1]): `num_computed` (draft K/V present) and the request's verified tokens. Each
`propose` call:

  1. rolls back: the draft cached K/V for its previous drafts d_1..d_{k-1}; the ones the
     target rejected are not in the sequence. num_computed = the length of the common
     prefix of what the draft computed and the verified tokens (slots past it are simply
     overwritten later — never freed one by one, as the target's rejected slots);
  2. catches up: ONE batched forward over every request's not-yet-computed verified tokens
     (the accepted drafts' K/V is already there; usually just the new token) -> d_1;
  3. drafts: k - 1 more batched forwards of one token per request -> d_2 .. d_k.

Drafts are greedy by default (q one-hot: pass draft_probs=None to the rejection sampler);
with temperature > 0 they are sampled and `propose_with_probs` also returns q.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvcache import KVCacheManager, RequestTooLargeError
from paged_attention.block_table import build_attention_metadata
from spec_decode.proposer import (DraftRequest, check_num_speculative_tokens, check_same_vocabulary,
                                  draft_budget, validate_draft_token_ids)


@dataclass
class PagedRequestState:
    """A drafter's view of a request, as chapter 02's manager reads it (KVCacheRequest): the tokens
    whose K/V the drafter computed (its own drafts included) and how many of them are valid."""
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)    # tokens whose K/V the draft computed (drafts too)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    """Args:
        model: the draft model (protocol above); `kv_caches`: its per-layer (key, value) caches
            [num_blocks, block_size, kv_heads, head_dim] — blocks handed out by `kv_cache_manager`
            (a chapter 02 KVCacheManager with enable_caching=False: drafts are never prefix-cached).
        target_vocab_size / draft_vocab_size: must agree (and the tokenizers, if given).
        temperature: 0 = greedy drafts (q one-hot); > 0 sample from softmax(logits / T).
        max_model_len: drafts never go past it.
        metadata_builder: builds the draft's attention metadata from (block_ids, num_computed,
            num_new, block_size, device=...); chapter 01's build_attention_metadata by default,
            an engine may pass its own (extra fields its attention backend needs).
    """

    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 kv_cache_manager: KVCacheManager, num_speculative_tokens: int, target_vocab_size: int,
                 draft_vocab_size: int | None = None, *, target_tokenizer=None, draft_tokenizer=None,
                 temperature: float = 0.0, max_model_len: int | None = None,
                 generator: torch.Generator | None = None,
                 metadata_builder: Callable[..., Any] = build_attention_metadata):
        self.num_speculative_tokens = check_num_speculative_tokens(num_speculative_tokens)
        draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else getattr(model, "vocab_size", None)
        if draft_vocab_size is None:
            raise ValueError("the draft model's vocabulary size is unknown: pass draft_vocab_size=")
        check_same_vocabulary(target_vocab_size, draft_vocab_size, target_tokenizer, draft_tokenizer)
        if kv_cache_manager.enable_caching:
            raise ValueError("the draft's KVCacheManager must have enable_caching=False: draft K/V of unverified "
                             "tokens must never be found as a prefix-cache hit")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.model = model
        self.kv_caches = kv_caches
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.vocab_size = target_vocab_size
        self.temperature = temperature
        self.max_model_len = max_model_len
        self.generator = generator
        self.metadata_builder = metadata_builder
        self.requests: dict[str, PagedRequestState] = {}

    # ------------------------------------------------------------------ bookkeeping
    def _rollback(self, state: PagedRequestState, tokens: list[int]) -> None:
        """num_computed = common prefix of what the draft computed and the verified tokens,
        minus one if that would leave nothing to compute (the last token's logits are needed)."""
        n = min(state.num_computed_tokens, len(tokens) - 1)
        cached = state.all_token_ids
        while n > 0 and cached[n - 1] != tokens[n - 1]:
            n -= 1
        state.num_computed_tokens = n
        state.all_token_ids = list(tokens)

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            state = self.requests.pop(rid, None)
            if state is not None and rid in self.kv.req_to_blocks:
                self.kv.free(state)

    # ------------------------------------------------------------------ drafting
    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:   # [N], [N, V] | None
        if self.temperature == 0:
            return logits.argmax(-1), None
        probs = torch.softmax(logits / self.temperature, dim=-1)
        e = torch.empty_like(probs).exponential_(generator=self.generator).clamp_(min=torch.finfo(probs.dtype).tiny)
        return (probs / e).argmax(-1), probs

    def _forward(self, states: list[PagedRequestState], new_tokens: list[list[int]]) -> torch.Tensor:
        """One batched draft forward over each request's new tokens; logits at each request's last."""
        block_ids = [self.kv.get_block_ids(s.request_id) for s in states]
        num_new = [len(t) for t in new_tokens]
        device = self.kv_caches[0][0].device
        md = self.metadata_builder(block_ids, [s.num_computed_tokens for s in states], num_new, self.block_size,
                                   device=device)
        positions = torch.cat([s.num_computed_tokens + torch.arange(n) for s, n in zip(states, num_new)])
        input_ids = torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.long)
        with torch.no_grad():
            hidden = self.model.forward(input_ids.to(device), positions.to(device), self.kv_caches, md)
            last = md.query_start_loc[1:].long() - 1
            logits = self.model.compute_logits(hidden[last])
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"the draft model returned logits over {logits.shape[-1]} tokens; the target has "
                             f"{self.vocab_size}")
        for s, n in zip(states, num_new):
            s.num_computed_tokens += n
        return logits

    def propose_with_probs(self, requests: Sequence[DraftRequest]) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        k = self.num_speculative_tokens
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active: list[int] = []
        budget: dict[int, int] = {}
        ### BEGIN SOLUTION
        for i, r in enumerate(requests):
            tokens = [int(t) for t in r.token_ids]
            n = draft_budget(r, k, self.max_model_len)
            if n <= 0 or not tokens:
                continue
            state = self.requests.setdefault(r.req_id, PagedRequestState(r.req_id))
            self._rollback(state, tokens)
            # Slots for the catch-up tokens and the n - 1 drafts whose K/V we will write.
            try:
                blocks = self.kv.allocate_slots(state, len(tokens) - state.num_computed_tokens + n - 1)
            except RequestTooLargeError:
                blocks = None
            if blocks is None:
                continue                       # the draft cache is full: no drafts this step
            active.append(i)
            budget[i] = n
        if not active:
            return drafts, None if self.temperature == 0 else [torch.zeros(0, self.vocab_size) for _ in requests]
        states = [self.requests[requests[i].req_id] for i in active]
        new = [list(states[j].all_token_ids[states[j].num_computed_tokens:]) for j in range(len(active))]
        logits = self._forward(states, new)                          # catch up -> d_1
        for step in range(k):
            tok, q = self._sample(logits)
            for j, i in enumerate(active):
                if step < budget[i]:
                    drafts[i].append(int(tok[j]))
                    if q is not None:
                        probs[i].append(q[j])
            still = [j for j, i in enumerate(active) if step + 1 < budget[i]]
            if not still:
                break
            active = [active[j] for j in still]
            states = [states[j] for j in still]
            for s, j in zip(states, still):
                s.all_token_ids.append(int(tok[j]))
            logits = self._forward(states, [[int(tok[j])] for j in still])   # d_{step+2}
        ### END SOLUTION
        drafts = validate_draft_token_ids(drafts, self.vocab_size, k, "draft model")
        if self.temperature == 0:
            return drafts, None
        return drafts, [torch.stack(p) if p else torch.zeros(0, self.vocab_size) for p in probs]

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return self.propose_with_probs(requests)[0]


class LayerSkipDraftModel:
    """The target's first `num_layers` layers + its final norm + its LM head, as a draft model
    (self-speculation: no second checkpoint, no training; the drafts are the target's own
    early-exit guesses). Works on any model with the engine's Llama layout:
    model.model.{embed_tokens, layers, norm, rotary_emb.cos_sin} and model.compute_logits,
    layer(hidden, residual, rope, kv_cache, attn_metadata) -> (hidden, residual).

    It shares the target's WEIGHTS but keeps its own KV cache (num_layers layers): the
    target's cache for those layers would hold the same values for verified tokens — an
    optimisation (LayerSkip's KV reuse) the engine may add later.
    """

    def __init__(self, target: Any, num_layers: int):
        layers = target.model.layers
        if not 1 <= num_layers < len(layers):
            raise ValueError(f"num_layers must be in [1, {len(layers) - 1}] (fewer than the target's "
                             f"{len(layers)} layers), got {num_layers}")
        self.target = target
        self.num_layers = num_layers
        self.vocab_size = getattr(target, "vocab_size", None) or target.config.vocab_size

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"a {self.num_layers}-layer self-draft needs {self.num_layers} KV caches, got {len(kv_caches)}")
        m = self.target.model
        hidden = m.embed_tokens(input_ids)
        rope = m.rotary_emb.cos_sin(positions)
        residual = None
        for layer, kv_cache in zip(m.layers[:self.num_layers], kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        hidden, _ = m.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)
