"""grammar.py: GBNF text -> tree, checked against xgrammar's own parser and Python's `re` as oracles.

  * every construct of the notation parses to the tree it means;
  * printing a tree gives text that parses back to the same tree AND that xgrammar accepts (random
    trees, hypothesis);
  * a character class matches exactly the code points Python's `re` matches for the same class;
  * every malformed grammar is a ValueError naming the rule and line:col — and xgrammar refuses it too.
"""
import random
import re

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from structured_output.grammar import (JSON_GRAMMAR, CharClass, Choice, Grammar, Literal, Repeat, RuleRef, Sequence,
                                       find_left_recursion, parse_grammar, to_text)


def test_every_construct_parses_to_its_tree():
    g = parse_grammar(r'''
        # a comment line
        root ::= "a\n\x41\u00e9" [^"\\a-z] ( x | "b" )* x+ x? x{2} x{2,} x{1,3}   # trailing comment
               | ""
        x ::= [0-9A-F_]
    ''')
    x = RuleRef("x")
    assert g.rules["root"] == Choice((
        Sequence((Literal("a\nAé"), CharClass(((34, 34), (92, 92), (97, 122)), negated=True),
                  Repeat(Choice((x, Literal("b"))), 0, None), Repeat(x, 1, None), Repeat(x, 0, 1),
                  Repeat(x, 2, 2), Repeat(x, 2, None), Repeat(x, 1, 3))),
        Literal("")))
    assert g.rules["x"] == CharClass(((48, 57), (65, 70), (95, 95)))
    assert list(g.rules) == ["root", "x"] and g.root == "root"


def test_json_grammar_parses_and_xgrammar_reads_it():
    g = parse_grammar(JSON_GRAMMAR)
    assert set(g.rules) == {"root", "object", "member", "array", "value", "string", "escape", "number"}
    xgr.Grammar.from_ebnf(JSON_GRAMMAR)
    assert parse_grammar(str(g)) == g


# --- printing round-trips (random trees) ---------------------------------------------------------

_chars = st.characters(blacklist_categories=("Cs",), max_codepoint=0x2FFFF)
_atoms = st.one_of(
    st.text(_chars, max_size=4).map(Literal),
    st.lists(st.tuples(_chars, _chars).map(lambda p: tuple(sorted(map(ord, p)))), min_size=1, max_size=3)
      .flatmap(lambda r: st.booleans().map(lambda n: CharClass(tuple(r), n))),
    st.sampled_from([RuleRef("root"), RuleRef("other")]),
)
_exprs = st.recursive(_atoms, lambda inner: st.one_of(
    st.lists(inner, min_size=2, max_size=3).map(lambda xs: Sequence(tuple(xs))),
    st.lists(inner, min_size=2, max_size=3).map(lambda xs: Choice(tuple(xs))),
    st.tuples(inner, st.integers(0, 3), st.one_of(st.none(), st.integers(0, 3)))
      .map(lambda t: Repeat(t[0], t[1], None if t[2] is None else t[1] + t[2]))), max_leaves=8)


def _flat(e):
    """Printing drops redundant nesting; compare trees modulo that (a sequence inside a sequence)."""
    if isinstance(e, Sequence):
        items = []
        for i in map(_flat, e.items):
            items.extend(i.items if isinstance(i, Sequence) else [i])
        return Sequence(tuple(items))
    if isinstance(e, Choice):
        return Choice(tuple(map(_flat, e.alternatives)))
    if isinstance(e, Repeat):
        return Repeat(_flat(e.item), e.min, e.max)
    return e


@settings(max_examples=60, deadline=None)
@given(_exprs)
def test_printed_grammar_parses_back_and_xgrammar_reads_it(expr):
    g = Grammar({"root": Choice((expr, Literal("z"))), "other": Literal("o")})   # "z": root can finish
    text = str(g)
    again = parse_grammar(text)
    assert {k: _flat(v) for k, v in again.rules.items()} == {k: _flat(v) for k, v in g.rules.items()}, text
    xgr.Grammar.from_ebnf(text)                                  # raises if xgrammar cannot read it


# --- character classes vs Python's re ------------------------------------------------------------

@pytest.mark.parametrize("cls", [r'[a-z]', r'[^"\\]', r'[^"\\\x00-\x1f]', r'[\u00e0-\u00ff0-9_]', r'[^a]',
                                 r'[\U0001F600-\U0001F64F]', r'[^\u0800-\uFFFF]', r'[-+]'])
def test_char_class_matches_what_python_re_matches(cls):
    ranges = parse_grammar(f"root ::= {cls}").rules["root"].codepoint_ranges()
    py = re.compile(cls)
    rng = random.Random(cls)
    points = {0, 0x10FFFF} | {rng.randrange(0x110000) for _ in range(3000)}
    for lo, hi in ranges:                                        # probe every range's edges
        points |= {max(lo - 1, 0), lo, hi, min(hi + 1, 0x10FFFF)}
    for cp in sorted(points):
        mine = any(lo <= cp <= hi for lo, hi in ranges)
        if 0xD800 <= cp <= 0xDFFF:
            assert not mine, f"{cls}: surrogate U+{cp:04X} is not a character"
        else:
            assert mine == bool(py.fullmatch(chr(cp))), f"{cls} on U+{cp:04X}"


# --- errors --------------------------------------------------------------------------------------

BAD = [  # (grammar, what the message must name)
    ('root ::= b', r"rule 'root' at line:col 1:10: reference to undefined rule 'b'"),
    ('a ::= "x"', r"no 'root' rule"),
    ('root ::= ("a"', r"rule 'root' at line:col 1:14: expected '\)'"),
    ('root ::= "a"\nroot ::= "b"', r"rule 'root' at line:col 2:1: .*defined twice"),
    ('root ::= [z-a]', r"rule 'root' at line:col 1:10: empty range"),
    ('root ::= "\\q"', r"rule 'root' at line:col 1:11: bad escape"),
    ('root ::= "a" )', r"rule 'root' at line:col 1:14: unexpected"),
    ('root ::= x\nx ::= ', r"rule 'x' at line:col 2:7: expected an expression"),
    ('root ::= "abc', r"rule 'root' at line:col 1:14: unterminated string"),
    ('root := "a"', r"line:col 1:1: expected a rule definition"),
    ('root ::= "a"{3,2}', r"rule 'root' at line:col 1:13: .*max < min"),
    ('root ::= ("a" | )', r"rule 'root' at line:col 1:17: expected an expression"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_grammar_is_a_value_error_naming_rule_and_position(text, message):
    with pytest.raises(ValueError, match=message):
        parse_grammar(text)
    with pytest.raises(RuntimeError):                           # xgrammar refuses it too
        xgr.Grammar.from_ebnf(text)


def test_a_rule_that_can_never_finish_is_refused():
    with pytest.raises(ValueError, match=r"rule 'root' .* rules \['root', 'a'\] can never finish"):
        parse_grammar('root ::= a\na ::= "x" a')


def test_left_recursion_is_found_through_nullable_prefixes():
    assert find_left_recursion(parse_grammar('root ::= e\ne ::= t | e "+" t\nt ::= [0-9]')) == ["e", "e"]
    assert find_left_recursion(parse_grammar('root ::= x? y\ny ::= "" | root "a"\nx ::= "c"')) == ["root", "y", "root"]
    assert find_left_recursion(parse_grammar('root ::= "(" root ")" | "x"')) is None
    assert to_text(Repeat(RuleRef("a"), 2, None)) == "a{2,}"
