"""SpecDecodeWorker: the model runner's speculative-decoding half (chapter 04 in the engine).

Mirrors what vLLM v1 spreads over `vllm/v1/worker/gpu_model_runner.py` (`_calc_spec_decode_metadata`,
the rejection sampler call in `_sample`, `propose_draft_token_ids`, `take_draft_token_ids`) and
`vllm/v1/spec_decode/` (the proposers, `metrics.py`). The runner keeps the step's structure;
this object owns everything that exists only because of drafts:

    construction    the drafter from `speculative_config` (n-gram, a draft checkpoint, the
                    target's own first layers, an EAGLE head), checked against the target
                    (vocabulary, tokenizer, hidden size) — bad input fails inside LLM(...)
    metadata        where each request's drafts sit in the flat batch and which logits rows
                    verify them (spec_decode.calc_spec_decode_metadata)
    verify          the rejection sampler over the target logits at the draft positions, with
                    the bonus tokens the engine's own Sampler drew (chapter 04)
    propose         after sampling: one DraftRequest per request that just emitted tokens
                    (EAGLE: plus the target's hidden states of the positions verified since
                    the last call), capped per request by the adaptive draft length and by
                    max_tokens; off above `disable_by_batch_size` running requests. A drafter
                    that raises or proposes ids outside the vocabulary costs only its own
                    request its drafts (the batch is retried one request at a time).
    stats           SpecDecodingStats (acceptance rate, mean acceptance length, per position),
                    drafting and verification time — per step (for RequestOutput metrics) and
                    for the engine's lifetime

The drafts reach the scheduler through `take_draft_token_ids()` -> `Scheduler.update_draft_token_ids`
(EngineCore.step, after update_from_output), so the NEXT step schedules them as Δ = 1 + k tokens.
Every drafter keeps its own paged KV (its own chapter 02 KVCacheManager, caching off), sized
like the target's pool in blocks: draft K/V is never a prefix-cache hit.
"""
from __future__ import annotations

import dataclasses

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kvcache import KVCacheManager
from kvcache.cache_engine import KVCacheSpec
from model_executor.parallel_state import (get_tensor_model_parallel_world_size, whole_model_on_this_rank,
                                                  whole_model_on_this_stage)
from spec_decode import (DraftModelProposer, DraftRequest, EagleHead, EagleProposer, LayerSkipDraftModel,
                         NgramProposer, RejectionSampler, SpecDecodeMetadata, SpecDecodingStats,
                         calc_spec_decode_metadata, check_same_vocabulary, validate_draft_token_ids)
from spec_decode.adaptive import AdaptiveDraftLength
from spec_decode.eagle_tree import DraftTree, EagleTreeProposer
from spec_decode.sampling import (SpecSamplingMetadata, compute_probs, generate_inv_exponential,
                                  generate_uniform_probs)
from spec_decode.tree import verify_tree_greedy, verify_tree_random

from mini_vllm.config import ModelConfig
from mini_vllm.sampling_params import _SAMPLING_EPS
from mini_vllm.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

# The EAGLE head trained for SmolLM2-135M-Instruct (python -m spec_decode.train_eagle), used when
# speculative_config has method "eagle" and no "model".
DEFAULT_EAGLE_HEAD = Path(__import__("spec_decode").__file__).parent / "eagle_smollm2"


@dataclass
class SpecDecodeStepStats:
    """What one step's speculation did (ModelRunnerOutput -> EngineCoreStep -> RequestMetrics)."""
    num_spec_tokens: int                                   # k
    # req_id -> (drafts verified this step, drafts accepted); only requests that had drafts
    num_draft_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    drafted_req_ids: list[str] = field(default_factory=list)   # requests that got drafts for the next step
    verification_time: float = 0.0                        # s: forward + sampling + rejection of a step with drafts
    drafting_time: float = 0.0                             # s: the proposer's call after sampling
    disabled: bool = False                                 # disable_by_batch_size turned drafting off
    num_drafter_faults: int = 0                            # requests that lost their drafts to a drafter error


