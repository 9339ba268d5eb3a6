"""N-gram prompt lookup: draft the tokens that followed the last time the context's tail appeared.

Mirrors vLLM's `vllm/v1/spec_decode/ngram_proposer.py` (`NgramProposer`,
`_find_longest_matched_ngram_and_propose_tokens`, config `prompt_lookup_min`,
`prompt_lookup_max`, `num_speculative_tokens`).

Why it works: when output copies input — editing code, quoting a document, filling a
template, repeating a list — the next tokens already exist in the context. No model, no
KV cache, no training: the drafter costs a string search.

The rule (vLLM's, exactly): among the context's suffixes of length n in
[prompt_lookup_min, prompt_lookup_max], take the LONGEST that also occurs earlier in the
context (an occurrence may overlap the suffix but must end before the last token); among
the occurrences of that length take the EARLIEST; propose the up-to-k tokens that follow
it (fewer if the context ends first, none past max_model_len). vLLM finds it with a KMP
pass over the reversed context (numba); `find_ngram_reference` is the plain double loop
and `find_ngram` the numpy version used by the proposer:

    1. candidates = every earlier position e whose token equals the last token
       (one vectorised comparison over the context);
    2. compare every candidate's max_n preceding tokens with the suffix in one gather
       ([candidates, max_n]); a candidate's match length is its leading run of Trues;
    3. the earliest candidate with the longest length wins.
Cost: O(L) for step 1 + O(#candidates x max_n), in a fixed handful of numpy calls.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from spec_decode.proposer import DraftRequest, check_num_speculative_tokens, draft_budget


def _check_lookup(min_n: int, max_n: int) -> None:
    if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n!r} and {max_n!r}")


def _draft_len(num_tokens: int, start: int, k: int, max_model_len: int | None) -> int:
    if max_model_len is not None:
        k = min(k, max_model_len - num_tokens)         # never draft past the model's length
    return max(0, min(k, num_tokens - start))


def find_ngram_reference(tokens: Sequence[int], min_n: int, max_n: int, k: int,
                         max_model_len: int | None = None) -> list[int]:
    """The readable search: longest suffix first, earliest occurrence first."""
    _check_lookup(min_n, max_n)
    tokens = list(tokens)
    L = len(tokens)
    ### BEGIN SOLUTION
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for s in range(0, L - n):                      # occurrences ending at or before L - 2
            if tokens[s:s + n] == suffix:
                start = s + n
                return tokens[start:start + _draft_len(L, start, k, max_model_len)]
    return []
    ### END SOLUTION


def find_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int, max_model_len: int | None = None) -> np.ndarray:
    """Vectorised numpy search, same answer as find_ngram_reference. tokens: 1-D int array."""
    L = tokens.shape[0]
    empty = tokens[:0]
    if L < min_n + 1:
        return empty
    ### BEGIN SOLUTION
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])     # earlier positions matching the last token
    if ends.size == 0:
        return empty
    n = min(max_n, L - 1)
    back = ends[:, None] - np.arange(n)                        # [cands, n]: e, e-1, ..., e-n+1
    suffix = tokens[L - 1 - np.arange(n)]                      # [n]: last, second to last, ...
    same = (tokens[np.maximum(back, 0)] == suffix) & (back >= 0)
    length = np.logical_and.accumulate(same, axis=1).sum(axis=1)   # [cands] match length ending at e
    best = int(length.max())
    if best < min_n:
        return empty
    start = int(ends[np.argmax(length == best)]) + 1           # the earliest of the longest
    ### END SOLUTION
    return tokens[start:start + _draft_len(L, start, k, max_model_len)]


class NgramProposer:
    """Prompt-lookup drafter (vLLM: NgramProposer). Stateless: nothing to free.

    propose(requests) -> per request up to num_speculative_tokens drafts (none when the
    context's tail never occurred before — speculation then costs nothing that step).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4,
                 max_model_len: int | None = None):
        self.num_speculative_tokens = check_num_speculative_tokens(num_speculative_tokens)
        _check_lookup(prompt_lookup_min, prompt_lookup_max)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose_one(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        k = self.num_speculative_tokens if k is None else min(k, self.num_speculative_tokens)
        if k <= 0:
            return []
        return find_ngram(tokens, self.min_n, self.max_n, k, self.max_model_len).tolist()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.propose_one(r.token_ids, draft_budget(r, self.num_speculative_tokens)) for r in requests]

    def propose_batch(self, token_ids_cpu: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """vLLM's layout: the persistent batch's [batch, max_model_len] token table and each
        row's verified length (num_tokens_no_spec)."""
        return [self.propose_one(token_ids_cpu[i, :int(n)]) for i, n in enumerate(num_tokens)]

    def remove_requests(self, req_ids: Sequence[str]) -> None:
        pass
