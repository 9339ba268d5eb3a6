"""The token index (structured_output.token_index) against outlines-core's `Index` and xgrammar's
`GrammarMatcher`, on SmolLM2's real 49,152-token vocabulary, along random accepted token paths.

Regex specs only: there the three languages are the same (JSON schemas differ in whitespace
conventions). Two documented disagreements, each pinned by its own test below:
  * xgrammar's `.` also matches a newline (Python's, Rust's and ours do not);
  * outlines-core 0.2.14 leaves out the tokens whose bytes but the last reach an accepting state
    while the whole token does not (`outlines_dropped`); xgrammar and we allow them.
"""
import random

import numpy as np
import outlines_core
import pytest
import torch
import xgrammar as xgr

from structured_output.json_schema import schema_to_regex
from structured_output.regex_dfa import compile_regex
from structured_output.token_index import (ByteTrie, TokenIndex, allowed_token_ids, allowed_token_ids_loop,
                                           pack_bits)
from structured_output.vocabulary import token_bytes

VOCAB_SIZE = 49152          # SmolLM2's embedding rows (= its tokenizer's length)
EOS = 2                     # <|im_end|>

PATTERNS = [
    r"(true|false|null|-?(0|[1-9][0-9]*)(\.[0-9]+)?)",
    "(é|日本|😀)+x?",
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]){0,6}"',
    "[a-zé ]{0,4}!",
    r"[^\n]{0,3}",
    schema_to_regex({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "integer"}},
                             "required": ["b"]}),
]


