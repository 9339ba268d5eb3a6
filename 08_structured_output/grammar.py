"""EBNF grammars in GBNF notation: the text a user sends with `guided_grammar`, parsed into a tree.

GBNF is the notation llama.cpp introduced and xgrammar reads (`xgr.Grammar.from_ebnf`), so a grammar
written for vLLM's xgrammar backend works here unchanged:

    root   ::= object                 # `root` is where every output starts
    object ::= "{" ws ( member ( "," ws member )* )? "}"
    ws     ::= [ \\t\\n\\r]*             # character classes: ranges, [^...] negation, escapes

    "..."    a literal (escapes \\n \\t \\" \\\\ \\xHH \\uHHHH ...)     [a-z] [^"\\\\]  a character class
    ( )  |   grouping, alternation                              * + ? {m} {m,} {m,n}  repetition
    name     a rule reference                                   # ...  a comment to the end of the line

A rule's body runs until the next `name ::=`, so an alternative may start on a new line (as xgrammar
allows). Characters are Unicode code points; rule_automata.py turns them into UTF-8 byte sequences,
because a tokenizer's tokens are bytes and may cut a character in half.

This file reads text into the tree of grammar_tree.py (a hand-written recursive-descent parser, one
method per level of the notation: choice > sequence > postfix > atom), then grammar_checks.py checks
the whole. It knows nothing of automata. Every problem is a ValueError that names the rule and the
line:column, the way xgrammar's parser reports them.
"""
from __future__ import annotations

import re

from structured_output.grammar_checks import check_grammar, find_left_recursion  # noqa: F401 (re-exported)
from structured_output.grammar_tree import (MAX_CODEPOINT, SURROGATES, CharClass, Choice, Expr,  # noqa: F401
                                            Grammar, Literal, Repeat, RuleRef, Sequence, to_text)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_RULE_START = re.compile(r"([A-Za-z_][A-Za-z0-9_\-]*)[ \t]*::=")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "b": "\b", "a": "\a", "e": "\x1b",
                   "0": "\0", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-", "^": "^", "/": "/"}


def parse_grammar(text: str, root: str = "root") -> Grammar:
    """Parse GBNF text; ValueError naming the rule and line:column on any problem (syntax, a rule
    defined twice, a reference to an undefined rule, no `root`, a rule that can never finish)."""
    return _Parser(text).parse(root)