@dataclass
class SpecDecodeEngineStats:
    """The engine's lifetime totals (EngineCore.spec_decoding_stats)."""
    stats: SpecDecodingStats
    num_steps: int = 0                  # steps that ran the model
    num_verification_steps: int = 0     # ... of which verified at least one draft
    num_disabled_steps: int = 0         # steps where disable_by_batch_size turned drafting off
    num_drafter_faults: int = 0         # requests that lost their drafts to a drafter error
    verification_time: float = 0.0
    drafting_time: float = 0.0

    def observe_step(self, step: SpecDecodeStepStats) -> None:
        self.num_steps += 1
        self.num_verification_steps += bool(step.num_draft_tokens)
        self.num_disabled_steps += step.disabled
        self.num_drafter_faults += step.num_drafter_faults
        for num_draft, num_accepted in step.num_draft_tokens.values():
            self.stats.observe_draft(num_draft, num_accepted)
        self.verification_time += step.verification_time
        self.drafting_time += step.drafting_time

    def __str__(self) -> str:
        return (f"{self.stats}; {self.num_verification_steps}/{self.num_steps} steps verified drafts, drafting "
                f"{self.drafting_time:.3f} s, verification steps {self.verification_time:.3f} s")


class _HiddenBuffer:
    """The target's hidden states of one request's consecutive positions [start, end), waiting
    for the EAGLE head (it consumes them when the request is next proposed for)."""

    def __init__(self, start: int):
        self.start = start
        self.chunks: list[torch.Tensor] = []
        self.length = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def tensor(self) -> torch.Tensor:
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]

    def put(self, position: int, rows: torch.Tensor) -> "_HiddenBuffer":
        """Rows for positions [position, position + len(rows)). Positions computed again (after
        a recompute preemption) replace what was there; a gap starts the buffer over."""
        if not self.length or position < self.start or position > self.end:
            buf = _HiddenBuffer(position)
        else:
            buf = self
            if position < self.end:
                buf.chunks, buf.length = [self.tensor()[:position - self.start]], position - self.start
        buf.chunks.append(rows.clone())          # the step's hidden states are freed with the step
        buf.length += rows.shape[0]
        return buf

    def drop_before(self, position: int) -> None:
        if position <= self.start:
            return
        keep = self.tensor()[min(position, self.end) - self.start:]
        self.start, self.chunks, self.length = min(position, self.end), [keep], keep.shape[0]


