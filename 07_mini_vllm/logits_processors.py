"""Logits processors and penalties: what happens to a row of logits before temperature.

Mirrors vLLM v1's sampler steps 3-6 (`vllm/v1/sample/sampler.py: Sampler.forward`), in its order:

    allowed_token_ids   every other token -> -inf          (Sampler.apply_allowed_token_ids)
    bad_words           a word's last token -> -inf when the output ends with the rest of it
                                                           (vllm/v1/sample/ops/bad_words.py)
    min_tokens          stop ids and EOS -> -inf while the output is shorter than min_tokens
    logit_bias          + bias                             (vllm/v1/sample/logits_processor/builtin.py)
    penalties           repetition over prompt + output, then frequency and presence over the
                        output (vllm/v1/sample/ops/penalties.py -> model_executor/layers/utils.py:
                        apply_penalties)

All of it changes the argmax, so greedy rows go through it too. Each processor is a few
whole-batch tensor ops over the rows that use it: the per-request parameters become padded
per-row tensors once, when the batch changes (`LogitsProcessorsMetadata.from_params`); what
changes every step — each row's output tokens — comes in as one padded tensor
(`OutputTokens`). A batch in which no request uses any of it never builds either (the
sampler's metadata holds None), so the plain greedy and sampled paths cost what they did.

Rows vs requests: speculative decoding verifies k drafts with k + 1 rows of logits per
request, and the row at draft position j must see the output as it would be after the first
j drafts (penalties count them, bad words match them). So every function takes `req_rows`
[R] (the metadata row of each logits row) and the output tokens of each logits row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mini_vllm.sampling_params import SamplingParams

PAD = -1     # pads ragged id lists; becomes index V (a column past the vocabulary) when applied


def _padded(rows: Sequence[Sequence[int]], device) -> torch.Tensor:
    """Ragged lists of token ids -> [N, max_len] int64 padded with PAD (at least one column)."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = np.full((len(rows), width), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out).to(device)


def _one_hot_rows(ids: torch.Tensor, vocab: int, dtype=torch.bool) -> torch.Tensor:
    """[R, L] padded ids -> [R, V]: True (or the count) at each id; PAD lands in column V, dropped."""
    ids = torch.where(ids < 0, vocab, ids)
    out = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.int64 if dtype != torch.bool else torch.bool,
                      device=ids.device)
    if dtype == torch.bool:
        out.scatter_(1, ids, True)
    else:
        out.scatter_add_(1, ids, torch.ones_like(ids))
    return out[:, :vocab]


@dataclass(frozen=True)
class BadWords:
    """All (request, bad word) pairs of the batch whose words have `length` tokens."""
    req_rows: torch.Tensor        # [P] int64: the metadata row of the pair
    prefixes: torch.Tensor        # [P, length - 1] int64: the word but its last token
    last: torch.Tensor            # [P] int64: the token that would complete the word


