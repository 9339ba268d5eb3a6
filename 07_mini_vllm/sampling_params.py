"""SamplingParams: how one request turns logits into tokens, and when it stops.

Mirrors vLLM's `vllm/sampling_params.py: SamplingParams` (same names, same meanings), validated
once in `__post_init__` so that the sampler and the stop checks can trust every field and a
bad value fails at `generate()` time with a message naming it — not as a NaN three layers down.

    temperature  0 -> greedy (argmax, deterministic); > 0 -> sample from softmax(logits / T);
                 below 1e-5 (vLLM's _SAMPLING_EPS) is greedy too: logits / 1e-40 would overflow
    top_k        keep the k most likely tokens (-1: all)
    top_p        keep the smallest set of most likely tokens whose probability reaches p (1: all)
    min_p        drop tokens less likely than min_p * (probability of the most likely token) (0: none)
    seed         a private random stream for this request: same seed -> same tokens, whatever else
                 is in the batch (None: the engine's shared stream)
    max_tokens   stop after this many generated tokens
    stop         stop when the output text contains one of these strings (not included in the output)
    stop_token_ids  stop when one of these tokens is generated (it is included, like EOS)
    ignore_eos   keep generating past EOS (benchmarks use it to fix the output length)
    logprobs     None: none; k: the sampled token's log-probability plus the k most likely (0..20)

How the engine reports the request (vLLM's names; used by the engine, not the sampler):
    output_kind  CUMULATIVE: every step, the whole text so far; DELTA: only what is new this step;
                 FINAL_ONLY: one output when the request finishes (what LLM.generate uses)
    detokenize   turn tokens into text (False: token ids only; stop strings then impossible)
    skip_special_tokens          leave special tokens (EOS, chat markers) out of the text
    include_stop_str_in_output   keep the stop string that ended the request in its text

Filters apply in vLLM's order: temperature, then min-p, then top-k, then top-p (sampler.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

MAX_LOGPROBS = 20
_SAMPLING_EPS = 1e-5    # vLLM's: a temperature below it samples greedily


class RequestOutputKind(IntEnum):
    """What each step's RequestOutput carries (vLLM: vllm/sampling_params.py: RequestOutputKind)."""
    CUMULATIVE = 0      # all text / tokens so far, every step
    DELTA = 1           # only the text / tokens produced since the previous output
    FINAL_ONLY = 2      # nothing until the request finishes, then everything


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1          # the engine's shared random stream
    RANDOM_SEED = 2     # the request's own torch.Generator


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # __post_init__ normalises `stop` to a list[str] and `stop_token_ids` to a list[int].

    def __post_init__(self):
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty (an empty string would stop before the first token)")
        self.stop = list(stop)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched on the output text)")

        stop_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop_ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(stop_ids)

        if self.temperature < _SAMPLING_EPS:
            # Greedy ignores the filters; reset them so that the sampler's "all greedy" fast path
            # and batch-level flags (vLLM: SamplingParams._verify_greedy_sampling) see plain values.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED
