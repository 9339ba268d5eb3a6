"""The token index: for a DFA state, WHICH TOKENS may come next — the mask a structured request
applies to the logits at every step.

A token is allowed in state s when its whole byte string can be walked from s without dying
(every DFA state is live, so the output can still be completed afterwards), and EOS is allowed
exactly in accepting states. This is outlines-core's `Index` (`src/index.rs`) idea; vLLM's
outlines backend builds that index for every state up front, which costs seconds for a JSON
schema over a 100k-token vocabulary. Here the index is LAZY: a state's row is computed the first
time a request reaches it and cached, so a state no generation visits costs nothing.

Two ways to compute one state's set, kept side by side and tested equal:
  * the readable reference — walk every token from s (`allowed_token_ids_loop`): vocab x length;
  * a BYTE TRIE over the vocabulary (`ByteTrie`): tokens sharing a prefix share a path, so one
    walk of the trie alongside the DFA reads every shared prefix once, and a prefix that dies
    prunes every token below it at once (`allowed_token_ids`). In a state that only allows
    digits, the walk stops after the root's children instead of touching 49k tokens; and since
    it goes one trie LEVEL at a time, each level is a handful of numpy operations, not a
    Python loop over nodes (a state inside a JSON string allows ~all 49k tokens: ~10 ms).

The result is packed into vLLM's bitmask row: int32 words, `(vocab_size + 31) // 32` of them;
token t is allowed iff bit t % 32 of word t // 32 is set (bit 31 is the sign bit of the int32).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from mini_vllm.structured_output_backend import bitmask_words
from structured_output.regex_dfa import DEAD, DFA


class ByteTrie:
    """The vocabulary's byte strings as a trie, stored as flat arrays so that a whole LEVEL of it
    is expanded with a few numpy operations. Nodes are numbered breadth-first (root = 0), which
    makes the children of node n the consecutive nodes first_child[n] .. first_child[n+1]-1;
    node_byte[k] is the byte on the edge into node k. The tokens whose bytes end at node n are
    token_ids[token_start[n]:token_start[n+1]] (several ids can share one byte string).
    Tokens with no bytes (special tokens: None) are left out, and so are empty ones: a token that
    emits nothing would let a model loop without progress."""

    def __init__(self, token_bytes: Sequence[bytes | None], vocab_size: int):
        self.token_bytes, self.vocab_size = token_bytes, vocab_size
        children: list[dict[int, int]] = [{}]           # 1. a plain dict trie
        ends: list[list[int]] = [[]]
        for token_id, data in enumerate(token_bytes[:vocab_size]):   # ids >= vocab_size: never sampled
            if not data:
                continue
            node = 0
            for byte in data:
                child = children[node].get(byte)
                if child is None:
                    child = children[node][byte] = len(children)
                    children.append({})
                    ends.append([])
                node = child
            ends[node].append(token_id)
        order, node_byte, sizes = [0], [0], []           # 2. renumber breadth-first
        for node in order:                               # (`order` grows while we iterate)
            kids = sorted(children[node].items())        # [(byte, child)]
            sizes.append(len(kids))
            order.extend(child for _, child in kids)
            node_byte.extend(byte for byte, _ in kids)
        self.node_byte = np.array(node_byte, dtype=np.int64)                   # [num_nodes]
        self.num_children = np.array(sizes, dtype=np.int64)                    # [num_nodes]
        self.first_child = np.concatenate([[1], 1 + np.cumsum(sizes)])         # [num_nodes + 1]
        self.token_start = np.concatenate([[0], np.cumsum([len(ends[old]) for old in order])])
        self.token_ids = np.array([t for old in order for t in ends[old]], dtype=np.int64)

    @property
    def num_nodes(self) -> int:
        return len(self.node_byte)


@lru_cache(maxsize=4)
def shared_trie(token_bytes: tuple[bytes | None, ...], vocab_size: int) -> ByteTrie:
    """One trie per vocabulary, shared by every grammar compiled for it."""
    return ByteTrie(token_bytes, vocab_size)


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """concatenate(arange(s, s + c) for s, c in zip(starts, counts)), without a Python loop."""
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets


def allowed_token_ids(table: np.ndarray, trie: ByteTrie, state: int) -> np.ndarray:
    """Every token id whose bytes can be walked from `state` (EOS not included). `table` is the
    DFA's transitions as an int array [num_states, 256]. The trie is walked level by level: the
    frontier holds the trie nodes (prefixes) still alive and the DFA state each one reached;
    a prefix that dies is dropped, and with it every token below it."""
    ### BEGIN SOLUTION
    nodes = np.array([0])                              # [frontier] trie nodes, start at the root
    states = np.array([state])                         # [frontier] DFA state after each node's prefix
    found = []
    while nodes.size:
        first, counts = trie.first_child[nodes], trie.num_children[nodes]
        child = ragged_arange(first, counts)           # [edges] every child of the frontier
        nxt = table[np.repeat(states, counts), trie.node_byte[child]]   # [edges] DFA state after its byte
        alive = nxt != DEAD
        nodes, states = child[alive], nxt[alive]       # the next level: living prefixes only
        starts = trie.token_start[nodes]               # tokens that end exactly at a living node
        found.append(trie.token_ids[ragged_arange(starts, trie.token_start[nodes + 1] - starts)])
    ### END SOLUTION
    return np.concatenate(found)


def allowed_token_ids_loop(dfa: DFA, token_bytes: Sequence[bytes | None], vocab_size: int, state: int) -> list[int]:
    """The reference: walk every token on its own."""
    return [t for t, data in enumerate(token_bytes[:vocab_size]) if data and dfa.walk(state, data) != DEAD]


def pack_bits(allowed: np.ndarray, num_words: int | None = None) -> torch.Tensor:
    """bool [n] -> int32 [num_words] (default: n / 32): bit t % 32 of word t // 32 (little-endian
    bytes, so byte k of the packed array holds tokens 8k..8k+7 and four bytes make one word); tokens
    past `allowed` are 0. The fast form of reference.pack_bitmask (one row, numpy)."""
    if num_words is not None and len(allowed) != num_words * 32:
        bits = np.zeros(num_words * 32, dtype=bool)
        n = min(len(allowed), len(bits))
        bits[:n] = allowed[:n]
        allowed = bits
    packed = np.packbits(allowed, bitorder="little").view("<i4")
    return torch.from_numpy(packed.astype(np.int32))


class TokenIndex:
    """Allowed tokens and token transitions of one DFA over one vocabulary, computed lazily per state.

    token_bytes: the vocabulary (structured_output.vocabulary.token_bytes), or a ByteTrie already
        built from it; vocab_size: the MODEL's (may exceed the tokenizer's: the extra ids are
        never allowed); eos_token_ids: allowed exactly in accepting states."""

    def __init__(self, dfa: DFA, token_bytes: Sequence[bytes | None] | ByteTrie, vocab_size: int,
                 eos_token_ids=()):
        if isinstance(token_bytes, ByteTrie):
            if token_bytes.vocab_size != vocab_size:
                raise ValueError(f"the trie was built for vocab_size {token_bytes.vocab_size}, not {vocab_size}")
            self.trie = token_bytes
        else:
            self.trie = shared_trie(tuple(token_bytes), vocab_size)
        self.dfa, self.vocab_size = dfa, vocab_size
        self.eos_token_ids = frozenset(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.words = bitmask_words(vocab_size)
        self.table = np.array(dfa.transitions, dtype=np.int64).reshape(-1, 256)   # [num_states, 256]
        self._rows: dict[int, torch.Tensor] = {}     # state -> packed row, filled on first use
        self._counts: dict[int, int] = {}            # state -> number of allowed tokens

    @property
    def start(self) -> int:
        return self.dfa.start

    def is_accepting(self, state: int) -> bool:
        return state in self.dfa.accepting

    def allowed(self, state: int) -> torch.Tensor:
        """int32 [words]: the packed mask of the tokens allowed in `state` (cached; do not modify)."""
        row = self._rows.get(state)
        if row is None:
            if not self.dfa.live(state):
                raise ValueError(f"state {state} is not a state of this DFA")
            bits = np.zeros(self.words * 32, dtype=bool)
            bits[allowed_token_ids(self.table, self.trie, state)] = True
            bits[sorted(self.eos_token_ids)] = self.is_accepting(state)
            row = self._rows[state] = pack_bits(bits)
            self._counts[state] = int(bits.sum())
        return row

    def num_allowed(self, state: int) -> int:
        """How many tokens `state` allows (0: the vocabulary cannot continue from here)."""
        self.allowed(state)
        return self._counts[state]

    def next_state(self, state: int, token_id: int) -> int:
        """The DFA state after `token_id`, -1 if it is not allowed. EOS reads no bytes: it keeps
        an accepting state where it is."""
        if token_id in self.eos_token_ids:
            return state if self.is_accepting(state) else DEAD
        if not 0 <= token_id < min(self.vocab_size, len(self.trie.token_bytes)) or state == DEAD:
            return DEAD
        data = self.trie.token_bytes[token_id]
        return self.dfa.walk(state, data) if data else DEAD

    @property
    def num_cached_states(self) -> int:
        return len(self._rows)
