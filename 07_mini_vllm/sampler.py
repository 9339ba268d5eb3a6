"""The batched sampler: logits [num_reqs, vocab] fp32 -> one token per request (+ logprobs).

Mirrors vLLM v1's `vllm/v1/sample/sampler.py: Sampler` and `ops/topk_topp_sampler.py`
(`apply_top_k_top_p`, `random_sample`; here in `topk_topp_sampler.py`), and `SamplingMetadata`
(vllm/v1/sample/metadata.py): every request's parameters become one row of a tensor, so a
batch whose requests use different temperatures, top-k, top-p and min-p is sampled with a few
whole-batch tensor ops, not a Python loop over requests.

Per row, in vLLM's order:
    logits processors and penalties, for the rows that use any (logits_processors.py)
    greedy rows (temperature < 1e-5, vLLM's _SAMPLING_EPS) -> argmax
    random rows -> logits / temperature -> min-p -> top-k -> top-p -> draw

Logprobs are those of the model's raw distribution by default (vLLM's logprobs_mode
"raw_logprobs"); "raw_logits", "processed_logprobs" and "processed_logits" are vLLM's other
modes (processed: after the processors, the penalties, temperature, min-p, top-k and top-p).

A temperature below 1e-5 is greedy rather than a division (vLLM draws the same line): logits /
1e-40 overflows to +inf (softmax NaN: garbage tokens), 1e-50 is 0 in an fp32 tensor, and 1e-7
already turns a 1-ulp near tie into a coin flip where greedy is meant.

What one step costs, and why (SmolLM2's vocabulary, 49152, at 64 rows; see
`python -m benchmarks.bench_sampler`):
* greedy rows take `logits.max(-1).indices`: the same first maximum as `argmax`, in 0.9 ms
  instead of 2.3 (torch 2.13 on CPU, fp32), a greedy step's largest sampler cost;
* the finiteness check is `isfinite(logits.amax(-1))`: one reduction, exact because amax
  propagates NaN and +inf and is -inf only for an all -inf row (instead of full isnan/isinf scans);
* top-k / top-p never sort the vocabulary: `torch.topk` of k + 1 (or a few hundred) candidates
  decides the reference's kept set exactly, with a bounded fallback (topk_topp_sampler.py);
* the draw is ONE uniform per row (inverse CDF over the kept candidates) instead of V
  exponentials per row: seeding stays exact, a seeded request consumes one number of its
  own generator per step, and its tokens depend on its seed and step only.
`Sampler(reference=True)` runs the readable oracle instead (full sort + exponential race);
both follow the same rules, and the tests hold both to the target distributions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mini_vllm.logits_processors import LogitsProcessorsMetadata, OutputTokens, apply_logits_processors
from mini_vllm.sampling_params import _SAMPLING_EPS, SamplingParams, SamplingType
from mini_vllm.topk_topp_sampler import (apply_top_k_top_p, inverse_cdf_sample, random_sample,
                                         top_k_top_p_candidates)


@dataclass(frozen=True)
class SamplingMetadata:
    temperature: torch.Tensor                 # [N] fp32; < _SAMPLING_EPS (1e-5) marks a greedy row
    top_k: torch.Tensor | None                # [N] int64, -1 = off; None when no row uses top-k
    top_p: torch.Tensor | None                # [N] fp32, 1 = off; None when no row uses top-p
    min_p: torch.Tensor | None                # [N] fp32, 0 = off; None when no row uses min-p
    generators: dict[int, torch.Generator]    # row -> that request's own generator (seeded rows)
    max_num_logprobs: int | None              # None: no row wants logprobs
    all_greedy: bool
    all_random: bool
    req_ids: tuple[str, ...] | None = None    # names rows in error messages
    logits_processors: LogitsProcessorsMetadata | None = None   # None: no row uses penalties & co.

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None = None,
                    req_ids: Sequence[str] | None = None, device: str | torch.device = "cpu",
                    prompt_token_ids: Sequence[Sequence[int]] | None = None) -> "SamplingMetadata":
        """One row per request. `generators[i]` must be request i's persistent generator if it has a seed
        (make it once with `request_generator` when the request arrives; it advances every step).
        prompt_token_ids: each request's prompt (the repetition penalty counts it)."""
        n = len(params)
        generators = list(generators) if generators is not None else [None] * n
        if len(generators) != n or (req_ids is not None and len(req_ids) != n):
            raise ValueError(f"need one generator (or None) and one request id per SamplingParams ({n})")
        seeded = {}
        for i, (p, g) in enumerate(zip(params, generators)):
            if p.sampling_type == SamplingType.RANDOM_SEED and p.temperature >= _SAMPLING_EPS:
                if g is None:
                    raise ValueError(f"row {i} has seed={p.seed} but no generator: create it once per request "
                                     "with request_generator(params, device) and pass it every step")
                seeded[i] = g
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        if prompt_token_ids is None:
            if any(p.repetition_penalty != 1 for p in params):
                raise ValueError("repetition_penalty needs each request's prompt_token_ids")
            prompt_token_ids = [[]] * n
        return cls(
            temperature=temperature,
            top_k=None if all(k == -1 for k in top_k) else torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=None if all(x == 1.0 for x in top_p) else torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=None if all(x == 0.0 for x in min_p) else torch.tensor(min_p, dtype=torch.float32, device=device),
            generators=seeded,
            max_num_logprobs=max(logprobs) if logprobs else None,
            all_greedy=all(p.temperature < _SAMPLING_EPS for p in params),
            all_random=all(p.temperature >= _SAMPLING_EPS for p in params),
            req_ids=tuple(req_ids) if req_ids is not None else None,
            logits_processors=LogitsProcessorsMetadata.from_params(params, prompt_token_ids, device),
        )