class SpecDecodeWorker:
    def __init__(self, config: SpeculativeConfig, model_config: ModelConfig, target_model, *, device: torch.device,
                 block_size: int, attn_backend: str, cpu_gemm_backend: str, generator: torch.Generator | None,
                 tokenizer_path: str | Path | None = None, cpu_layer_ops: str = "torch",
                 cuda_layer_ops: str = "torch"):
        self.config = config
        self.k = config.num_speculative_tokens
        self.method = config.method
        self.model_config = model_config
        self.target = target_model
        self.device = device
        self.block_size = block_size
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len
        backend = config.rejection_sampler
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        self.rejection_sampler = RejectionSampler(backend, generator=generator)
        # A tree's shape already follows the head's confidence (EAGLE-2): no second, per-request rule.
        self.adaptive = (AdaptiveDraftLength(self.k, config.min_draft_acceptance)
                         if config.adaptive and not config.uses_tree else None)
        self.needs_hidden_states = self.method == "eagle"
        # Loaded and checked now (inside LLM(...)); the proposer itself is built once the KV
        # pool's size is known (initialize_kv_cache).
        self._draft_model = None           # the model a DraftModelProposer drives
        self._draft_kv_spec: KVCacheSpec | None = None
        self._eagle_head: EagleHead | None = None
        self._draft_tokenizers = None
        self._load_drafter(model_config, attn_backend, cpu_gemm_backend, cpu_layer_ops, cuda_layer_ops, tokenizer_path)
        self.proposer = None
        if self.method == "ngram":
            self.proposer = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max,
                                          max_model_len=self.max_model_len)
        self.draft_kv_cache_manager: KVCacheManager | None = None
        self._hidden: dict[str, _HiddenBuffer] = {}
        self._draft_token_ids: dict[str, list[int]] = {}
        self._trees: dict[str, DraftTree] = {}             # EAGLE-2: the tree behind a request's drafts
        self.step_stats = SpecDecodeStepStats(self.k)
        self._spec_sampling: tuple[object, SpecSamplingMetadata] | None = None

    # ================================================================== construction
    def _load_drafter(self, mc: ModelConfig, attn_backend: str, cpu_gemm_backend: str, cpu_layer_ops: str,
                      cuda_layer_ops: str, tokenizer_path) -> None:
        """Load what the drafter needs and check it fits the target (clear errors, before any request)."""
        cfg = self.config
        # Tensor parallel: a draft model (or the target's own layers) is sharded like the target, its
        # K/V heads too; an EAGLE head is small and whole on every rank.
        tp = get_tensor_model_parallel_world_size()
        if self.method == "draft_model":
            from mini_vllm.models.loader import get_model
            try:
                draft_config = ModelConfig.from_pretrained(cfg.model, dtype=mc.dtype, max_model_len=mc.max_model_len)
            except ValueError as error:
                raise ValueError(f"speculative_config: the draft model {cfg.model} cannot serve this engine: "
                                 f"{error}") from error
            self._check_draft_tokenizer(draft_config, tokenizer_path or mc.model)
            with whole_model_on_this_stage():      # pipeline parallel: whole, beside the last stage
                self._draft_model = get_model(draft_config, device=self.device, attn_backend=attn_backend,
                                              cpu_gemm_backend=cpu_gemm_backend, cpu_layer_ops=cpu_layer_ops,
                                              cuda_layer_ops=cuda_layer_ops)
            self._draft_kv_spec = KVCacheSpec(draft_config.num_hidden_layers, self.block_size,
                                              max(1, draft_config.num_key_value_heads // tp), draft_config.head_dim,
                                              draft_config.dtype)
        elif self.method == "layer_skip":
            num_target_layers = len(self.target.model.layers)
            n = cfg.num_layers if cfg.num_layers is not None else max(1, num_target_layers // 4)
            if n >= num_target_layers:
                raise ValueError(f"speculative_config: layer_skip num_layers={n} must be fewer than the target's "
                                 f"{num_target_layers} layers")
            self._draft_model = LayerSkipDraftModel(self.target, n)
            # the target's own layers: their cache is the target's kind (an 8-bit one included)
            self._draft_kv_spec = dataclasses.replace(mc.kv_cache_spec(self.block_size), num_layers=n,
                                                      num_kv_heads=max(1, mc.num_key_value_heads // tp))
        elif self.method == "eagle":
            path = Path(cfg.model) if cfg.model is not None else DEFAULT_EAGLE_HEAD
            with whole_model_on_this_rank():
                head = EagleHead.from_pretrained(path, dtype=mc.dtype)
            if head.config.hidden_size != mc.hidden_size:
                raise ValueError(f"speculative_config: the EAGLE head in {path} was trained for hidden size "
                                 f"{head.config.hidden_size}; this model's is {mc.hidden_size}")
            if head.config.vocab_size != mc.vocab_size:
                raise ValueError(f"speculative_config: the EAGLE head in {path} is for a {head.config.vocab_size}-"
                                 f"token vocabulary; this model has {mc.vocab_size}")
            self._eagle_head = head.to(self.device).eval()
            c = head.config
            self._draft_kv_spec = KVCacheSpec(1, self.block_size, c.num_key_value_heads, c.head_dim, mc.dtype)

    def _check_draft_tokenizer(self, draft_config: ModelConfig, target_tokenizer_path) -> None:
        """A draft model must speak the target's tokens: same vocabulary size and, when both have
        a tokenizer, the same token -> id map and special tokens (spec_decode.check_same_vocabulary)."""
        from transformers import AutoTokenizer

        def load(path):
            try:
                return AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError):
                return None
        target_tok, draft_tok = load(target_tokenizer_path), load(draft_config.model)
        try:
            check_same_vocabulary(self.vocab_size, draft_config.vocab_size, target_tok, draft_tok)
        except ValueError as error:
            raise ValueError(f"speculative_config: draft model {draft_config.model}: {error}") from error

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The drafter's own paged KV: as many blocks as the target's pool (of its own, smaller,
        layer count), handed out by its own chapter 02 manager with caching off."""
        if self._draft_kv_spec is None:
            return
        self.draft_kv_cache_manager = KVCacheManager(num_blocks, self.block_size, enable_caching=False)
        keys, values = self._draft_kv_spec.allocate(num_blocks, self.device)
        if self.method == "eagle":
            args = (self._eagle_head, self.target.model.embed_tokens, self.target.compute_logits, (keys[0], values[0]),
                    self.draft_kv_cache_manager, self.k, self.model_config.hidden_size, self.vocab_size,
                    self.max_model_len)
            self.proposer = (EagleTreeProposer(*args, tree_depth=self.config.tree_depth,
                                               tree_top_k=self.config.tree_top_k)
                             if self.config.uses_tree else EagleProposer(*args))
        else:
            self.proposer = DraftModelProposer(self._draft_model, list(zip(keys, values)), self.draft_kv_cache_manager,
                                               self.k, self.vocab_size,
                                               getattr(self._draft_model, "vocab_size", None) or self.vocab_size,
                                               max_model_len=self.max_model_len)

    # ================================================================== one step: verification
    def metadata(self, num_draft_tokens: np.ndarray, last_token_indices: torch.Tensor,
                 input_ids: torch.Tensor) -> SpecDecodeMetadata:
        """num_draft_tokens [b] of the sampling rows, the flat index of each one's last token [b]
        (its last draft) -> where its logits rows are. A request's sampled positions are its last
        num_draft + 1 tokens, so prefill chunks and plain decodes mix freely with drafts."""
        return calc_spec_decode_metadata(num_draft_tokens.tolist(), (last_token_indices + 1).tolist(), input_ids)

    def _spec_sampling_metadata(self, sm) -> SpecSamplingMetadata:
        """The engine's SamplingMetadata as the rejection sampler reads it: temperatures below
        vLLM's _SAMPLING_EPS are greedy (0) — as in the engine's Sampler — not a division."""
        if self._spec_sampling is None or self._spec_sampling[0] is not sm:
            t = torch.where(sm.temperature < _SAMPLING_EPS, 0.0, sm.temperature)
            self._spec_sampling = (sm, SpecSamplingMetadata(t, sm.top_k, sm.top_p, sm.min_p, dict(sm.generators)))
        return self._spec_sampling[1]

    def verify(self, md: SpecDecodeMetadata, logits: torch.Tensor, bonus_token_ids: torch.Tensor,
               sampling_metadata) -> list[list[int]]:
        """logits [num_draft_total + b, V] at md.logits_indices; bonus [b] drawn by the engine's
        Sampler from logits[md.bonus_logits_indices] -> per request its accepted drafts + one
        token (recovered at the first rejection, else the bonus)."""
        out = self.rejection_sampler(md, None, logits[md.target_logits_indices.long()], bonus_token_ids,
                                     self._spec_sampling_metadata(sampling_metadata), check_values=False)
        return RejectionSampler.parse_output(out, self.vocab_size)

    def verify_trees(self, md: SpecDecodeMetadata, logits: torch.Tensor, sampling_metadata,
                     trees: dict[int, DraftTree], emitted: list[list[int]]) -> dict[int, list[int]]:
        """EAGLE-2: the requests of `trees` ({index among the sampling rows: its tree}) verified as
        trees instead of chains — their entries of `emitted` replaced. A request's logits rows are
        its root (the last verified token) and its nodes, in order (md: as for a chain of as many
        drafts). Greedy: the deepest path of nodes each equal to the target's argmax at its parent
        (chapter 04's verify_tree_greedy); sampled: chapter 04's verify_tree_random (siblings tried
        in turn against the residual, so the emitted tokens follow the target's distribution),
        with the request's own generator when it is seeded. -> {index: accepted nodes (1-based)}."""
        spec = self._spec_sampling_metadata(sampling_metadata)
        ends = md.cu_num_sampled_tokens.tolist()
        accepted_nodes = {}
        for j, tree in trees.items():
            rows = logits[ends[j] - len(tree.tokens) - 1:ends[j]]                       # [1 + N, V]
            tokens = [-1] + tree.tokens                                                  # (the root's is not read)
            if float(spec.temperature[j]) == 0.0:
                accepted, out = verify_tree_greedy(tokens, tree.parents, rows.argmax(-1).tolist())
            else:
                one = SpecSamplingMetadata(spec.temperature[j:j + 1],
                                           None if spec.top_k is None else spec.top_k[j:j + 1],
                                           None if spec.top_p is None else spec.top_p[j:j + 1],
                                           None if spec.min_p is None else spec.min_p[j:j + 1])
                probs = compute_probs(rows, [rows.shape[0]], one).cpu()
                # The request's own generator when seeded (chapter 04's draws: U per node, 1/E per token).
                gen = spec.generators.get(j, self.rejection_sampler.generator)
                device = gen.device if gen is not None else "cpu"
                uniform = generate_uniform_probs([len(tokens)], {}, gen, device).cpu()
                inv_exp = generate_inv_exponential([len(tokens)], probs.shape[-1], {}, gen, device)[0].cpu()
                accepted, out = verify_tree_random(tokens, tree.parents, probs, uniform, inv_exp)
            emitted[j] = out
            accepted_nodes[j] = accepted
        return accepted_nodes

    def observe_verified(self, req_id: str, num_draft: int, num_accepted: int) -> None:
        self.step_stats.num_draft_tokens[req_id] = (num_draft, num_accepted)
        if self.adaptive is not None:
            self.adaptive.observe(req_id, num_draft, num_accepted)

    def observe_hidden(self, req_id: str, position: int, rows: torch.Tensor) -> None:
        """EAGLE: the target's hidden states [n, H] of positions [position, position + n) whose
        K/V this step computed and kept (a prefill chunk, or the last token + accepted drafts)."""
        if not rows.shape[0]:
            return
        try:
            buf = self._hidden.get(req_id) or _HiddenBuffer(position)
            self._hidden[req_id] = buf.put(position, rows)
        except Exception:      # noqa: BLE001 — never fail the step: the head restarts from later features
            logger.warning("request %s: could not keep its hidden states for the drafter", req_id, exc_info=True)
            self._hidden.pop(req_id, None)

    # ================================================================== one step: proposing
    def begin_step(self) -> None:
        self.step_stats = SpecDecodeStepStats(self.k)

    def end_step(self) -> SpecDecodeStepStats:
        """This step's stats (the engine core adds them up: SpecDecodeEngineStats)."""
        return self.step_stats

    def propose(self, batch, rows: Sequence[int]) -> None:
        """Drafts for the next step of the batch rows that just emitted tokens (vLLM:
        propose_draft_token_ids). batch: the runner's InputBatch (tokens include this step's)."""
        self._draft_token_ids = {}
        limit = self.config.disable_by_batch_size
        if limit is not None and batch.num_reqs > limit:
            self.step_stats.disabled = True
            return
        requests = []
        for i in rows:
            state = batch.states[i]
            cap = self.adaptive.num_drafts(state.req_id) if self.adaptive is not None else self.k
            # The next step emits at least one token of its own: more drafts than max_tokens
            # leaves room for could never be used.
            cap = min(cap, state.sampling_params.max_tokens - len(state.output_token_ids) - 1)
            if cap <= 0:
                continue
            hidden, start = None, 0
            if self.needs_hidden_states:
                buf = self._hidden.get(state.req_id)
                if buf is not None and buf.length:
                    hidden, start = buf.tensor(), buf.start
            requests.append(DraftRequest(state.req_id, batch.token_ids[i, :batch.num_tokens[i]], hidden, start,
                                         max_num_drafts=cap))
        if not requests:
            return
        t0 = time.perf_counter()
        # EAGLE-2 trees for every request but those whose sampling reads their own output tokens
        # (penalties, bad words, min_tokens: a tree node's output is its path, which the draft rows'
        # logits processing does not know) — they get the chain.
        # Structured output too: the grammar's mask rows follow one path of drafts (k + 1 rows), not a tree.
        tree = [self.config.uses_tree and not batch.states[i].sampling_params.uses_logits_processors
                and batch.states[i].sampling_params.structured_outputs is None for i in rows]
        chains = [r for r, t in zip(requests, tree) if not t]
        trees = [r for r, t in zip(requests, tree) if t]
        drafted = list(zip(chains, self._propose_isolated(chains) if chains else []))
        for r, t in zip(trees, self._propose_trees_isolated(trees) if trees else []):
            if t.tokens:
                self._trees[r.req_id] = t
            drafted.append((r, t.tokens))
        self.step_stats.drafting_time += time.perf_counter() - t0
        for r, d in drafted:
            if d:
                self._draft_token_ids[r.req_id] = d
                self.step_stats.drafted_req_ids.append(r.req_id)
        if self.needs_hidden_states:
            for r in requests:           # the features the head consumed are not needed again
                buf = self._hidden.get(r.req_id)
                if buf is not None:
                    buf.drop_before(self.proposer.consumed_position(r.req_id))

    def _isolated(self, propose, requests: list[DraftRequest], empty, what: str) -> list:
        """One batched call of `propose` (which checks what it returns); if it raises (a drafter bug,
        an id outside the vocabulary), again one request at a time: a request whose drafter fails
        gets `empty` (and its drafter state is reset), the others keep theirs. Never raises:
        speculation is an optimisation."""
        try:
            return propose(requests)
        except Exception:      # noqa: BLE001 — the drafter must not take the step down
            logger.warning("the %s failed on a batch of %d requests; retrying them one by one", what, len(requests),
                           exc_info=True)
        out = []
        for r in requests:
            try:
                out.append(propose([r])[0])
            except Exception:  # noqa: BLE001
                logger.warning("the %s failed for request %s: no drafts for it this step", what, r.req_id,
                               exc_info=True)
                self.step_stats.num_drafter_faults += 1
                self.proposer.remove_requests([r.req_id])
                out.append(empty)
        return out

    def _propose_isolated(self, requests: list[DraftRequest]) -> list[list[int]]:
        return self._isolated(lambda reqs: self._checked(self.proposer.propose(reqs), reqs), requests, [], "drafter")

    def _propose_trees_isolated(self, requests: list[DraftRequest]) -> list[DraftTree]:
        def propose(reqs):
            trees = self.proposer.propose_tree(reqs)
            if len(trees) != len(reqs):
                raise ValueError(f"the tree drafter returned {len(trees)} trees for {len(reqs)} requests")
            validate_draft_token_ids([t.tokens for t in trees], self.vocab_size, self.k, "EAGLE-2 tree")
            return trees
        return self._isolated(propose, requests, DraftTree([], [-1]), "tree drafter")

    def tree_for(self, req_id: str, drafts: Sequence[int]) -> DraftTree | None:
        """The tree behind the drafts the scheduler scheduled for `req_id` this step (None: a chain).
        The scheduler may run fewer drafts than proposed; parents come first, so a prefix of the
        nodes is still a tree."""
        tree = self._trees.pop(req_id, None)
        if tree is None or not drafts or list(drafts) != tree.tokens[:len(drafts)]:
            return None
        return tree.truncated(len(drafts))

    def _checked(self, drafts, requests) -> list[list[int]]:
        if len(drafts) != len(requests):
            raise ValueError(f"the drafter returned {len(drafts)} draft lists for {len(requests)} requests")
        out = validate_draft_token_ids(drafts, self.vocab_size, self.k, f"{self.method} drafter")
        return [d[:r.max_num_drafts] if r.max_num_drafts is not None else d for d, r in zip(out, requests)]

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """The drafts of the last step, once (vLLM: take_draft_token_ids)."""
        drafts, self._draft_token_ids = self._draft_token_ids, {}
        return drafts

    # ================================================================== request lifecycle
    def remove_requests(self, req_ids) -> None:
        """Finished or aborted: free the drafter's state and KV, forget the request."""
        req_ids = list(req_ids)
        if self.proposer is not None:
            self.proposer.remove_requests(req_ids)
        if self.adaptive is not None:
            self.adaptive.remove_requests(req_ids)
        for req_id in req_ids:
            self._hidden.pop(req_id, None)
            self._draft_token_ids.pop(req_id, None)
            self._trees.pop(req_id, None)

    def preempt_requests(self, req_ids) -> None:
        """Preempted: its draft KV goes with its target KV (recomputed when it resumes); the
        adaptive estimate and EAGLE's pending features stay."""
        if self.proposer is not None:
            self.proposer.remove_requests(list(req_ids))

    def check_idle(self, known_req_ids: set[str]) -> None:
        """Every drafter KV block is held by a request the scheduler still knows (unfinished, or
        finished since its last schedule: the drafter forgets it with the next step's
        finished_req_ids). EngineCore.check_invariants."""
        kv = self.draft_kv_cache_manager
        if kv is not None:
            stale = sorted(r for r, blocks in kv.req_to_blocks.items() if blocks and r not in known_req_ids)
            assert not stale, f"drafter KV blocks leaked by {stale}"
