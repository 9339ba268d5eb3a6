"""SamplingParams: how one request turns logits into tokens, and when it stops.

Mirrors vLLM's `vllm/sampling_params.py: SamplingParams` (same names, same meanings), validated
once in `__post_init__` so that the sampler and the stop checks can trust every field and a
bad value fails at `generate()` time with a message naming it — not as a NaN three layers down.

    n            parallel sampling: n completions of the one prompt, fanned out into n child requests
                 whose prompt K/V is shared through the prefix cache; child i samples with seed + i
                 when a seed is given (vLLM's ParentRequest). Needs
                 temperature > 0 (vLLM's rule: n greedy completions would be n copies)
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
    prompt_logprobs  None: none; k: for every prompt token after the first, its log-probability
                 given the tokens before it, plus the k most likely (0..20). The request then
                 computes its whole prompt: a prefix-cache hit would leave positions without logits
                 (vLLM does the same), so it is slower to start

Logits processors and penalties (vLLM's definitions; logits_processors.py applies them):
    presence_penalty   [-2, 2]: subtract it from every token that appears in the OUTPUT so far
    frequency_penalty  [-2, 2]: subtract it times the token's count in the OUTPUT so far
                       (both as the OpenAI API defines them; > 0 discourages repetition)
    repetition_penalty > 0: every token seen in the PROMPT or the output has its logit divided
                       by it if positive, multiplied by it if not (1: off; > 1 discourages)
    min_tokens         EOS and the stop token ids cannot be sampled before this many outputs
    logit_bias         {token id: bias}: added to the token's logit
    allowed_token_ids  only these tokens can be sampled
    bad_words          these words (tokenized with and without a leading space, as vLLM does)
                       can never be completed: when the output ends with all but a word's last
                       token, that last token is masked

Structured output (vLLM's names; chapter 08 compiles the constraint, the engine masks the logits):
    structured_outputs  StructuredOutputsParams(json= | regex= | choice= | grammar= | json_object=True):
                 every generated token keeps the text inside that language; EOS is allowed only
                 where the text is complete, so the request ends with finish reason "stop"

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
from dataclasses import dataclass, field
from enum import IntEnum

MAX_LOGPROBS = 20          # vLLM's default --max-logprobs (EngineConfig.max_logprobs)
_SAMPLING_EPS = 1e-5    # vLLM's: a temperature below it samples greedily


@dataclass
class StructuredOutputsParams:
    """The constraint a request's output must follow (vLLM: `vllm/sampling_params.py:
    StructuredOutputsParams`), exactly one of:
        json         a JSON Schema (dict or its JSON text): the output is a document it validates
        regex        the whole output matches this regular expression
        choice       the output is one of these strings
        grammar      an EBNF grammar (GBNF notation, `root ::= ...`)
        json_object  True: any JSON object (OpenAI's response_format={"type": "json_object"})
    disable_any_whitespace: JSON without optional whitespace (compact: fewer tokens, one spelling)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name) is not None]
        if len(given) != 1:     # vLLM's two messages
            raise ValueError("You can only use one kind of structured outputs constraint but multiple are specified: "
                             f"{given}" if given else "You must use one kind of structured outputs constraint but none "
                             "are specified")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON Schema (dict or JSON text), got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty EBNF text, got {self.grammar!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True when given, got {self.json_object!r}")


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
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    # __post_init__ normalises `stop` to a list[str] and `stop_token_ids` to a list[int].
    # Filled by the engine's Processor (vLLM: update_from_generation_config / update_from_tokenizer)
    # on its own copy of the params: every id that ends a request, EOS included (min_tokens masks
    # them), and the token ids of each bad word.
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False, compare=False)

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
        for name in ("logprobs", "prompt_logprobs"):
            # (How many the engine gives is its max_logprobs, vLLM's limit: the Processor checks it.)
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or k < -1):
                raise ValueError(f"{name} must be None, -1 (the whole vocabulary) or an integer >= 0, got {k!r}")
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

        self._verify_logits_processors()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            if not isinstance(self.structured_outputs, dict):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                                 f"got {type(self.structured_outputs).__name__}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.n > 1 and self.temperature < _SAMPLING_EPS:
            raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got n={self.n}")

        if self.temperature < _SAMPLING_EPS:
            # Greedy ignores the filters; reset them so that the sampler's "all greedy" fast path
            # and batch-level flags (vLLM: SamplingParams._verify_greedy_sampling) see plain values.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _verify_logits_processors(self) -> None:
        """vLLM's ranges (SamplingParams._verify_args); ids against the vocabulary are checked by
        the engine's Processor, which knows the vocabulary."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and _is_real(b) and math.isfinite(b) for t, b in self.logit_bias.items()):
                raise ValueError(f"logit_bias must be a dict {{token id (int): finite bias}}, got {self.logit_bias!r}")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}")
            self.bad_words = list(words) or None

    @property
    def uses_logits_processors(self) -> bool:
        """Anything between the raw logits and the temperature (the sampler skips it all when no row does)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_tokens > 0 or self.logit_bias is not None or self.allowed_token_ids is not None
                or self.bad_words is not None)

    def update_from_model(self, eos_token_ids, tokenizer=None) -> None:
        """What the engine knows and the user did not say (vLLM: update_from_generation_config and
        update_from_tokenizer): every stop id (EOS always: min_tokens masks it even with
        ignore_eos, as vLLM's MinTokensLogitsProcessor does) and each bad word's token ids —
        the word as written and after a space, because a BPE tokenizer spells a word at the
        start of a text differently from one in the middle ("Paris" vs " Paris")."""
        self._all_stop_token_ids = frozenset(self.stop_token_ids) | frozenset(eos_token_ids)
        if not self.bad_words:
            return
        if tokenizer is None:
            raise ValueError("bad_words need the engine's tokenizer")
        spellings: list[tuple[int, ...]] = []
        for word in self.bad_words:
            plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            spellings.append(plain)
            # vLLM keeps the spaced spelling only when it is a different word of the same length.
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                spellings.append(spaced)
        self._bad_words_token_ids = tuple(spellings)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED
