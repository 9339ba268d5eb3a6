"""The tree a GBNF grammar parses into (grammar.py), and its printing back to GBNF text.

Six kinds of node, the whole of EBNF: a literal string, a character class, a reference to a rule, a
sequence, a choice and a bounded or unbounded repetition (`*` `+` `?` `{m,n}` are all `Repeat`). The
tree knows characters (Unicode code points), not bytes: rule_automata.py does the UTF-8.

`str(grammar)` prints text that this parser and xgrammar's both read back to the same language, so a
tree built by code (or by a test) can be handed to either.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)          # UTF-16 halves: not characters, no UTF-8 encoding


# --- the nodes -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Literal:
    text: str                                   # "" matches the empty string


@dataclass(frozen=True)
class CharClass:
    ranges: tuple[tuple[int, int], ...]         # inclusive code point ranges, as written
    negated: bool = False

    def codepoint_ranges(self) -> list[tuple[int, int]]:
        """The characters matched: sorted, merged, inclusive code point ranges. Characters are Unicode
        scalar values, so surrogates (U+D800..U+DFFF, never valid in UTF-8) are left out even of a
        negated class. xgrammar differs here: its [^...] also matches their 3-byte encodings."""
        merged: list[list[int]] = []
        for lo, hi in sorted(self.ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        if self.negated:                        # the complement over every code point
            edges = [-1] + [x for lo, hi in merged for x in (lo, hi)] + [MAX_CODEPOINT + 1]
            merged = [[edges[i] + 1, edges[i + 1] - 1] for i in range(0, len(edges), 2)
                      if edges[i] + 1 <= edges[i + 1] - 1]
        out = []
        for lo, hi in merged:                   # cut the surrogate block out
            for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
                if a <= b:
                    out.append((a, b))
        return out


@dataclass(frozen=True)
class RuleRef:
    name: str
    # "line:col" of the reference, for error messages; two references are equal wherever written
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class Sequence:
    items: tuple["Expr", ...]


@dataclass(frozen=True)
class Choice:
    alternatives: tuple["Expr", ...]


@dataclass(frozen=True)
class Repeat:
    item: "Expr"
    min: int
    max: int | None                             # None: unbounded


Expr = Union[Literal, CharClass, RuleRef, Sequence, Choice, Repeat]


@dataclass
class Grammar:
    rules: dict[str, Expr]                      # in the order written
    root: str = "root"

    def __str__(self) -> str:
        return "\n".join(f"{name} ::= {to_text(body)}" for name, body in self.rules.items()) + "\n"


# --- printing (GBNF that this parser and xgrammar both read back) --------------------------------

def _escape_char(cp: int, specials: str) -> str:
    ch = chr(cp)
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
    if ch in named:
        return named[ch]
    if ch in specials:
        return "\\" + ch
    if cp < 0x20 or cp == 0x7F:
        return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"
    return ch


def to_text(e: Expr) -> str:
    if isinstance(e, Literal):
        return '"' + "".join(_escape_char(ord(c), '"') for c in e.text) + '"'
    if isinstance(e, CharClass):
        parts = [_escape_char(lo, "]-^") + ("" if lo == hi else "-" + _escape_char(hi, "]-^")) for lo, hi in e.ranges]
        return "[" + ("^" if e.negated else "") + "".join(parts) + "]"
    if isinstance(e, RuleRef):
        return e.name
    if isinstance(e, Sequence):
        return " ".join(to_text(i) for i in e.items)
    if isinstance(e, Choice):
        return "(" + " | ".join(to_text(a) for a in e.alternatives) + ")"
    suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((e.min, e.max))
    if suffix is None:
        suffix = f"{{{e.min}{'' if e.max == e.min else ',' + ('' if e.max is None else str(e.max))}}}"
    atom = isinstance(e.item, (Literal, CharClass, RuleRef))
    return (to_text(e.item) if atom else f"({to_text(e.item)})") + suffix
