"""A minimal speculative-decoding driver: one target model, one proposer, no scheduler.

For tests and the notebook only — chapter 07's engine does the same through this chapter's
`SpecDecodeScheduler` (scheduler.py: drafts become `Request.spec_token_ids`, see the README).
What it shows in ~100 lines is the whole cycle and its two counters per request:

    prefill    target forward over the prompt           num_computed = len(prompt)
               sample the first token                    tokens += [t]
    each step  propose k drafts (proposer)
               target forward over [last token, d_1..d_k]  (k + 1 scheduled tokens)
               verify: RejectionSampler(SpecDecodeMetadata, q, target logits, bonus)
               tokens += accepted + 1 token; num_computed = len(tokens) - 1
               (the K/V of rejected drafts stays in its slots, unread, overwritten next step)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvcache import KVCacheManager
from paged_attention.block_table import build_attention_metadata
from spec_decode.draft_model import PagedRequestState
from spec_decode.metadata import SpecDecodeMetadata
from spec_decode.metrics import SpecDecodingStats
from spec_decode.proposer import DraftRequest
from spec_decode.rejection_sampler import RejectionSampler
from spec_decode.sampling import SpecSamplingMetadata, compute_probs


@dataclass
class StepTrace:
    req_id: str
    drafts: list[int]
    emitted: list[int]          # accepted drafts + the recovered or bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1


@dataclass
class LoopResult:
    outputs: list[list[int]]
    stats: SpecDecodingStats
    trace: list[StepTrace] = field(default_factory=list)
    num_target_passes: int = 0


class SpeculativeLoop:
    def __init__(self, target: Any, kv_caches: list, proposer: Any, *, num_blocks: int, block_size: int,
                 backend: str = "torch", seed: int = 0):
        self.target, self.kv_caches, self.proposer = target, kv_caches, proposer
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)
        self.sampler = RejectionSampler(backend, generator=self.generator)

    def _forward(self, states: list[PagedRequestState], new_tokens: list[list[int]]):
        num_new = [len(t) for t in new_tokens]
        for s, n in zip(states, num_new):
            if self.kv.allocate_slots(s, n) is None:
                raise RuntimeError("the target's KV cache is full: give SpeculativeLoop more blocks")
        md = build_attention_metadata([self.kv.get_block_ids(s.request_id) for s in states],
                                      [s.num_computed_tokens for s in states], num_new, self.block_size)
        positions = torch.cat([s.num_computed_tokens + torch.arange(n) for s, n in zip(states, num_new)])
        with torch.no_grad():
            hidden = self.target.forward(torch.tensor([t for ts in new_tokens for t in ts]), positions,
                                         self.kv_caches, md)
            logits = self.target.compute_logits(hidden)
        return hidden, logits, md.query_start_loc.tolist()

    def _sample(self, logits: torch.Tensor, sm: SpecSamplingMetadata) -> torch.Tensor:   # [N] one per request
        probs = compute_probs(logits, [1] * logits.shape[0], sm)
        e = torch.empty_like(probs).exponential_(generator=self.generator).clamp_(min=torch.finfo(torch.float32).tiny)
        return torch.where(sm.temperature == 0, logits.argmax(-1), (probs / e).argmax(-1))

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None) -> LoopResult:
        k = self.proposer.num_speculative_tokens
        n = len(prompts)
        ids = [f"req-{i}" for i in range(n)]
        states = [PagedRequestState(r, list(p), 0) for r, p in zip(ids, prompts)]
        sm = SpecSamplingMetadata.from_lists([temperature] * n, top_k=None if top_k is None else [top_k] * n)
        stats, trace = SpecDecodingStats.new(k), []
        # Prefill every prompt in one pass; the target's hidden states feed an EAGLE proposer.
        hidden, logits, qsl = self._forward(states, [list(p) for p in prompts])
        first = self._sample(logits[[e - 1 for e in qsl[1:]]], sm)
        features = {r: (hidden[qsl[i]:qsl[i + 1]], 0) for i, r in enumerate(ids)}
        outputs = [[int(t)] for t in first]
        for s, out in zip(states, outputs):
            s.num_computed_tokens = len(s.all_token_ids)
            s.all_token_ids.append(out[0])
        passes = 1
        while True:
            live = [i for i in range(n) if len(outputs[i]) < max_tokens]
            if not live:
                break
            reqs = [DraftRequest(ids[i], states[i].all_token_ids, *features[ids[i]]) for i in live]
            if hasattr(self.proposer, "propose_with_probs"):
                drafts, q = self.proposer.propose_with_probs(reqs)
            else:
                drafts, q = self.proposer.propose(reqs), None
            # Never draft past max_tokens: the last token of the step is the target's own.
            drafts = [d[:max_tokens - len(outputs[i]) - 1] for d, i in zip(drafts, live)]
            hidden, logits, qsl = self._forward([states[i] for i in live],
                                                [[states[i].all_token_ids[-1]] + d for d, i in zip(drafts, live)])
            passes += 1
            md = SpecDecodeMetadata.from_draft_token_ids(drafts)
            step_sm = SpecSamplingMetadata(sm.temperature[live], None if sm.top_k is None else sm.top_k[live])
            bonus = self._sample(logits[md.logits_indices.long()][md.bonus_logits_indices.long()], step_sm)
            target_logits = logits[md.logits_indices.long()][md.target_logits_indices.long()]
            draft_probs = None if q is None else torch.cat([p[:len(d)] for p, d in zip(q, drafts)])
            out = self.sampler(md, draft_probs, target_logits, bonus, step_sm)
            for j, (i, d, emitted) in enumerate(zip(live, drafts, RejectionSampler.parse_output(out, logits.shape[-1]))):
                s = states[i]
                m = len(s.all_token_ids)
                stats.observe_draft(len(d), len(emitted) - 1)
                trace.append(StepTrace(ids[i], d, emitted))
                emitted = emitted[:max_tokens - len(outputs[i])]
                outputs[i] += emitted
                s.all_token_ids += emitted
                s.num_computed_tokens = len(s.all_token_ids) - 1
                # Target features of the positions whose K/V is now verified: m-1 .. m-1+accepted.
                features[ids[i]] = (hidden[qsl[j]:qsl[j] + len(emitted)], m - 1)
        for s in states:
            self.kv.free(s)
        self.proposer.remove_requests(ids)
        return LoopResult(outputs, stats, trace, passes)
