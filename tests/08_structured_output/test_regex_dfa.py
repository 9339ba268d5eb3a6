"""regex -> byte DFA (structured_output.regex_dfa), checked against Python's `re` as the oracle.

Our semantics are those of `re.fullmatch(pattern, text, flags=re.ASCII)` on text that is encoded
as UTF-8 for the DFA: ASCII \\d \\w \\s, complements over all of Unicode, `.` = not newline.
"""
import random
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from structured_output.regex_dfa import (DEAD, build_dfa, compile_regex, distances_to_accept,
                                         sample_match)
from structured_output.regex_parser import MAX_REPEAT
from structured_output.utf8_ranges import utf8_sequences

PATTERNS = [
    "abc", "a|bc|", "(ab)*c+d?", "[a-z0-9_]{2,4}", r'[^"\\]*', r"\d+\.\d*", r"\w\W\s\S",
    "x{3}", "x{2,}", "x{,2}y", "(?:ab|a)*b{0,2}", ".{1,3}", "héllo|日本+", "[α-ω]+ü?",
    "[^a-zé]+", r"\u00e9\x41\t\n\/\.", "^foo$", r"[\d\-x]+", "[]a]+", "[^]a]", "😀+[😀-🙏]?",
    "a*?b+?c??", r"(\d{4})-(0[1-9]|1[0-2])", "[^\n]*\n", r"[\x00-\x1f\x7f-\x9f]+", r"\D\S",
    "[\ufffd-\U0001f000]+", r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
]


def _alphabet(pattern: str):
    """Characters of the pattern itself (so matches are not vanishingly rare), plus any Unicode."""
    local = sorted(set(pattern) | set("0123456789 \n\t_-\"\\éü😀"))
    return st.one_of(st.sampled_from(local), st.characters(codec="utf-8"))   # no lone surrogates


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_dfa_agrees_with_re_on_random_text(pattern, data):
    text = data.draw(st.text(_alphabet(pattern), max_size=8))
    expected = re.fullmatch(pattern, text, flags=re.ASCII) is not None
    assert compile_regex(pattern).accepts(text.encode("utf-8")) == expected


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_sampled_member_is_utf8_and_matched_by_re(pattern):
    dfa, rng = compile_regex(pattern), random.Random(pattern)
    for _ in range(30):
        data = sample_match(dfa, rng, max_len=12)
        assert dfa.accepts(data)
        assert re.fullmatch(pattern, data.decode("utf-8"), flags=re.ASCII), data  # decode: valid UTF-8


@pytest.mark.parametrize("data", [b"\xc0\x80", b"\xc1\xbf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                                  b"\xf5\x80\x80\x80", b"\x80", b"\xe2\x82", b"\xff"])
def test_dot_star_rejects_invalid_utf8(data):
    """Overlong forms, surrogates, > U+10FFFF, stray continuations, truncated sequences."""
    assert not compile_regex(".*").accepts(data)
    assert compile_regex(".*").accepts("aé€😀".encode())


@settings(max_examples=60, deadline=None)
@given(lo=st.integers(0, 0x10FFFF), width=st.integers(0, 0x30000), probes=st.lists(st.integers(-3, 3), max_size=6))
def test_utf8_sequences_cover_exactly_the_range(lo, width, probes):
    hi = min(lo + width, 0x10FFFF)
    assume(hi < 0xD800 or lo > 0xDFFF)                             # ranges never hold surrogates
    seqs = utf8_sequences([(lo, hi)])
    for cp in [lo, hi, (lo + hi) // 2] + [lo + p for p in probes] + [hi + p for p in probes]:
        if not 0 <= cp <= 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
            continue
        enc = chr(cp).encode("utf-8")
        covered = any(len(s) == len(enc) and all(a <= x <= b for x, (a, b) in zip(enc, s)) for s in seqs)
        assert covered == (lo <= cp <= hi), hex(cp)


@pytest.mark.parametrize("pattern,states", [
    ("(a|b)*abb", 4),       # the dragon book's example
    ("a*", 1), ("x{0,3}", 4), ("(?:ab)+", 3), (r"\d+\.\d*", 3),
    (".", 9),               # start, accept, need 1/2/3 continuation bytes, and E0 ED F0 F4's narrow 2nd byte
])
def test_minimal_state_counts(pattern, states):
    dfa = compile_regex(pattern)
    assert dfa.num_states == states
    assert all(dfa.live(s) for s in range(dfa.num_states)) and not dfa.live(DEAD)


@pytest.mark.parametrize("a,b", [("(a|b)*abb", "[ab]*abb"), ("(?:a|b)+", "[ab][ab]*"), ("a{2,}", "aaa*"),
                                 ("(x|xy)(z|yz)", "x(z|yz|yz|yyz)"), ("[^b\n]|b", ".")])
def test_equal_languages_give_identical_dfas(a, b):
    """Minimal DFAs are unique up to renaming and ours are numbered canonically (breadth-first)."""
    assert compile_regex(a) == compile_regex(b)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_minimisation_keeps_the_language(pattern):
    full, small = build_dfa(pattern, minimal=False), compile_regex(pattern)
    assert small.num_states <= full.num_states
    rng = random.Random(1)
    samples = [sample_match(full, rng, 10) for _ in range(20)] + [sample_match(small, rng, 10) for _ in range(20)]
    samples += [bytes(rng.choice(b"ab01 x\"\\\n\xc3\xa9") for _ in range(rng.randrange(6))) for _ in range(100)]
    for data in samples:
        assert full.accepts(data) == small.accepts(data), data


def test_walk_step_and_distances():
    dfa = compile_regex("ab|ac+")
    s = dfa.step(dfa.start, ord("a"))
    assert dfa.walk(dfa.start, b"a") == s and dfa.walk(s, b"cc") in dfa.accepting
    assert dfa.walk(dfa.start, b"ax") == DEAD and dfa.walk(dfa.start, b"axa") == DEAD
    assert dfa.step(DEAD, ord("a")) == DEAD
    dist = distances_to_accept(dfa)
    assert dist[dfa.start] == 2 and dist[s] == 1


@pytest.mark.parametrize("pattern,message", [
    ("(a", "missing ')'"), ("a)", "unbalanced ')'"), ("*a", "nothing to repeat"),
    ("a**", "multiple repeat"), ("a{3,1}", "bad repeat range"), ("[a", "unterminated character class"),
    ("[z-a]", "bad character range"), ("(?=a)", "lookahead"), ("(?<!a)b", "negative lookbehind"),
    (r"(a)\1", "backreference"), (r"\bfoo", "word boundary"), ("a^b", "anchor '^'"), ("a$b", "anchor '$'"),
    (r"\q", "unknown escape"), (r"\x4", "hex digits"), ("(?i)a", "unsupported group construct"),
    ("a{", "quantifier"), ("a*+", "possessive"), (r"[^\x00-\U0010FFFF]", "matches no string"),
    (f"a{{{MAX_REPEAT + 1}}}", "repeat count"), ("a\\", "lone backslash"), (r"\p{L}", "Unicode property"),
])
def test_unsupported_or_malformed_patterns_raise(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_dfa(pattern)


def test_error_names_the_position():
    with pytest.raises(ValueError, match=r"lookbehind '\(\?<=' is not supported at position 3"):
        build_dfa("abc(?<=x)")
