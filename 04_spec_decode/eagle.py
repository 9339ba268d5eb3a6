"""EAGLE: a one-layer draft head over the TARGET's hidden states ([EAGLE 2024]; [vLLM 2.0 part 2, §9.2]).

Mirrors vLLM's `vllm/v1/spec_decode/eagle.py: EagleProposer` and the EAGLE-1 Llama head
(`vllm/model_executor/models/llama_eagle.py`: `fc` over [embedding; hidden], then decoder
layer(s)).

Why it beats a separate small model: the target's last hidden state f_i already "knows"
what comes next — the LM head turns it into the next token. A head that predicts the NEXT
hidden state f_{i+1} from (f_i, the token x_{i+1} actually chosen) only has to model one
step of feature dynamics, and the target's own LM head turns its guess into a token. One
decoder layer (a few M parameters) suffices; the features carry the rest.

Row i of the head (position i):      input  [embed(x_{i+1}) ; f_i]  --fc-->  layer  --> g_i ~ f_{i+1}
                                     draft  argmax lm_head(g_i)      (a guess of x_{i+2})
Drafting k tokens after the target verified x_0..x_n (features f_0..f_{n-1} known):
    rows up to n-1 use real features (the last one, (x_n, f_{n-1}), gives d_1);
    row n uses (d_1, g_{n-1}), row n+1 uses (d_2, g_n), ...: the head feeds on its own guesses.
The head's layer attends over all earlier rows, so it keeps a paged KV cache like any model;
rows computed from guessed features are overwritten once the target's real features for
those positions arrive (the head's num_computed rolls back to the real rows, as the target's).

The head's decoder layer is chapter 01's `LlamaDecoderLayer` (paged_attention/model/llama.py) — the
class the engine's models are made of — with this chapter's attention op (attention.py:
`TreeAttention`, the paged cache with tree masks; no cache, causal per sequence, for training).

`EagleHead` is saved / loaded as a small HF-style checkpoint (config.json + model.safetensors,
without embeddings or LM head: those are the target's), q/k/v and gate/up stored apart as HF
stores them: loading sends each piece into its rows of the layer's merged qkv_proj / gate_up_proj
(the stacked_params_mapping of vLLM's `llama_eagle.py`, as chapter 07's loader does).
`python -m spec_decode.train_eagle` self-distils one from SmolLM2 on the CPU.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from kvcache import KVCacheManager, RequestTooLargeError
from paged_attention.block_table import build_attention_metadata
from paged_attention.model.layers import RMSNorm, RotaryEmbedding
from model_executor.linear import Linear
from paged_attention.model.llama import STACKED_PARAMS_MAPPING, LlamaDecoderLayer
from spec_decode.attention import CausalMetadata, TreeAttention
from spec_decode.draft_model import PagedRequestState
from spec_decode.proposer import DraftRequest, check_num_speculative_tokens, draft_budget, validate_draft_token_ids

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


@dataclass
class EagleConfig:
    hidden_size: int                     # must equal the target's hidden size
    vocab_size: int                      # the target's vocabulary (the head uses its LM head)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    # EAGLE-3's reduced draft vocabulary: the head has its own LM head over the `draft_vocab_size`
    # tokens the target writes most, and `d2t` (a checkpoint tensor) maps a draft id to the
    # target's. None: the head drafts with the target's whole LM head (EAGLE-1).
    draft_vocab_size: int | None = None
    model_type: str = "eagle_head"
    target_model: str = ""               # what it was distilled from (informational)
    extra: dict = field(default_factory=dict)   # training provenance (data, steps, measured acceptance)

    @classmethod
    def for_target(cls, target_config, intermediate_size: int | None = None) -> "EagleConfig":
        """A head shaped like one layer of the target (HF config or anything with those fields)."""
        g = lambda name, default=None: getattr(target_config, name, default)   # noqa: E731
        heads = g("num_attention_heads")
        rope = g("rope_parameters") or {}
        return cls(hidden_size=g("hidden_size"), vocab_size=g("vocab_size"), num_attention_heads=heads,
                   num_key_value_heads=g("num_key_value_heads", heads),
                   head_dim=g("head_dim") or g("hidden_size") // heads,
                   intermediate_size=intermediate_size or g("intermediate_size"),
                   rms_norm_eps=g("rms_norm_eps", 1e-5),
                   rope_theta=float(rope.get("rope_theta", g("rope_theta", 10000.0)) or 10000.0),
                   max_position_embeddings=g("max_position_embeddings", 8192))


class EagleHead(nn.Module):
    """fc over [embedding; feature] -> one Llama decoder layer -> norm (vLLM: llama_eagle.py's
    EagleLlamaModel). Built with random weights (nn.Linear's init); `from_pretrained` loads a trained one.

    With `config.draft_vocab_size` (EAGLE-3's reduced vocabulary, vLLM: llama_eagle3.py) it also has
    `lm_head` [draft_vocab, H] and `d2t` [draft_vocab]: draft id i is target token i + d2t[i] (the
    offsets EAGLE-3 checkpoints store). Why: drafting runs the LM head k times per step, and the
    target's (49k x 576 for SmolLM2) reads as many bytes as a fifth of the whole target; the few
    thousand words the target actually writes cover almost all of its output."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        c = self.config = config
        self.fc = Linear(2 * c.hidden_size, c.hidden_size)
        self.layer = LlamaDecoderLayer(c, TreeAttention(c.num_attention_heads, c.head_dim, c.num_key_value_heads,
                                                        scale=c.head_dim ** -0.5))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta)
        if c.draft_vocab_size is not None:
            if not 0 < c.draft_vocab_size <= c.vocab_size:
                raise ValueError(f"draft_vocab_size {c.draft_vocab_size} must be in [1, vocab_size={c.vocab_size}]")
            self.lm_head = Linear(c.hidden_size, c.draft_vocab_size)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        for m in self.modules():            # chapter 01's layers start uninitialised: torch.nn's init
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def _check(self, input_embeds, hidden_states):
        h = self.config.hidden_size
        if hidden_states.shape[-1] != h or input_embeds.shape[-1] != h:
            raise ValueError(f"this EAGLE head is for hidden size {h}; got target hidden states of size "
                             f"{hidden_states.shape[-1]} and embeddings of size {input_embeds.shape[-1]}")

    def forward(self, input_embeds: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor,
                kv_cache, attn_metadata) -> torch.Tensor:              # [T, H] predicted next features
        """A flat ragged batch of rows: serving, over the head's paged KV cache (kv_cache, chapter 01's
        AttentionMetadata); or training, kv_cache None and whole sequences (attention.CausalMetadata)."""
        self._check(input_embeds, hidden_states)
        x = self.fc(torch.cat((input_embeds, hidden_states), dim=-1))
        x, residual = self.layer(x, None, self.rotary_emb.cos_sin(positions), kv_cache, attn_metadata)
        return self.norm(x, residual)[0]

    @property
    def has_draft_vocab(self) -> bool:
        return self.config.draft_vocab_size is not None

    def draft_token_ids(self, g: torch.Tensor, target_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Greedy drafts from predicted features g [N, H] -> [N] target token ids: the head's own LM
        head and d2t when it has a draft vocabulary, the target's LM head (`target_logits`) otherwise."""
        if not self.has_draft_vocab:
            return target_logits(g).argmax(-1)
        draft = self.lm_head(g).argmax(-1)                                   # [N] draft ids
        return draft + self.d2t[draft]

    def draft_top_k(self, g: torch.Tensor, k: int, target_logits: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely next tokens after predicted features g [N, H] and their log-probabilities
        under the head's distribution (its own LM head over the draft vocabulary, or the target's):
        -> (target token ids [N, k], logprobs [N, k]), most likely first. EAGLE-2 ranks tree nodes by
        these (the head is calibrated: its confidence tracks the chance that the target agrees)."""
        logits = (self.lm_head(g) if self.has_draft_vocab else target_logits(g)).float()
        logp, ids = torch.log_softmax(logits, -1).topk(min(k, logits.shape[-1]), dim=-1)
        return (ids + self.d2t[ids] if self.has_draft_vocab else ids), logp

    def forward_dense(self, input_embeds: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Training path: [B, T, H] rows of B whole sequences -> [B, T, H]: the same forward on them
        laid end to end, with no cache (each sequence attends causally to itself)."""
        B, T, H = input_embeds.shape
        positions = torch.arange(T, device=input_embeds.device).repeat(B)             # [B * T]
        out = self.forward(input_embeds.reshape(B * T, H), hidden_states.reshape(B * T, -1), positions, None,
                           CausalMetadata.equal_lengths(B, T))
        return out.view(B, T, -1)

    # ---------------------------------------------------------------- checkpoint
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict in the checkpoint's names: each merged parameter split back into its
        pieces (q_proj, k_proj, v_proj; gate_proj, up_proj) — the inverse of `load_weights`."""
        out = {}
        for name, tensor in self.state_dict().items():
            merged = [(param, piece, shard) for param, piece, shard in STACKED_PARAMS_MAPPING if param in name]
            if not merged:
                out[name] = tensor
            for param_piece, ckpt_piece, shard_id in merged:
                offset, size = self.get_submodule(name.rsplit(".", 1)[0]).shard_slice(shard_id)
                out[name.replace(param_piece, ckpt_piece)] = tensor.narrow(0, offset, size)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors -> parameters, a q/k/v (gate/up) piece into its rows of the merged
        parameter (vLLM: llama_eagle.py's load_weights and its stacked_params_mapping). Strict:
        every parameter — every shard — exactly once, and no tensor left over."""
        saved = self.state_dict().keys()                  # parameters and persistent buffers (d2t)
        params = {**dict(self.named_parameters()), **{n: b for n, b in self.named_buffers() if n in saved}}
        missing = {(name, shard) for name, p in params.items() for shard in getattr(p, "shard_ids", (None,))}
        for ckpt_name, tensor in weights:
            name, shard_id = ckpt_name, None
            for param_piece, ckpt_piece, shard in STACKED_PARAMS_MAPPING:
                if ckpt_piece in ckpt_name:
                    name, shard_id = ckpt_name.replace(ckpt_piece, param_piece), shard
                    break
            if (name, shard_id) not in missing:
                raise ValueError(f"checkpoint tensor {ckpt_name!r}: no such parameter in the EAGLE head, or loaded twice")
            param = params[name]
            if shard_id is not None:
                param.weight_loader(param, tensor, shard_id)
            elif param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the parameter "
                                 f"{tuple(param.shape)}")
            else:
                param.data.copy_(tensor)
            missing.discard((name, shard_id))
        if missing:
            names = sorted(n if s is None else f"{n} (shard {s!r})" for n, s in missing)
            raise ValueError(f"the checkpoint is missing {len(missing)} tensor(s) of the EAGLE head: {', '.join(names)}")

    def save_pretrained(self, directory: str | pathlib.Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        save_file({k: (v.detach().to(dtype) if v.is_floating_point() else v).contiguous()
                   for k, v in self.checkpoint_tensors().items()},
                  str(d / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | pathlib.Path, dtype: torch.dtype = torch.float32) -> "EagleHead":
        from safetensors.torch import load_file
        d = pathlib.Path(directory)
        if not (d / CONFIG_NAME).exists() or not (d / WEIGHTS_NAME).exists():
            raise FileNotFoundError(f"{d} is not an EAGLE head checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
        cfg = json.loads((d / CONFIG_NAME).read_text())
        if cfg.get("model_type") != "eagle_head":
            raise ValueError(f"{d / CONFIG_NAME} has model_type={cfg.get('model_type')!r}, not 'eagle_head'")
        head = cls(EagleConfig(**cfg))
        head.load_weights(load_file(str(d / WEIGHTS_NAME)).items())
        return head.to(dtype)          # (floating tensors only: d2t stays int64)


@dataclass
class _HeadRows:
    """EagleProposer._prepare's answer: per drafting request (index into the call's requests), its
    head state, the rows with real features it still owes (tokens x_{i+1}, features f_i, first
    row), its position offset and its draft budget."""
    active: list[int]
    states: list[PagedRequestState]
    rows_tok: list[list[int]]
    rows_hid: list[torch.Tensor]
    rows_start: list[int]
    offsets: list[int]
    budget: list[int]


class EagleProposer:
    """Drafts k tokens per request with an EAGLE head (vLLM: EagleProposer, chain drafting).

    embed_tokens(ids [T]) -> [T, H] and compute_logits(hidden [N, H]) -> [N, V] are the
    TARGET's embedding and LM head. kv_cache: the head's one (key, value) cache pair,
    [num_blocks, block_size, kv_heads, head_dim], whose blocks `kv_cache_manager` hands out.

    Each DraftRequest carries the verified token ids x_0..x_n and the target's hidden states
    for positions [hidden_start, n) — the ones the target computed (and kept) since the last
    call; the head needs exactly the features it has not consumed yet.
    """

    def __init__(self, head: EagleHead, embed_tokens: Callable[[torch.Tensor], torch.Tensor],
                 compute_logits: Callable[[torch.Tensor], torch.Tensor], kv_cache: tuple[torch.Tensor, torch.Tensor],
                 kv_cache_manager: KVCacheManager, num_speculative_tokens: int, target_hidden_size: int,
                 vocab_size: int, max_model_len: int | None = None):
        self.num_speculative_tokens = check_num_speculative_tokens(num_speculative_tokens)
        if head.config.hidden_size != target_hidden_size:
            raise ValueError(f"this EAGLE head was built for hidden size {head.config.hidden_size}; the target's "
                             f"is {target_hidden_size}")
        if head.config.vocab_size != vocab_size:
            raise ValueError(f"this EAGLE head was built for a {head.config.vocab_size}-token vocabulary; the "
                             f"target has {vocab_size}")
        if kv_cache_manager.enable_caching:
            raise ValueError("the EAGLE head's KVCacheManager must have enable_caching=False")
        self.head, self.embed_tokens, self.compute_logits = head, embed_tokens, compute_logits
        self.kv_cache, self.kv = kv_cache, kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.requests: dict[str, PagedRequestState] = {}
        self.offsets: dict[str, int] = {}              # request -> position of its head row 0

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            state = self.requests.pop(rid, None)
            self.offsets.pop(rid, None)
            if state is not None and rid in self.kv.req_to_blocks:
                self.kv.free(state)

    def consumed_position(self, req_id: str) -> int:
        """Positions before this one have been consumed as real features (an engine may drop
        the target's hidden states for them); 0 for a request the head does not know."""
        state = self.requests.get(req_id)
        return 0 if state is None else self.offsets.get(req_id, 0) + state.num_computed_tokens

    def _run(self, states, row_tokens, row_hidden, row_start, offsets) -> torch.Tensor:
        """One batched head pass: request j gets rows row_start[j] .. + len(row_tokens[j]) of its
        head cache, at positions offsets[j] + row (a request may start its head context late,
        see `propose`). Returns the predicted features at each request's last row [num_requests, H]."""
        device = self.kv_cache[0].device
        num_new = [len(t) for t in row_tokens]
        md = build_attention_metadata([self.kv.get_block_ids(s.request_id) for s in states], list(row_start), num_new,
                                      self.block_size, device=device)
        ids = torch.tensor([t for ts in row_tokens for t in ts], dtype=torch.long, device=device)
        positions = torch.cat([o + start + torch.arange(n)
                               for o, start, n in zip(offsets, row_start, num_new)]).to(device)
        with torch.no_grad():
            g = self.head(self.embed_tokens(ids), torch.cat(row_hidden).to(device), positions, self.kv_cache, md)
        return g[md.query_start_loc[1:].long() - 1]

    def _prepare(self, requests: Sequence[DraftRequest], extra_rows: Callable[[int], int]) -> "_HeadRows | None":
        """The requests that can draft now, each with the head rows it owes (real features not yet
        consumed) and its draft budget; head KV allocated for those rows plus `extra_rows(budget)`
        rows the drafting itself will write. None if no request can draft."""
        k = self.num_speculative_tokens
        active, states, rows_tok, rows_hid, rows_start, offsets, budget = [], [], [], [], [], [], []
        for i, r in enumerate(requests):
            tokens = [int(t) for t in r.token_ids]
            new = r.req_id not in self.requests
            offset = r.hidden_start if new and r.hidden_states is not None else self.offsets.get(r.req_id, 0)
            n = len(tokens) - 1 - offset                      # rows 0 .. n-1 can use real features
            if n < 1:
                continue
            state = self.requests.get(r.req_id) or PagedRequestState(r.req_id)
            start = min(state.num_computed_tokens, n)         # rows already computed with real features
            hid = r.hidden_states
            if hid is None or r.hidden_start > offset + start or r.hidden_start + hid.shape[0] < offset + n:
                have = "none" if hid is None else f"[{r.hidden_start}, {r.hidden_start + hid.shape[0]})"
                raise ValueError(f"request {r.req_id}: the EAGLE head needs the target's hidden states for positions "
                                 f"[{offset + start}, {offset + n}), got {have}")
            if hid.shape[-1] != self.head.config.hidden_size:
                raise ValueError(f"request {r.req_id}: target hidden states of size {hid.shape[-1]}, the EAGLE head "
                                 f"is for {self.head.config.hidden_size}")
            budget_i = draft_budget(r, k, self.max_model_len)
            if budget_i <= 0:
                continue
            self.requests[r.req_id], self.offsets[r.req_id] = state, offset
            state.num_computed_tokens = start
            state.all_token_ids = tokens[offset:]
            try:
                ok = self.kv.allocate_slots(state, n - start + extra_rows(budget_i)) is not None
            except RequestTooLargeError:
                ok = False
            if not ok:
                continue
            h0 = offset + start - r.hidden_start
            active.append(i)
            states.append(state)
            rows_tok.append(tokens[offset + start + 1:offset + n + 1])   # row i takes x_{i+1} ...
            rows_hid.append(hid[h0:h0 + n - start])                     # ... and f_i
            rows_start.append(start)
            offsets.append(offset)
            budget.append(budget_i)
        if not active:
            return None
        return _HeadRows(active, states, rows_tok, rows_hid, rows_start, offsets, budget)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Head rows live in the head's own paged cache. Row r of a request is position
        offset + r: the offset is 0 unless the request's first hidden states start later — the
        target never computed the positions it found in its prefix cache, so there are no
        features for them, and the head's context simply begins where the features do (its
        drafts are then guesses from less context; verification keeps the output exact)."""
        k = self.num_speculative_tokens
        drafts: list[list[int]] = [[] for _ in requests]
        b = self._prepare(requests, extra_rows=lambda budget: budget - 1)
        if b is None:
            return drafts
        active, states, rows_tok, rows_hid, rows_start, offsets, budget = (
            b.active, b.states, b.rows_tok, b.rows_hid, b.rows_start, b.offsets, b.budget)
        ### BEGIN SOLUTION
        g = self._run(states, rows_tok, rows_hid, rows_start, offsets)         # [A, H] = g_{n-1}
        for s in states:
            s.num_computed_tokens = len(s.all_token_ids) - 1                   # real rows: 0 .. n-1
        next_row = [len(s.all_token_ids) - 1 for s in states]                  # next row: n
        live = list(range(len(active)))
        for step in range(k):
            tok = self.head.draft_token_ids(g, self.compute_logits)            # [A'] d_{step+1}
            for j, t in zip(live, tok.tolist()):
                drafts[active[j]].append(t)
            keep = [m for m, j in enumerate(live) if step + 1 < budget[j]]
            if not keep:
                break
            live = [live[m] for m in keep]
            g = self._run([states[j] for j in live], [[drafts[active[j]][-1]] for j in live],
                          [g[m:m + 1] for m in keep], [next_row[j] + step for j in live], [offsets[j] for j in live])
        ### END SOLUTION
        return validate_draft_token_ids(drafts, self.vocab_size, k, "EAGLE head")
