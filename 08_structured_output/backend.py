"""This chapter behind the engine's seam: `LLM(..., structured_outputs_config={"backend": "from_scratch"})`.

vLLM keeps one module per backend (`vllm/v1/structured_output/backend_xgrammar.py`,
`backend_outlines.py`, `backend_guidance.py`), each a `StructuredOutputBackend` that compiles a
request's spec and hands back a per-request `StructuredOutputGrammar`. Ours routes each kind of spec
to the automaton that fits it, as outlines (regular languages) and xgrammar (context-free ones) do:

    json (a schema)   schema_to_regex -> compile_regex -> TokenIndex -> FSMGrammar
    regex, choice     compile_regex -> TokenIndex -> FSMGrammar
    grammar (EBNF)    parse_grammar -> compile_grammar (PDA) -> TokenMasker -> PDAGrammar
    json_object       the JSON grammar (nesting has no bound: not a regular language) -> PDAGrammar

Compiled automata and their token indexes are shared by every request with the same spec (a
cache keyed by the spec): the index fills lazily as requests visit states, so the second request
with a schema finds most of its masks ready. Everything runs on the engine's structured-output
thread (structured_output_manager.py), one call at a time.
"""
from __future__ import annotations

import json
from functools import lru_cache

from mini_vllm.structured_output_backend import (StructuredOutputBackend, StructuredOutputGrammar,
                                                 StructuredOutputOptions)
from structured_output.fsm_grammar import FSMGrammar
from structured_output.grammar import JSON_GRAMMAR, JSON_GRAMMAR_COMPACT, parse_grammar
from structured_output.json_schema import COMPACT_SEPARATORS, choice_regex, schema_to_regex
from structured_output.pda import compile_grammar
from structured_output.regex_dfa import compile_regex
from structured_output.token_index import TokenIndex
from structured_output.token_mask import PDAGrammar, TokenMasker
from structured_output.vocabulary import token_bytes

def spec_to_regex(request_type: StructuredOutputOptions, spec: str, any_whitespace: bool = True) -> str | None:
    """The regex of a regular spec (JSON schema, regex, choice); None for the context-free kinds."""
    O = StructuredOutputOptions
    if request_type == O.JSON:
        return schema_to_regex(spec, separators=None if any_whitespace else COMPACT_SEPARATORS)
    if request_type == O.REGEX:
        return spec
    if request_type == O.CHOICE:
        return choice_regex(json.loads(spec))
    return None


def spec_to_grammar(request_type: StructuredOutputOptions, spec: str, any_whitespace: bool = True) -> str:
    if request_type == StructuredOutputOptions.JSON_OBJECT:
        return JSON_GRAMMAR if any_whitespace else JSON_GRAMMAR_COMPACT
    return spec


class FromScratchBackend(StructuredOutputBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int] | None = None):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self.token_bytes = token_bytes(tokenizer)                 # [len(tokenizer)] bytes | None
        self._regex_index = lru_cache(maxsize=64)(self._build_index)
        self._grammar_masker = lru_cache(maxsize=16)(self._build_masker)

    @classmethod
    def validate_grammar(cls, request_type: StructuredOutputOptions, grammar_spec: str, any_whitespace: bool = True) -> None:
        """Parse (no tokenizer, no token index): what a bad spec fails on, before it is queued."""
        regex = spec_to_regex(request_type, grammar_spec, any_whitespace)
        if regex is not None:
            compile_regex(regex)
        else:
            parse_grammar(spec_to_grammar(request_type, grammar_spec, any_whitespace))

    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str,
                        any_whitespace: bool = True) -> StructuredOutputGrammar:
        regex = spec_to_regex(request_type, grammar_spec, any_whitespace)
        if regex is not None:
            return FSMGrammar(self._regex_index(regex))
        masker = self._grammar_masker(spec_to_grammar(request_type, grammar_spec, any_whitespace))
        return PDAGrammar(masker, self.vocab_size, self.eos_token_ids)

    def _build_index(self, regex: str) -> TokenIndex:
        return TokenIndex(compile_regex(regex), self.token_bytes, self.vocab_size, self.eos_token_ids)

    def _build_masker(self, grammar: str) -> TokenMasker:
        return TokenMasker(compile_grammar(grammar), self.token_bytes)

    def destroy(self) -> None:
        self._regex_index.cache_clear()
        self._grammar_masker.cache_clear()
