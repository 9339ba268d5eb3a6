"""The batched sampler: logits [num_reqs, vocab] fp32 -> one token per request (+ logprobs).

Mirrors vLLM v1's `vllm/v1/sample/sampler.py: Sampler` and `ops/topk_topp_sampler.py`
(`apply_top_k_top_p`, `apply_top_k_only`, `random_sample`), and `SamplingMetadata`
(vllm/v1/sample/metadata.py): every request's parameters become one row of a tensor, so a
batch whose requests use different temperatures, top-k, top-p and min-p is sampled with a few
whole-batch tensor ops, not a Python loop over requests.

Per row, in vLLM's order:
    greedy rows (temperature 0)  -> argmax of the raw logits (exact, deterministic)
    random rows -> logits / temperature -> min-p -> top-k -> top-p -> softmax -> draw

The draw uses the exponential race (equivalent to Gumbel-max): with E_i ~ Exp(1) i.i.d.,
argmax_i p_i / E_i is distributed exactly as p. Its randomness is one vector of `vocab`
exponentials per row, which makes seeding clean: a seeded request fills its own row from its
own `torch.Generator`, exactly `vocab` draws per step, so its tokens depend on its seed and
step only — never on which other requests share the batch (vLLM does the same, per row).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mini_vllm.sampling_params import SamplingParams, SamplingType


@dataclass(frozen=True)
class SamplingMetadata:
    temperature: torch.Tensor                 # [N] fp32; 0 marks a greedy row
    top_k: torch.Tensor | None                # [N] int64, -1 = off; None when no row uses top-k
    top_p: torch.Tensor | None                # [N] fp32, 1 = off; None when no row uses top-p
    min_p: torch.Tensor | None                # [N] fp32, 0 = off; None when no row uses min-p
    generators: dict[int, torch.Generator]    # row -> that request's own generator (seeded rows)
    max_num_logprobs: int | None              # None: no row wants logprobs
    all_greedy: bool
    all_random: bool
    req_ids: tuple[str, ...] | None = None    # names rows in error messages

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None] | None = None,
                    req_ids: Sequence[str] | None = None, device: str | torch.device = "cpu") -> "SamplingMetadata":
        """One row per request. `generators[i]` must be request i's persistent generator if it has a seed
        (make it once with `request_generator` when the request arrives; it advances every step)."""
        n = len(params)
        generators = list(generators) if generators is not None else [None] * n
        if len(generators) != n or (req_ids is not None and len(req_ids) != n):
            raise ValueError(f"need one generator (or None) and one request id per SamplingParams ({n})")
        seeded = {}
        for i, (p, g) in enumerate(zip(params, generators)):
            if p.sampling_type == SamplingType.RANDOM_SEED:
                if g is None:
                    raise ValueError(f"row {i} has seed={p.seed} but no generator: create it once per request "
                                     "with request_generator(params, device) and pass it every step")
                seeded[i] = g
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            top_k=None if all(k == -1 for k in top_k) else torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=None if all(x == 1.0 for x in top_p) else torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=None if all(x == 0.0 for x in min_p) else torch.tensor(min_p, dtype=torch.float32, device=device),
            generators=seeded,
            max_num_logprobs=max(logprobs) if logprobs else None,
            all_greedy=all(p.temperature == 0 for p in params),
            all_random=all(p.temperature > 0 for p in params),
            req_ids=tuple(req_ids) if req_ids is not None else None,
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


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: one torch.topk with the batch's largest k (vLLM: apply_top_k_only).

    Keeps every token whose logit is >= the row's k-th largest (ties at the boundary survive)."""
    vocab = logits.shape[-1]
    off = (k < 1) | (k >= vocab)                                              # [N] rows without top-k
    k = k.masked_fill(off, 1)
    kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])   # [N, 1] the k-th largest logit
    kth = kth.masked_fill(off[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Top-k and/or top-p (nucleus) masking, per row (vLLM: apply_top_k_top_p).

    Top-p keeps the smallest set of most likely tokens whose probability reaches p: sort
    ascending, and drop a token when the mass at or below it is <= 1 - p (the top token always stays).
    Top-p is applied to the distribution left by top-k (renormalised), as in vLLM.
    """
    if p is None:
        return logits if k is None else apply_top_k_only(logits, k)
    ### BEGIN SOLUTION
    vocab = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)           # [N, V] ascending
    if k is not None:
        k = torch.where((k < 1) | (k > vocab), vocab, k)
        kth = logits_sort.gather(-1, (vocab - k)[:, None])                     # [N, 1] the k-th largest
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)                     # [N, V] mass at or below each token
    drop = probs_sum <= (1 - p)[:, None]
    drop[:, -1] = False                                                        # always keep the most likely token
    logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    ### END SOLUTION
    return torch.empty_like(logits).scatter_(-1, logits_idx, logits_sort)     # back to vocabulary order


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from probs [N, V] via argmax(p / E), E ~ Exp(1) (vLLM: random_sample)."""
    ### BEGIN SOLUTION
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_(generator=generator)                                   # the shared stream, unseeded rows
    for row, g in generators.items():
        q[row].exponential_(generator=g)                                      # exactly V draws from the row's own stream
    # An exact 0 draw would turn p=0 into 0/0 = NaN (and argmax picks NaN): keep E > 0.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)
    ### END SOLUTION


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Log-probabilities of the model's raw distribution (before temperature and filters), as vLLM's
    default `logprobs_mode="raw_logprobs"`: the sampled token's plus the `num_logprobs` most likely."""
    logprobs = logits.log_softmax(dim=-1)                                     # [N, V]
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)               # [N, k]
    sampled_logprob = logprobs.gather(-1, sampled[:, None])                   # [N, 1]
    ranks = (logprobs >= sampled_logprob).sum(dim=-1)                         # [N] (vLLM: batched_count_greater_than)
    return LogprobsTensors(
        logprob_token_ids=torch.cat((sampled[:, None], top_ids), dim=-1),
        logprobs=torch.cat((sampled_logprob, top_logprobs), dim=-1),
        selected_token_ranks=ranks,
    )


class Sampler(nn.Module):
    """logits [N, V] fp32 + SamplingMetadata -> SamplerOutput.

    generator: the random stream of unseeded random rows (None: torch's default generator, as vLLM).
    """

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        check_logits(logits, metadata)
        ### BEGIN SOLUTION
        greedy = None if metadata.all_random else logits.argmax(dim=-1)                  # [N]
        if metadata.all_greedy:
            sampled = greedy
        else:
            temperature = metadata.temperature.masked_fill(metadata.temperature == 0, 1.0)   # greedy rows: avoid /0
            x = logits / temperature[:, None]                                             # [N, V]
            if metadata.min_p is not None:
                x = apply_min_p(x, metadata.min_p)
            x = apply_top_k_top_p(x, metadata.top_k, metadata.top_p)
            sampled = random_sample(x.softmax(dim=-1), metadata.generators, self.generator)
            if greedy is not None:
                sampled = torch.where(metadata.temperature == 0, greedy, sampled)
        ### END SOLUTION
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)


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


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] bool: rows holding a NaN or +inf, or no finite value at all. The engine uses it
    to fail only the offending requests and keep sampling the others."""
    return torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | ~torch.isfinite(logits).any(-1)