@dataclass(frozen=True)
class LogitsProcessorsMetadata:
    """Per request row (N rows, the sampler's rows), built once per batch; None = no row uses it."""
    allowed_token_ids: torch.Tensor | None     # [N, A] padded; a row of only PAD allows everything
    bad_words: tuple[BadWords, ...]            # grouped by word length
    min_tokens: torch.Tensor | None            # [N] int64 (0: off)
    stop_token_ids: torch.Tensor | None        # [N, S] padded: what min_tokens masks
    logit_bias_ids: torch.Tensor | None        # [N, B] padded
    logit_bias: torch.Tensor | None            # [N, B] fp32, 0 where padded
    repetition_penalty: torch.Tensor | None    # [N] fp32 (1: off)
    frequency_penalty: torch.Tensor | None     # [N] fp32 (0: off)
    presence_penalty: torch.Tensor | None      # [N] fp32 (0: off)
    prompt_token_ids: torch.Tensor | None      # [N, P] padded: what the repetition penalty sees

    @property
    def needs_output_tokens(self) -> bool:
        return bool(self.bad_words) or self.min_tokens is not None or self.repetition_penalty is not None

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
                    device: str | torch.device = "cpu") -> "LogitsProcessorsMetadata | None":
        if not any(p.uses_logits_processors for p in params):
            return None
        allowed = None
        if any(p.allowed_token_ids is not None for p in params):
            allowed = _padded([p.allowed_token_ids or [] for p in params], device)
        groups: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        for i, p in enumerate(params):
            for word in p._bad_words_token_ids:
                groups.setdefault(len(word), []).append((i, word))
        bad_words = tuple(
            BadWords(req_rows=torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=device),
                     prefixes=torch.tensor([w[:-1] for _, w in pairs], dtype=torch.int64,
                                           device=device).reshape(len(pairs), length - 1),
                     last=torch.tensor([w[-1] for _, w in pairs], dtype=torch.int64, device=device))
            for length, pairs in sorted(groups.items()))
        min_tokens = stop_ids = None
        if any(p.min_tokens > 0 for p in params):
            min_tokens = torch.tensor([p.min_tokens for p in params], dtype=torch.int64, device=device)
            stop_ids = _padded([sorted(p._all_stop_token_ids) for p in params], device)
        bias_ids = bias = None
        if any(p.logit_bias for p in params):
            bias_ids = _padded([list(p.logit_bias or {}) for p in params], device)
            values = [list((p.logit_bias or {}).values()) for p in params]
            bias = torch.zeros(bias_ids.shape, dtype=torch.float32, device=device)
            for i, v in enumerate(values):
                bias[i, :len(v)] = torch.tensor(v, dtype=torch.float32)
        penalties = any(p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0
                        for p in params)

        def per_row(name):
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)

        return cls(
            allowed_token_ids=allowed, bad_words=bad_words, min_tokens=min_tokens, stop_token_ids=stop_ids,
            logit_bias_ids=bias_ids, logit_bias=bias,
            repetition_penalty=per_row("repetition_penalty") if penalties else None,
            frequency_penalty=per_row("frequency_penalty") if penalties else None,
            presence_penalty=per_row("presence_penalty") if penalties else None,
            prompt_token_ids=_padded(prompt_token_ids, device) if penalties else None)


@dataclass(frozen=True)
class OutputTokens:
    """Each logits row's output tokens so far (what the penalties, min_tokens and bad words see)."""
    token_ids: torch.Tensor       # [R, O] int64, padded with PAD after each row's last token
    lengths: torch.Tensor         # [R] int64

    @classmethod
    def from_lists(cls, outputs: Sequence[Sequence[int]], device: str | torch.device = "cpu") -> "OutputTokens":
        return cls(_padded(outputs, device), torch.tensor([len(o) for o in outputs], dtype=torch.int64, device=device))

    @classmethod
    def from_token_array(cls, token_ids: np.ndarray, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                         device: str | torch.device = "cpu") -> "OutputTokens":
        """token_ids[rows[r], starts[r]:ends[r]] for each r, gathered in one vectorized read
        (the runner's persistent batch: starts = prompt lengths, ends = tokens so far)."""
        lengths = ends - starts                                                   # [R]
        width = max(1, int(lengths.max(initial=0)))
        cols = starts[:, None] + np.arange(width)[None, :]                         # [R, O]
        valid = cols < ends[:, None]
        ids = token_ids[rows[:, None], np.minimum(cols, token_ids.shape[1] - 1)]
        ids = np.where(valid, ids, PAD).astype(np.int64)
        return cls(torch.from_numpy(ids).to(device), torch.from_numpy(lengths.astype(np.int64)).to(device))