class _Parser:
    def __init__(self, text: str):
        self.text, self.pos, self.rule = text, 0, "<grammar>"

    # -- positions and errors --
    def where(self, pos: int | None = None) -> str:
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        return f"{line}:{pos - (self.text.rfind(chr(10), 0, pos) + 1) + 1}"

    def error(self, message: str, pos: int | None = None) -> ValueError:
        return ValueError(f"grammar error in rule {self.rule!r} at line:col {self.where(pos)}: {message}")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_space(self) -> None:
        """Blanks, newlines and `#` comments all separate items."""
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c in " \t\r\n":
                self.pos += 1
            elif c == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            else:
                return

    def at_rule_start(self) -> bool:
        return _RULE_START.match(self.text, self.pos) is not None

    # -- grammar and rules --
    def parse(self, root: str) -> Grammar:
        rules: dict[str, Expr] = {}
        where: dict[str, str] = {}
        self.skip_space()
        while self.pos < len(self.text):
            m = _RULE_START.match(self.text, self.pos)
            if m is None:
                raise self.error("expected a rule definition `name ::= ...`")
            self.rule = m.group(1)
            if self.rule in rules:
                raise self.error(f"rule {self.rule!r} is defined twice (first at {where[self.rule]})")
            where[self.rule] = self.where()
            self.pos = m.end()
            rules[self.rule] = self.parse_choice()
            self.skip_space()
            if self.pos < len(self.text) and not self.at_rule_start():
                raise self.error(f"unexpected {self.peek()!r}")
        grammar = Grammar(rules, root)
        check_grammar(grammar, where)
        return grammar

    def parse_choice(self) -> Expr:
        alternatives = [self.parse_sequence()]
        while True:
            self.skip_space()
            if self.peek() != "|":
                break
            self.pos += 1
            alternatives.append(self.parse_sequence())
        return alternatives[0] if len(alternatives) == 1 else Choice(tuple(alternatives))

    def parse_sequence(self) -> Expr:
        items = []
        while True:
            self.skip_space()
            if self.pos >= len(self.text) or self.peek() in "|)" or self.at_rule_start():
                break
            items.append(self.parse_postfix(self.parse_atom()))
        if not items:
            raise self.error("expected an expression (a literal, [class], (group) or rule name)")
        return items[0] if len(items) == 1 else Sequence(tuple(items))

    def parse_atom(self) -> Expr:
        c, start = self.peek(), self.pos
        if c == '"':
            return self.parse_literal()
        if c == "[":
            return self.parse_class()
        if c == "(":
            self.pos += 1
            body = self.parse_choice()
            self.skip_space()
            if self.peek() != ")":
                raise self.error("expected ')' to close the group opened at " + self.where(start))
            self.pos += 1
            return body
        m = _NAME.match(self.text, self.pos)
        if m is None:
            raise self.error(f"unexpected {c!r}")
        self.pos = m.end()
        return RuleRef(m.group(0), self.where(start))

    def parse_postfix(self, item: Expr) -> Expr:
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.pos += 1
                item = Repeat(item, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
            elif c == "{":
                item = self.parse_braces(item)
            else:
                return item

    def parse_braces(self, item: Expr) -> Expr:
        m = re.compile(r"\{[ \t]*(\d+)[ \t]*(,[ \t]*(\d*)[ \t]*)?\}").match(self.text, self.pos)
        if m is None:
            raise self.error("expected a repetition {m}, {m,} or {m,n}")
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        if hi is not None and hi < lo:
            raise self.error(f"repetition {{{lo},{hi}}} has max < min")
        self.pos = m.end()
        return Repeat(item, lo, hi)

    # -- literals and classes --
    def parse_char(self, terminator: str) -> str:
        """One character of a literal or class, escapes decoded."""
        if self.pos >= len(self.text) or self.text[self.pos] == "\n":
            raise self.error(f"unterminated {'string' if terminator == chr(34) else 'character class'}")
        c = self.text[self.pos]
        self.pos += 1
        if c != "\\":
            return c
        e = self.peek()
        self.pos += 1
        if e in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[e]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        digits = self.text[self.pos:self.pos + (width or 0)]
        if width is None or len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"bad escape '\\{e}'", self.pos - 2)
        self.pos += width
        cp = int(digits, 16)
        if cp > MAX_CODEPOINT or SURROGATES[0] <= cp <= SURROGATES[1]:
            raise self.error(f"\\{e}{digits} is not a Unicode character (a surrogate or beyond U+10FFFF)",
                             self.pos - width - 2)
        return chr(cp)

    def parse_literal(self) -> Literal:
        self.pos += 1
        out = []
        while self.peek() != '"':
            out.append(self.parse_char('"'))
        self.pos += 1
        return Literal("".join(out))

    def parse_class(self) -> CharClass:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        ranges = []
        while self.peek() != "]":
            lo = ord(self.parse_char("]"))
            hi = lo
            if self.peek() == "-" and self.text[self.pos + 1:self.pos + 2] not in ("]", ""):
                self.pos += 1
                hi = ord(self.parse_char("]"))
                if hi < lo:
                    raise self.error(f"empty range {chr(lo)!r}-{chr(hi)!r} in character class", start)
            ranges.append((lo, hi))
        self.pos += 1
        if not ranges and not negated:                  # [^] is "any character"; [] could never match
            raise self.error("empty character class []", start)
        return CharClass(tuple(ranges), negated)


# --- the JSON grammar ----------------------------------------------------------------------------

# Any JSON object: OpenAI's response_format={"type": "json_object"}. Its language is xgrammar's
# builtin JSON grammar (`xgr.Grammar.builtin_json_grammar()`) with an object at the top: whitespace
# [ \t\n\r]* between any two tokens, none before the first "{" or after the last "}", strings without
# raw control characters, numbers without leading zeros. So masks from the two can be compared.
#
# Whitespace is written out in place instead of as a `ws` rule on purpose: a token that runs past the
# end of a rule can only be judged with the stack beneath (it is context-DEPENDENT, token_mask.py), and
# half of a BPE vocabulary starts with a space. Inside `object`, " the" is rejected by `object` alone.
JSON_GRAMMAR = r"""
root   ::= object
object ::= "{" [ \t\n\r]* ( member [ \t\n\r]* ( "," [ \t\n\r]* member [ \t\n\r]* )* )? "}"
member ::= string [ \t\n\r]* ":" [ \t\n\r]* value
array  ::= "[" [ \t\n\r]* ( value [ \t\n\r]* ( "," [ \t\n\r]* value [ \t\n\r]* )* )? "]"
value  ::= object | array | string | number | "true" | "false" | "null"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" escape )* "\""
escape ::= ["\\/bfnrt] | "u" [0-9a-fA-F]{4}
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [+-]? [0-9]+ )?
"""

# The same documents in ONE layout (disable_any_whitespace): no whitespace between tokens at all —
# vLLM's layout (its xgrammar backend passes separators "," and ":").
JSON_GRAMMAR_COMPACT = r"""
root   ::= object
object ::= "{" ( member ( "," member )* )? "}"
member ::= string ":" value
array  ::= "[" ( value ( "," value )* )? "]"
value  ::= object | array | string | number | "true" | "false" | "null"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" escape )* "\""
escape ::= ["\\/bfnrt] | "u" [0-9a-fA-F]{4}
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [+-]? [0-9]+ )?
"""