def unpack(row: torch.Tensor, vocab_size: int = VOCAB_SIZE) -> set[int]:
    """The allowed ids of one packed row, straight from the layout's definition."""
    t = torch.arange(vocab_size)
    return set(torch.nonzero((row[t // 32] >> (t % 32)) & 1).flatten().tolist())


def outlines_dropped(index: TokenIndex, tb, state: int, allowed: set[int]) -> set[int]:
    """What outlines-core 0.2.14 leaves out: the tokens whose bytes WITHOUT the last one reach an
    accepting state while the whole token does not (after "1" in `[0-9]+(a[0-9]+)?` the token "a"
    is missing, though "1a2" matches). It reads like regex-automata's match flag, which lags one
    byte behind: after the token's last byte it still reports the match that ended just before,
    so the token looks finished rather than "in progress", and is dropped for not being a full
    match."""
    def accepting_after(data: bytes) -> bool:
        return index.is_accepting(index.dfa.walk(state, data))
    return {t for t in allowed - {EOS} if accepting_after(tb[t][:-1]) and not accepting_after(tb[t])}


@pytest.fixture(scope="module")
def smollm2():
    import subprocess

    from transformers import AutoTokenizer

    from mini_vllm.default_model import default_model_path
    try:
        tok = AutoTokenizer.from_pretrained(default_model_path())
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"SmolLM2's tokenizer is not installed here ({type(e).__name__}: {e})")
    tb = token_bytes(tok)
    by_bytes: dict[bytes, list[int]] = {}
    for i, data in enumerate(tb):
        if data is not None:
            by_bytes.setdefault(data, []).append(i)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB_SIZE))
    return dict(tb=tb, trie=ByteTrie(tb, VOCAB_SIZE), outlines_vocab=outlines_core.Vocabulary(EOS, by_bytes),
                xgr_compiler=compiler, specials={i for i, b in enumerate(tb) if b is None} - {EOS})


def xgrammar_allowed(matcher, bitmask, specials) -> set[int]:
    """xgrammar keeps special tokens as their text; no regex here can spell one, but drop them."""
    matcher.fill_next_token_bitmask(bitmask)
    return unpack(bitmask[0]) - specials


@pytest.mark.parametrize("pattern", PATTERNS, ids=range(len(PATTERNS)))
def test_allowed_tokens_match_outlines_core_and_xgrammar(smollm2, pattern):
    tb = smollm2["tb"]
    index = TokenIndex(compile_regex(pattern), smollm2["trie"], VOCAB_SIZE, {EOS})
    theirs = outlines_core.Index(pattern, smollm2["outlines_vocab"])
    matcher = xgr.GrammarMatcher(smollm2["xgr_compiler"].compile_regex(pattern))
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    rng = random.Random(pattern)
    state, their_state = index.start, theirs.get_initial_state()
    for _ in range(8):
        ours = unpack(index.allowed(state))
        assert ours == xgrammar_allowed(matcher, bitmask, smollm2["specials"])
        outlines = set(theirs.get_allowed_tokens(their_state))
        assert ours - outlines == outlines_dropped(index, tb, state, ours) and outlines <= ours
        assert (EOS in ours) == index.is_accepting(state) == theirs.is_final_state(their_state)
        if ours == {EOS}:
            break
        token = rng.choice(sorted(outlines - {EOS}))           # a token all three can follow
        state, their_state = index.next_state(state, token), theirs.get_next_state(their_state, token)
        assert state >= 0 and matcher.accept_token(token)


def test_outlines_core_drops_tokens_that_leave_a_match(smollm2):
    """After "1" (accepting) in `[0-9]+(a[0-9]+)?`, "a" is a valid step ("1a2" matches), and after
    "é" in `(é|日本|😀)+x?` so is the lone lead byte 0xC3 of the next "é": ours and xgrammar allow
    them, outlines-core does not."""
    tb = smollm2["tb"]
    for pattern, first, step in [("[0-9]+(a[0-9]+)?", b"1", b"a"), ("(é|日本|😀)+x?", "é".encode(), b"\xc3")]:
        index = TokenIndex(compile_regex(pattern), smollm2["trie"], VOCAB_SIZE, {EOS})
        theirs = outlines_core.Index(pattern, smollm2["outlines_vocab"])
        matcher = xgr.GrammarMatcher(smollm2["xgr_compiler"].compile_regex(pattern))
        a, b = tb.index(first), tb.index(step)
        state = index.next_state(index.start, a)
        assert index.is_accepting(state) and index.next_state(state, b) >= 0
        assert matcher.accept_token(a) and matcher.accept_token(b)
        assert b not in theirs.get_allowed_tokens(theirs.get_next_state(theirs.get_initial_state(), a))


def test_xgrammar_dot_matches_newline(smollm2):
    """Same regex `.{0,3}`: xgrammar's extra tokens are exactly those containing a newline."""
    tb = smollm2["tb"]
    index = TokenIndex(compile_regex(".{0,3}"), smollm2["trie"], VOCAB_SIZE, {EOS})
    matcher = xgr.GrammarMatcher(smollm2["xgr_compiler"].compile_regex(".{0,3}"))
    extra = xgrammar_allowed(matcher, xgr.allocate_token_bitmask(1, VOCAB_SIZE), smollm2["specials"])
    extra -= unpack(index.allowed(index.start))
    assert extra and all(b"\n" in tb[t] for t in extra)


@pytest.mark.parametrize("pattern", PATTERNS[:4], ids=range(4))
def test_trie_walk_equals_token_loop_on_smollm2(smollm2, pattern):
    index = TokenIndex(compile_regex(pattern), smollm2["trie"], VOCAB_SIZE, {EOS})
    for state in range(min(index.dfa.num_states, 4)):
        trie_ids = sorted(allowed_token_ids(index.table, smollm2["trie"], state).tolist())
        assert trie_ids == allowed_token_ids_loop(index.dfa, smollm2["tb"], VOCAB_SIZE, state)


# A small vocabulary with the awkward cases: duplicates, a special (None), an empty token, lone
# UTF-8 bytes, and enough tokens that bit 31 of a word is used.
SMALL = [None, b"a", b"b", b"ab", b"abc", b'"', b"{", b"}", b"1", b"12", b" ", b"\xc3", b"\xa9", "é".encode(),
         b"", b"a", b'"a', b'a"', b"ba", b"x"] + [bytes([48 + i % 10]) * (1 + i // 10) for i in range(20)]


@pytest.mark.parametrize("pattern", ['"[a-cé]*"', "(ab|b)+1?", r"\{ ?\}|12+", "[^x]{1,3}"])
def test_index_semantics_on_a_small_vocabulary(pattern):
    dfa = compile_regex(pattern)
    vocab_size = len(SMALL) + 7                        # the model's rows exceed the tokenizer's
    eos = {0}
    index = TokenIndex(dfa, SMALL, vocab_size, eos)
    assert index.num_cached_states == 0                # lazy: nothing computed yet
    for state in range(dfa.num_states):
        row = index.allowed(state)
        assert row.dtype == torch.int32 and row.shape == ((vocab_size + 31) // 32,)
        allowed = unpack(row, vocab_size)
        assert sorted(allowed - eos) == allowed_token_ids_loop(dfa, SMALL, vocab_size, state)
        assert (0 in allowed) == (state in dfa.accepting)          # EOS exactly in accepting states
        assert all(t < len(SMALL) for t in allowed) and 14 not in allowed   # no padding ids, no empty token
        for t in range(vocab_size):
            assert (index.next_state(state, t) >= 0) == (t in allowed)
        assert index.num_allowed(state) == len(allowed)
    assert index.num_cached_states == dfa.num_states


def test_vocab_size_below_the_tokenizer_length_cuts_tokens():
    dfa = compile_regex("[0-9a]+")
    index = TokenIndex(dfa, SMALL, 10, eos_token_ids={0, 30})   # eos 30 >= vocab_size: ignored
    assert unpack(index.allowed(dfa.start), 10) == {1, 8, 9}
    assert index.next_state(dfa.start, 25) == -1


def test_pack_bits_sets_the_sign_bit():
    bits = np.zeros(64, dtype=bool)
    bits[[0, 31, 32, 63]] = True
    row = pack_bits(bits)
    assert row.tolist() == [1 - 2**31, 1 - 2**31] and row.dtype == torch.int32
