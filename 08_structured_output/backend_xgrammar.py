"""Real xgrammar behind the engine's seam: the peer this chapter's automata are measured against.

vLLM's default structured-output backend is xgrammar (`vllm/v1/structured_output/backend_xgrammar.py`:
`XgrammarBackend.compile_grammar` -> `XgrammarGrammar` wrapping a `GrammarMatcher`). This is the same
adapter on our engine's interface (mini_vllm/structured_output_backend.py), so the SAME engine runs a
constrained request with either backend: `LLM(..., structured_outputs_config={"backend": "xgrammar"})`.
The tests use it as an oracle (the two backends allow the same tokens, so greedy outputs agree) and
the benchmark as the speed peer.
"""
from __future__ import annotations

import json

import torch
import xgrammar as xgr

from mini_vllm.structured_output_backend import (StructuredOutputBackend, StructuredOutputGrammar,
                                                 StructuredOutputOptions)


def _separators(any_whitespace: bool) -> tuple[str, str] | None:
    """vLLM's: without whitespace, no space after "," and ":" either (xgrammar's default would add one)."""
    return None if any_whitespace else (",", ":")


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.num_processed_tokens = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for n, token in enumerate(tokens):
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, batch_index)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int] | None = None):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        stop = sorted(self.eos_token_ids) or None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=True)

    @classmethod
    def validate_grammar(cls, request_type: StructuredOutputOptions, grammar_spec: str, any_whitespace: bool = True) -> None:
        O = StructuredOutputOptions
        try:
            if request_type == O.JSON:
                xgr.Grammar.from_json_schema(grammar_spec, any_whitespace=any_whitespace, separators=_separators(any_whitespace))
            elif request_type == O.REGEX:
                xgr.Grammar.from_regex(grammar_spec)
            elif request_type == O.GRAMMAR:
                xgr.Grammar.from_ebnf(grammar_spec)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"xgrammar cannot compile this {request_type.name.lower()}: {e}") from e

    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str,
                        any_whitespace: bool = True) -> StructuredOutputGrammar:
        O = StructuredOutputOptions
        try:
            if request_type == O.JSON:
                compiled = self.compiler.compile_json_schema(grammar_spec, any_whitespace=any_whitespace,
                                                             separators=_separators(any_whitespace))
            elif request_type == O.JSON_OBJECT:
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                             separators=_separators(any_whitespace))
            elif request_type == O.REGEX:
                compiled = self.compiler.compile_regex(grammar_spec)
            elif request_type == O.CHOICE:
                from structured_output.json_schema import choice_regex
                compiled = self.compiler.compile_regex(choice_regex(json.loads(grammar_spec)))
            elif request_type == O.GRAMMAR:
                compiled = self.compiler.compile_grammar(grammar_spec)
            else:
                raise ValueError(f"unsupported structured output type {request_type}")
        except RuntimeError as e:          # xgrammar reports bad specs as RuntimeError
            raise ValueError(f"xgrammar cannot compile this {request_type.name.lower()}: {e}") from e
        return XgrammarGrammar(xgr.GrammarMatcher(compiled), self.vocab_size)

    def destroy(self) -> None:
        self.compiler.clear_cache()
