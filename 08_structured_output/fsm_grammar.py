"""FSMGrammar: one request's position in a regex / JSON-schema / choice automaton, behind the
engine's `StructuredOutputGrammar` interface (vLLM: `backend_outlines.py`'s `OutlinesGrammar`,
and `backend_xgrammar.py`'s `XgrammarGrammar` for the same methods on a grammar matcher).

All the knowledge lives in the shared, lazily filled `TokenIndex` (one per compiled spec); the
per-request object is just a HISTORY of DFA states: `states[i]` is the state after the first i
accepted tokens. That makes every operation small and exact:
  * accept_tokens   push one state per token; stop at the first token the index refuses
  * validate_tokens the same walk on a scratch variable: speculative drafts are checked without
                    moving the request
  * rollback(n)     pop n states — the scheduler undoes draft tokens the target model rejected
  * fill_bitmask    copy the index's cached row for the current state

EOS reads no bytes, so it does not move the DFA: accepting it pushes the same state again and
marks the request terminated (nothing at all is allowed afterwards). The history records that
flag per entry, so a rollback past the EOS un-terminates the request exactly.
"""
from __future__ import annotations

import torch

from mini_vllm.structured_output_backend import StructuredOutputGrammar
from structured_output.regex_dfa import DEAD
from structured_output.token_index import TokenIndex


class FSMGrammar(StructuredOutputGrammar):
    """One request's automaton over token ids, backed by a shared TokenIndex."""

    def __init__(self, index: TokenIndex):
        self.index = index
        self.states: list[tuple[int, bool]] = []       # (DFA state, terminated) after each token
        self.reset()

    @property
    def state(self) -> int:
        return self.states[-1][0]

    @property
    def num_processed_tokens(self) -> int:
        return len(self.states) - 1

    def _step(self, state: int, terminated: bool, token: int) -> tuple[int, bool] | None:
        """(next state, terminated) after `token`, or None if it is not allowed."""
        if terminated:
            return None                                 # after EOS nothing more is allowed
        nxt = self.index.next_state(state, token)
        if nxt == DEAD:
            return None
        return nxt, token in self.index.eos_token_ids

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            step = self._step(*self.states[-1], token)
            if step is None:
                return False                            # stay at the last good token
            self.states.append(step)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        current = self.states[-1]
        for i, token in enumerate(tokens):
            current = self._step(*current, token)
            if current is None:
                return tokens[:i]
        return list(tokens)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_processed_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.num_processed_tokens} were accepted")
        del self.states[len(self.states) - num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Row `batch_index` of bitmask [rows, words] int32 := the allowed next tokens."""
        if self.states[-1][1]:
            bitmask[batch_index].zero_()
        else:
            bitmask[batch_index].copy_(self.index.allowed(self.state))

    def is_terminated(self) -> bool:
        """EOS accepted. (A state no token can continue — the vocabulary cannot spell the bytes
        the language needs next — is not "terminated": its mask is empty, and the engine fails
        the request saying so.)"""
        return self.states[-1][1]

    def reset(self) -> None:
        self.states = [(self.index.start, False)]