def apply_logits_processors(logits: torch.Tensor, md: LogitsProcessorsMetadata, req_rows: torch.Tensor,
                            outputs: OutputTokens | None) -> torch.Tensor:
    """logits [R, V] fp32 -> a new [R, V] tensor with every processor applied, in vLLM's order.
    req_rows [R]: the metadata row of each logits row; outputs: each logits row's output tokens
    (required when md.needs_output_tokens)."""
    if md.needs_output_tokens and outputs is None:
        raise ValueError("these sampling parameters need each row's output tokens")
    vocab = logits.shape[-1]
    logits = logits.clone()
    if md.allowed_token_ids is not None:
        rows = _rows_using((md.allowed_token_ids >= 0).any(dim=-1)[req_rows])
        logits[rows] = masked_to_allowed(logits[rows], md.allowed_token_ids[req_rows[rows]])
    for group in md.bad_words:
        apply_bad_words(logits, group, req_rows, outputs)
    if md.min_tokens is not None:
        short = outputs.lengths < md.min_tokens[req_rows]                                   # [R]
        if bool(short.any()):
            mask = _one_hot_rows(md.stop_token_ids[req_rows], vocab) & short[:, None]         # [R, V]
            logits.masked_fill_(mask, float("-inf"))
    if md.logit_bias is not None:
        ids = md.logit_bias_ids[req_rows]
        bias = torch.zeros(logits.shape[0], vocab + 1, dtype=logits.dtype, device=logits.device)
        bias.scatter_add_(1, torch.where(ids < 0, vocab, ids), md.logit_bias[req_rows])
        logits += bias[:, :vocab]
    if md.repetition_penalty is not None:
        uses = (md.repetition_penalty != 1) | (md.frequency_penalty != 0) | (md.presence_penalty != 0)    # [N]
        rows = _rows_using(uses[req_rows])
        r = req_rows[rows]
        logits[rows] = apply_penalties(logits[rows], md.prompt_token_ids[r], outputs.token_ids[rows],
                                       md.presence_penalty[r], md.frequency_penalty[r], md.repetition_penalty[r])
    # The Processor refuses constraints that mask everything from the start; a multi-token bad
    # word can still close the last door later. Fail loudly (the runner then fails this request
    # alone) instead of letting argmax pick token 0 from a row of -inf.
    dead = ~torch.isfinite(logits.amax(dim=-1))                                                 # [R]
    if bool(dead.any()):
        raise ValueError(f"logits rows {dead.nonzero()[:, 0].tolist()}: allowed_token_ids, bad_words and min_tokens "
                         "together mask every token (or a logit_bias overflowed): nothing can be sampled")
    return logits


def _rows_using(uses: torch.Tensor) -> torch.Tensor | slice:
    """The logits rows a processor touches: all of them (a slice, no copy) or their indices [R']."""
    return slice(None) if bool(uses.all()) else uses.nonzero()[:, 0]


def masked_to_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with every token but each row's allowed ones ([R, A] padded) at -inf."""
    return logits.masked_fill(~_one_hot_rows(allowed, logits.shape[-1]), float("-inf"))


def apply_bad_words(logits: torch.Tensor, group: BadWords, req_rows: torch.Tensor, outputs: OutputTokens) -> None:
    """In place. For every (logits row, bad word) pair of the row's request: mask the word's
    last token when the row's output ends with the word's other tokens (vLLM looks at the
    output only, not the prompt). One comparison over all pairs of this word length."""
    r, p = (req_rows[:, None] == group.req_rows[None, :]).nonzero(as_tuple=True)             # pairs [Q]
    if r.numel() == 0:
        return
    n = group.prefixes.shape[1]
    if n == 0:
        hit = torch.ones_like(r, dtype=torch.bool)
    else:
        lengths = outputs.lengths[r]                                                         # [Q]
        cols = (lengths[:, None] - n + torch.arange(n, device=logits.device)).clamp_min(0)   # [Q, n]
        tail = outputs.token_ids[r[:, None], cols]                                           # [Q, n]
        hit = (lengths >= n) & (tail == group.prefixes[p]).all(dim=-1)
    logits[r[hit], group.last[p[hit]]] = float("-inf")


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's apply_penalties (the OpenAI API's definitions for presence / frequency):
        seen = token in prompt or output;  logit /= r if logit > 0 else logit *= r  (r where seen)
        logit -= frequency * count_in_output + presence * [count_in_output > 0]
    logits [R, V]; ids [R, *] padded; penalties [R]. Returns a new tensor."""
    vocab = logits.shape[-1]
    counts = _one_hot_rows(output_token_ids, vocab, dtype=torch.int64)                       # [R, V]
    in_output = counts > 0
    seen = _one_hot_rows(prompt_token_ids, vocab) | in_output
    scale = torch.where(seen, repetition[:, None], torch.ones_like(logits))                  # [R, V]
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    return logits - frequency[:, None] * counts - presence[:, None] * in_output
