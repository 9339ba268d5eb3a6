"""Which tokens may come next: the PDA's answer for a whole vocabulary, and xgrammar's trick to make it fast.

The plain way (`TokenMasker.plain_mask`) runs every token's bytes through the PDA from the current
state. The vocabulary is stored as a byte trie (`VocabTrie`), so tokens sharing a prefix share its
steps and a dead prefix rejects its whole subtree at once (llama.cpp's grammar sampler also checks
the candidates that share a prefix together). It is the reference the fast way is checked against,
and it is slow in Python: inside a JSON string it visits all ~100k nodes of SmolLM2's trie.

The fast way is xgrammar's central idea (Dong et al. 2024, "XGrammar", the "adaptive token mask
cache"): split the vocabulary, per automaton position, into
  * context-INDEPENDENT tokens: standing on node n of rule R, the token is accepted or rejected by R
    alone (R and what R calls), whatever stack lies below R's frame. E.g. inside a JSON string,
    `hello` is accepted and `\\q` rejected, at any nesting depth;
  * context-DEPENDENT tokens: R can finish partway through the token, so the rest of its bytes are read
    by whichever rule called R: only the real stack can tell. Inside a JSON string, `"}` is accepted
    when the string is a member's value and rejected when it is an element of an array.
The split is computed once per node (`classify`, cached; the same for every request of this grammar),
walking the trie with a PROBE frame whose "below" is unknown. At run time only the dependent tokens of
the current stacks' top nodes are walked through the full PDA (`split_mask`).
"""
from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache

import numpy as np
import torch

from mini_vllm.structured_output_backend import StructuredOutputGrammar
from structured_output.token_index import pack_bits
from structured_output.pda import DEAD, PDA, PROBE, PDAMatcher


class VocabTrie:
    """The vocabulary's byte strings in a trie. Tokens are numbered in sorted byte order, so every node's
    subtree is a contiguous slice of `order` and a whole subtree is marked by one slice assignment.
    Tokens with no bytes (special tokens: None, or b"") are left out: the grammar never allows them."""

    def __init__(self, token_bytes: list[bytes | None]):
        ids = sorted((t for t, b in enumerate(token_bytes) if b), key=lambda t: token_bytes[t])
        self.vocab_size = len(token_bytes)
        self.order = np.array(ids, dtype=np.int64)           # sorted position -> token id
        self.children: list[list[tuple[int, int]]] = [[]]    # node -> [(byte, child node)]
        self.lo, self.end, self.hi = [0], [0], [0]           # order[lo:end] end at the node, order[lo:hi] below it
        path, prev = [0], b""                                # path[d]: the node of the current prefix of length d
        for pos, t in enumerate(ids):
            data = token_bytes[t]
            common = _common_prefix(prev, data)
            for node in path[common + 1:]:                   # leaving these nodes' subtrees for good
                self.hi[node] = pos
            del path[common + 1:]
            for byte in data[common:]:
                child = len(self.children)
                self.children.append([])
                self.lo.append(pos)
                self.end.append(pos)
                self.hi.append(pos)
                self.children[path[-1]].append((byte, child))
                path.append(child)
            self.end[path[-1]] = pos + 1                     # equal byte strings sort next to each other
            prev = data
        for node in path:
            self.hi[node] = len(ids)

    @property
    def num_nodes(self) -> int:
        return len(self.children)

    def to_token_mask(self, sorted_mask: np.ndarray) -> np.ndarray:
        """A mask over sorted positions -> a mask over token ids."""
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[self.order[sorted_mask]] = True
        return mask