def request_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """The private random stream of a seeded request (None for greedy / unseeded requests)."""
    if params.sampling_type != SamplingType.RANDOM_SEED:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


@dataclass(frozen=True)
class LogprobsTensors:
    """vLLM's LogprobsTensors: column 0 is the sampled token, columns 1.. the top-k, most likely first."""
    logprob_token_ids: torch.Tensor           # [N, 1 + k] int64
    logprobs: torch.Tensor                    # [N, 1 + k] fp32, log-softmax of the raw logits
    selected_token_ranks: torch.Tensor        # [N] int64: tokens at least as likely as the sampled one (1 = top)


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor           # [N] int64
    logprobs_tensors: LogprobsTensors | None


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with p < min_p * p_max (vLLM: MinPLogitsProcessor). logits [N, V], min_p [N]."""
    probs = logits.softmax(dim=-1)                                            # [N, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]             # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def processed_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution the random rows draw from, as logits: (processed) logits / temperature,
    min-p and top-k / top-p masked to -inf (vLLM's "processed" logprobs modes). Greedy rows keep
    their logits (temperature 1, no filter, as in vLLM). [N, V]; the full-sort path, only run when
    such logprobs are asked for."""
    temperature = torch.where(md.temperature < _SAMPLING_EPS, torch.ones_like(md.temperature), md.temperature)
    x = logits / temperature[:, None]
    if md.min_p is not None:
        x = apply_min_p(x, md.min_p)
    return apply_top_k_top_p(x, md.top_k, md.top_p)


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int,
                     as_logits: bool = False) -> LogprobsTensors:
    """Log-probabilities of `logits`' distribution (the raw one by default, vLLM's
    `logprobs_mode="raw_logprobs"`): the sampled token's plus the `num_logprobs` most likely.
    as_logits: report the logits themselves (the "*_logits" modes; same ranking)."""
    logprobs = logits if as_logits else logits.log_softmax(dim=-1)            # [N, V]
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)               # [N, k]
    sampled_logprob = logprobs.gather(-1, sampled[:, None])                   # [N, 1]
    ranks = (logprobs >= sampled_logprob).sum(dim=-1)                         # [N] (vLLM: batched_count_greater_than)
    return LogprobsTensors(
        logprob_token_ids=torch.cat((sampled[:, None], top_ids), dim=-1),
        logprobs=torch.cat((sampled_logprob, top_logprobs), dim=-1),
        selected_token_ranks=ranks,
    )


LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class Sampler(nn.Module):
    """logits [N, V] fp32 + SamplingMetadata (+ each row's output tokens when a row uses
    penalties, min_tokens or bad words) -> SamplerOutput.

    generator: the random stream of unseeded random rows (None: torch's default generator, as vLLM).
    reference: run the readable oracle (full sort, V exponentials per row) instead of the fast path.
    top_p_candidates: how many candidates a top-p-only row starts with (more only when its kept
        mass is not reached; tests make it tiny to exercise the fallback).
    logprobs_mode: which distribution `logprobs` report (vLLM's LogprobsMode, see the top).
    """

    def __init__(self, generator: torch.Generator | None = None, reference: bool = False,
                 top_p_candidates: int = 256, logprobs_mode: str = "raw_logprobs"):
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.generator = generator
        self.reference = reference
        self.top_p_candidates = top_p_candidates
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata,
                output_tokens: OutputTokens | None = None) -> SamplerOutput:
        check_logits(logits, metadata)
        raw_logits = logits
        if metadata.logits_processors is not None:
            rows = torch.arange(logits.shape[0], device=logits.device)
            logits = apply_logits_processors(logits, metadata.logits_processors, rows, output_tokens)
        ### BEGIN SOLUTION
        if metadata.all_greedy:
            sampled = greedy(logits)                                                     # [N]
        else:
            greedy_rows = metadata.temperature < _SAMPLING_EPS                           # [N]
            rows = None if metadata.all_random else (~greedy_rows).nonzero()[:, 0]      # [R] the random rows
            sampled = self._sample_random(logits, metadata, rows)                        # [R]
            if rows is not None:
                sampled = greedy(logits).index_put_((rows,), sampled)                    # greedy rows: argmax
        ### END SOLUTION
        logprobs = None
        if metadata.max_num_logprobs is not None:
            source = raw_logits if self.logprobs_mode.startswith("raw") else processed_logits(logits, metadata)
            logprobs = compute_logprobs(source, sampled, metadata.max_num_logprobs,
                                        as_logits=self.logprobs_mode.endswith("logits"))
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata, rows: torch.Tensor | None) -> torch.Tensor:
        """The random rows (None: all rows): temperature -> min-p -> top-k/top-p -> draw. [R] int64."""
        pick = (lambda t: t) if rows is None else (lambda t: None if t is None else t[rows])
        temperature, top_k, top_p, min_p = pick(md.temperature), pick(md.top_k), pick(md.top_p), pick(md.min_p)
        x = pick(logits) / temperature[:, None]                                          # [R, V]
        if min_p is not None:
            x = apply_min_p(x, min_p)
        generators = md.generators if rows is None else _renumber(md.generators, rows)
        if self.reference:
            x = apply_top_k_top_p(x, top_k, top_p)
            return random_sample(x.softmax(dim=-1), generators, self.generator)
        u = draw_uniforms(x.shape[0], generators, self.generator, x.device)             # [R] fp64
        probs = x.softmax(dim=-1)                                                        # [R, V]
        filtered = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)             # [R] top-k or top-p on
        if top_k is not None:
            filtered |= (top_k >= 1) & (top_k < x.shape[-1])
        if top_p is not None:
            filtered |= top_p < 1
        if bool(filtered.all()):                                                         # the common case
            cand = top_k_top_p_candidates(x, probs, top_k, top_p, self.top_p_candidates)
            return inverse_cdf_sample(cand.probs, u, cand.token_ids)
        if not bool(filtered.any()):                                                     # temperature / min-p only
            return inverse_cdf_sample(probs, u)
        sampled = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        whole = (~filtered).nonzero()[:, 0]
        sampled[whole] = inverse_cdf_sample(probs[whole], u[whole])                      # no filter: the whole row
        f = filtered.nonzero()[:, 0]
        cand = top_k_top_p_candidates(x[f], probs[f], None if top_k is None else top_k[f],
                                      None if top_p is None else top_p[f], self.top_p_candidates)
        sampled[f] = inverse_cdf_sample(cand.probs, u[f], cand.token_ids)
        return sampled


def _renumber(generators: dict[int, torch.Generator], rows: torch.Tensor) -> dict[int, torch.Generator]:
    """Batch row -> generator, re-keyed by position among `rows`."""
    position = {int(r): i for i, r in enumerate(rows.tolist())}
    return {position[r]: g for r, g in generators.items() if r in position}


def draw_uniforms(num_rows: int, generators: dict[int, torch.Generator], generator: torch.Generator | None,
                  device: torch.device) -> torch.Tensor:
    """[R] fp64 uniforms in [0, 1), one per row: a seeded row takes exactly one number from its own
    generator (so what it draws never depends on the batch), the others share `generator`."""
    u = torch.empty(num_rows, dtype=torch.float64, device=device)
    if len(generators) != num_rows:
        u.uniform_(generator=generator)
    for row, g in generators.items():
        u[row] = torch.rand((), dtype=torch.float64, generator=g, device=g.device)
    return u


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: each row's argmax (its FIRST maximal index, as torch.argmax). Through
    torch.max(dim), which returns that same index: on CPU it takes 0.9 ms where argmax takes 2.3
    (SmolLM2's [64, 49152] fp32, torch 2.13, 2 threads; argmax's reduction carries (value, index)
    pairs lane by lane)."""
    return logits.max(dim=-1).indices


def check_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Shape/dtype checks, and a clear error naming the rows whose logits hold NaN or +inf (or no
    finite value at all). -inf alone is fine: it is how a token is masked out.

    Without it a NaN row would sample whatever argmax makes of NaN, every step, silently.
    """
    if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
        raise ValueError(f"logits must be [num_reqs={metadata.num_rows}, vocab], got {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise TypeError(f"the sampler works in fp32; got logits of dtype {logits.dtype} (compute_logits returns fp32)")
    bad = nonfinite_rows(logits)                                                                           # [N]
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        names = f" (requests {[metadata.req_ids[r] for r in rows]})" if metadata.req_ids else ""
        raise FloatingPointError(f"non-finite logits (NaN, +inf or all -inf) in rows {rows}{names}: the model's output overflowed "
                                 "or its weights are corrupt (fp16 overflow? try bfloat16 or float32)")


# What a request whose logits row is non-finite fails with (the engine fails that request alone).
NONFINITE_LOGITS = ("non-finite logits (NaN or +inf, or no finite value): the model's output overflowed "
                    "or its weights are corrupt (fp16 overflow? try bfloat16 or float32)")


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] bool: rows holding a NaN or +inf, or no finite value at all. The engine uses it
    to fail only the offending requests and keep sampling the others.

    One reduction instead of three scans: a row's max is NaN if the row holds a NaN (amax
    propagates NaN), +inf if it holds +inf, -inf exactly when every entry is -inf, and finite
    otherwise (-inf entries alone are fine: that is how a token is masked out)."""
    return ~torch.isfinite(logits.amax(dim=-1))
