"""The seam through which structured output reaches the engine (vLLM: `vllm/v1/structured_output/backend_types.py`).

Chapter 07 declares WHAT a grammar backend does; chapter 08 (`structured_output`) builds one from
scratch, and real xgrammar is another. The engine never imports a backend statically: it names one
(`EngineConfig.structured_outputs_backend`) and `load_backend` finds it in `BACKENDS`, the way vLLM's
`StructuredOutputManager` picks `backend_xgrammar.py` / `backend_guidance.py` / `backend_outlines.py`.

Two objects, vLLM's split:
  * a `StructuredOutputBackend` per engine compiles a request's spec (a JSON schema, a regex, a
    list of choices, a grammar) into ...
  * a `StructuredOutputGrammar` per request: an automaton over TOKENS that the core advances with
    every accepted token, asks for the next step's allowed tokens (`fill_bitmask`), checks drafts
    against (`validate_tokens`) and winds back (`rollback`, for rejected drafts).

The bitmask is vLLM's packed layout: int32 words, `cdiv(vocab_size, 32)` per row; token t is allowed
when bit (t % 32) of word (t // 32) is set. The runner turns it into -inf logits before sampling.
"""
from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from typing import Any

import torch


class StructuredOutputOptions(enum.Enum):
    JSON = enum.auto()            # a JSON schema (a string or a dict)
    JSON_OBJECT = enum.auto()     # any JSON object (OpenAI's response_format={"type": "json_object"})
    REGEX = enum.auto()
    GRAMMAR = enum.auto()         # an EBNF grammar (GBNF's notation, as xgrammar reads it)
    CHOICE = enum.auto()          # one of a list of strings


# (kind, spec text, any whitespace): what a backend compiles; requests with equal keys share its work.
StructuredOutputKey = tuple[StructuredOutputOptions, str, bool]


def structured_output_key(params) -> StructuredOutputKey:
    """The key of a request's `StructuredOutputsParams` (sampling_params.py)."""
    import json
    ws = not params.disable_any_whitespace
    if params.json is not None:
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return StructuredOutputOptions.JSON, spec, ws
    if params.json_object:
        return StructuredOutputOptions.JSON_OBJECT, "", ws
    if params.choice is not None:
        return StructuredOutputOptions.CHOICE, json.dumps(params.choice), ws
    if params.regex is not None:
        return StructuredOutputOptions.REGEX, params.regex, ws
    return StructuredOutputOptions.GRAMMAR, params.grammar, ws


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: 32 tokens per word."""
    return (vocab_size + 31) // 32


class StructuredOutputGrammar(ABC):
    """One request's automaton over token ids (vLLM's method names and meanings)."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over `tokens`; False (and no advance past the bad token) when one is not allowed."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar allows from here, WITHOUT advancing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write the allowed next tokens into row `batch_index` of `bitmask` [rows, words] int32."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token (or can take nothing more)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state."""


class StructuredOutputBackend(ABC):
    """An engine's grammar compiler, for one tokenizer and vocabulary size (the model's, which may
    exceed the tokenizer's: rows past it are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int] | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = set(eos_token_ids or ())

    @abstractmethod
    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str,
                        any_whitespace: bool = True) -> StructuredOutputGrammar:
        """A fresh per-request grammar for `grammar_spec` (JSON: the schema's JSON text; CHOICE: the
        choices as a JSON list; JSON_OBJECT: ""). `any_whitespace=False`: JSON without optional
        whitespace. ValueError (naming what is wrong) if it cannot be compiled — the request is
        refused, nothing else is affected."""

    @classmethod
    def validate_grammar(cls, request_type: StructuredOutputOptions, grammar_spec: str, any_whitespace: bool = True) -> None:
        """ValueError if `grammar_spec` cannot be compiled; needs no tokenizer, so the front end calls
        it before a request is queued (vLLM: Processor._validate_structured_output)."""

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """[max_num_seqs, words] int32, all tokens allowed (-1 = every bit set)."""
        return torch.full((max_num_seqs, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)

    def destroy(self) -> None:
        """Release what the backend holds (compile caches, worker threads)."""


# Backend name -> "module:Class". Chapter 08 registers nothing here at import time: the engine looks
# the name up when the first structured request arrives, so an engine without one never imports it.
BACKENDS = {
    "from_scratch": "structured_output.backend:FromScratchBackend",
    "xgrammar": "structured_output.backend_xgrammar:XgrammarBackend",
}
DEFAULT_BACKEND = "from_scratch"


def backend_class(name: str) -> type[StructuredOutputBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown structured output backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"structured output backend {name!r} cannot be loaded: {e}") from e
    return getattr(mod, cls)


def load_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: set[int] | None = None
                 ) -> StructuredOutputBackend:
    return backend_class(name)(tokenizer, vocab_size, eos_token_ids)


def validate_structured_outputs(backend_name: str, params) -> None:
    """Refuse a request's StructuredOutputsParams its backend cannot compile (ValueError naming why)."""
    request_type, spec, any_whitespace = structured_output_key(params)
    backend_class(backend_name).validate_grammar(request_type, spec, any_whitespace)


DEAD_END = ("structured output: no token of the vocabulary can continue the constrained text here "
            "(the grammar needs bytes no token spells)")


def apply_grammar_bitmask(grammar_output, req_ids: list[str], num_rows: list[int], logits: torch.Tensor,
                          failed: dict[str, str] | None = None) -> None:
    """The runner's one job in structured output (vLLM: `vllm/v1/structured_output/utils.py:
    apply_grammar_bitmask`): -inf on the logits of every token a request's grammar does not allow.
    `logits` [sum(num_rows), V] holds `num_rows[j]` consecutive rows for request `req_ids[j]` (1, or
    1 + its drafts when a step verifies drafts); the masks are `grammar_output.request_rows`' rows in
    the same order. Rows of unconstrained requests are left alone. The op is chapter 08's kernel
    (looked up by name: chapter 07 does not import chapter 08). A request whose grammar has no way on
    (`dead_ends`) goes into `failed` with the reason (its rows were left unmasked: they sample
    safely, and the scheduler drops what they sample)."""
    if grammar_output is None:
        return
    if failed is not None and grammar_output.dead_ends:
        for req_id in grammar_output.dead_ends.intersection(req_ids):
            failed[req_id] = DEAD_END
    logits_rows, mask_rows, start = [], [], 0
    for req_id, n in zip(req_ids, num_rows):
        first = grammar_output.request_rows.get(req_id)
        if first is not None:
            logits_rows.extend(range(start, start + n))
            mask_rows.extend(range(first, first + n))
        start += n
    if not logits_rows:
        return
    bitmask = grammar_output.bitmask[mask_rows].to(logits.device, non_blocking=True)     # [R, words]
    ops = importlib.import_module("structured_output.ops")
    ops.apply_token_bitmask_inplace(logits, bitmask, indices=logits_rows, backend=_bitmask_backend(logits.device))


def _bitmask_backend(device: torch.device) -> str:
    """Chapter 08's kernel for this device: Triton on a GPU, the C++ one on a CPU (its vectorised
    torch op where no compiler is)."""
    if device.type == "cuda":
        return "triton"
    return "cpu" if importlib.import_module("structured_output.cpu_ops").is_available() else "torch"