@lru_cache(maxsize=4)
def shared_vocab_trie(token_bytes: tuple[bytes | None, ...]) -> "VocabTrie":
    """The vocabulary's trie, built once per vocabulary (~0.3 s for 49k tokens), not per grammar."""
    return VocabTrie(list(token_bytes))


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TokenMasker:
    """Token masks of one grammar (a PDA) for one vocabulary; the per-node split is cached here."""

    def __init__(self, pda: PDA, token_bytes: list[bytes | None]):
        self.pda = pda
        self.token_bytes = token_bytes
        self.trie = shared_vocab_trie(tuple(token_bytes))     # one per vocabulary, shared by its grammars
        self._split: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # node -> (accepted mask, dependent ids)
        self.last_walked = 0          # dependent tokens walked through the full PDA by the last split_mask
        # PDA state -> its packed bitmask row: states are interned, and a generation revisits the same
        # few (inside a string, after a comma at one depth), so most steps are one lookup + one copy.
        self._rows: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    # -- the reference: every token through the PDA --
    def plain_mask(self, state: int) -> np.ndarray:
        """bool[vocab]: the tokens whose bytes the PDA accepts from `state`."""
        trie, step = self.trie, self.pda.step
        ok = np.zeros(len(trie.order), dtype=bool)
        todo = [(0, state)]
        while todo:
            node, st = todo.pop()
            for byte, child in trie.children[node]:
                nxt = step(st, byte)
                if nxt != DEAD:
                    ok[trie.lo[child]:trie.end[child]] = True
                    if trie.children[child]:
                        todo.append((child, nxt))
        return trie.to_token_mask(ok)

    # -- the split --
    def classify(self, node: int) -> tuple[np.ndarray, np.ndarray]:
        """For a frame standing on `node`: (bool[vocab] of tokens accepted whatever lies below,
        token ids that only the real stack can decide). Every other token is rejected. Cached."""
        if node not in self._split:
            self._split[node] = self._classify(node)
        return self._split[node]

    def precompute(self) -> None:
        """Classify every node that can read a byte now, as xgrammar does when it compiles a grammar,
        instead of on first use."""
        for node, n in enumerate(self.pda.nodes):
            if n.edges:
                self.classify(node)

    def _classify(self, node: int) -> tuple[np.ndarray, np.ndarray]:
        trie, pda = self.trie, self.pda
        accepted = np.zeros(len(trie.order), dtype=bool)
        dependent = np.zeros(len(trie.order), dtype=bool)
        # Walk the trie from a lone frame on `node`. `ended`: on this path the frame's rule could have
        # finished before the current byte, handing the rest of the token to an unknown caller.
        todo = [(0, pda.probe_state(node), False)]
        while todo:
            tnode, st, ended = todo.pop()
            ended = ended or PROBE in pda.stacks(st)
            for byte, child in trie.children[tnode]:
                nxt = pda.step(st, byte)
                if nxt != DEAD:
                    # Alive inside the rule (or the rule ended exactly at the token's end): accepted
                    # under any stack, because below the frame nothing was touched.
                    accepted[trie.lo[child]:trie.end[child]] = True
                    if trie.children[child]:
                        todo.append((child, nxt, ended))
                elif ended:
                    # Rejected inside the rule, but the rule might have ended earlier on this path and
                    # its caller might read these bytes: the whole subtree depends on the stack.
                    dependent[trie.lo[child]:trie.hi[child]] = True
                # else: rejected here whatever the stack: the whole subtree is context-independent too
        return trie.to_token_mask(accepted), np.sort(trie.order[dependent])

    def split_mask(self, state: int) -> np.ndarray:
        """bool[vocab], equal to plain_mask(state): the precomputed classes of each stack's top node,
        plus the dependent tokens walked from that one stack through the full PDA."""
        pda = self.pda
        mask = np.zeros(self.trie.vocab_size, dtype=bool)
        walked = 0
        for s in pda.stacks(state):
            if not pda.nodes[pda.top[s]].edges:          # only says "the root may end": no token
                continue
            accepted, dependent = self.classify(pda.top[s])
            mask |= accepted
            todo = dependent[~mask[dependent]]           # another stack may have accepted them already
            walked += len(todo)
            single = pda.single_stack_state(s)
            for t in todo.tolist():
                if pda.advance(single, self.token_bytes[t]) != DEAD:
                    mask[t] = True
        self.last_walked = walked
        return mask


MAX_CACHED_ROWS = 4096                  # x 6 KiB for SmolLM2's vocabulary: 24 MiB at most per grammar


def cached_row(masker: TokenMasker, key: tuple, compute) -> torch.Tensor:
    """The packed row for `key` (a PDA state and what else decides the row), computed once, LRU-bounded."""
    rows = masker._rows
    row = rows.get(key)
    if row is None:
        row = rows[key] = compute()
        if len(rows) > MAX_CACHED_ROWS:
            rows.popitem(last=False)
    else:
        rows.move_to_end(key)
    return row


class PDAGrammar(StructuredOutputGrammar):
    """One request's grammar state, vLLM's `StructuredOutputGrammar` (the xgrammar backend's
    `XgrammarGrammar` wraps a GrammarMatcher the same way). Stop tokens are not bytes of the output:
    one is allowed only where the root rule may end, and accepting it terminates the grammar."""

    def __init__(self, masker: TokenMasker, vocab_size: int, eos_token_ids, use_split: bool = True):
        self.masker, self.vocab_size, self.use_split = masker, vocab_size, use_split
        self.eos_token_ids = frozenset(eos_token_ids)
        self.matcher = PDAMatcher(masker.pda)
        self._terminated = False

    def _accept_one(self, token: int) -> bool:
        if self._terminated:
            return False
        if token in self.eos_token_ids:
            self._terminated = self.matcher.can_end()
            return self._terminated
        data = self.masker.token_bytes[token] if 0 <= token < len(self.masker.token_bytes) else None
        return bool(data) and self.matcher.accept_bytes(data)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return all(self._accept_one(t) for t in tokens)     # all() stops at the first refusal

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        n = 0
        while n < len(tokens) and self._accept_one(tokens[n]):
            n += 1
        self.rollback(n)                                    # look, but do not move
        return tokens[:n]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:                 # the stop token is always the last one
            self._terminated = False
            num_tokens -= 1
        self.matcher.rollback(num_tokens)

    def allowed_tokens(self) -> np.ndarray:
        """bool[vocab_size]: what fill_bitmask writes. After termination only the stop tokens."""
        allowed = np.zeros(self.vocab_size, dtype=bool)
        if not self._terminated:
            state = self.matcher.state
            mask = self.masker.split_mask(state) if self.use_split else self.masker.plain_mask(state)
            n = min(len(mask), self.vocab_size)
            allowed[:n] = mask[:n]
        eos = sorted(t for t in self.eos_token_ids if t < self.vocab_size)
        allowed[eos] = self._terminated or self.matcher.can_end()
        return allowed

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        words = bitmask.shape[1]
        if self._terminated:
            bitmask[batch_index].copy_(pack_bits(self.allowed_tokens(), words))
            return
        key = (self.matcher.state, self.vocab_size, self.eos_token_ids, words, self.use_split)
        bitmask[batch_index].copy_(cached_row(self.masker, key, lambda: pack_bits(self.allowed_tokens(), words)))

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self.matcher.reset()
        self._terminated = False
