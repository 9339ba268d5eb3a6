"""Regex text -> a small syntax tree whose leaves are SETS OF UNICODE CODE POINTS.

Why a parser of our own: structured output needs the regex as an automaton (to ask "which tokens
may come next?"), and Python's `re` never shows its automaton. vLLM's outlines backend hands the
pattern to outlines-core, which parses it with Rust's `regex-syntax` crate and builds a byte DFA
with `regex-automata`; xgrammar (`cpp/regex_converter.cc`) turns it into grammar rules. Both
first reduce every character-matching construct (a literal, `.`, `\\d`, `[^"\\\\]`) to one thing:
a set of code points. We do the same, so the automaton builder (regex_dfa.py) has only four node
kinds to handle:

    CharSet(ranges)          one code point from a union of inclusive ranges
    Concat(items)            items one after another (Concat(()) is the empty string)
    Alternation(options)     any one of the options
    Repeat(item, min, max)   item min..max times (max None = unbounded)

Semantics (chosen to match JSON Schema's ECMA-262 dialect and `re.fullmatch(..., flags=re.ASCII)`):
  * the WHOLE output must match: `^` at the very start and `$` at the very end are accepted and
    ignored; anywhere else they are an error;
  * `\\d \\w \\s` are ASCII ([0-9], [A-Za-z0-9_], [ \\t\\n\\r\\f\\v]); `\\D \\W \\S` and negated
    classes are complements over ALL Unicode scalar values; `.` is any scalar except newline;
  * surrogates (U+D800..U+DFFF) are never matched: they have no UTF-8 encoding;
  * lazy quantifiers (`*?`) are accepted (a full match does not care which match is preferred);
    possessive quantifiers, backreferences, lookaround, word boundaries and inline flags change
    what a regular language can express, so they are refused with the construct and its position.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
MAX_REPEAT = 1000               # x{m,n} copies x n times in the automaton: keep it bounded

Ranges = tuple[tuple[int, int], ...]   # sorted, disjoint, inclusive (lo, hi) code point ranges


@dataclass(frozen=True)
class CharSet:
    ranges: Ranges


@dataclass(frozen=True)
class Concat:
    items: tuple


@dataclass(frozen=True)
class Alternation:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    item: object
    min: int
    max: int | None


def char_set(ranges) -> CharSet:
    """Normalise (lo, hi) pairs: sorted, merged when they touch, surrogates cut out."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out = []
    for lo, hi in merged:       # remove [D800, DFFF] from each range
        if lo < SURROGATES[0]:
            out.append((lo, min(hi, SURROGATES[0] - 1)))
        if hi > SURROGATES[1]:
            out.append((max(lo, SURROGATES[1] + 1), hi))
    return CharSet(tuple(out))


def complement(cs: CharSet) -> CharSet:
    """Every Unicode scalar value NOT in cs."""
    gaps, nxt = [], 0
    for lo, hi in cs.ranges:
        if lo > nxt:
            gaps.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        gaps.append((nxt, MAX_CODE_POINT))
    return char_set(gaps)


def _single(c: str) -> CharSet:
    return char_set([(ord(c), ord(c))])


DIGIT = char_set([(0x30, 0x39)])
WORD = char_set([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = char_set([(0x09, 0x0D), (0x20, 0x20)])       # \t \n \v \f \r and space
ANY_BUT_NEWLINE = complement(_single("\n"))
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE,
                 "D": complement(DIGIT), "W": complement(WORD), "S": complement(SPACE)}
CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}               # \x41, \u0041, \U0001F600
REFUSED_ESCAPES = {"b": "word boundary \\b", "B": "word boundary \\B", "A": "anchor \\A",
                   "Z": "anchor \\Z", "z": "anchor \\z", "G": "anchor \\G", "k": "backreference \\k",
                   "p": "Unicode property \\p", "P": "Unicode property \\P", "0": "octal escape \\0"}


def parse(pattern: str):
    """The syntax tree of `pattern` (CharSet / Concat / Alternation / Repeat); ValueError if the
    pattern is malformed or uses a construct a finite automaton cannot express."""
    return _Parser(pattern).parse()


class _Parser:
    """Recursive descent, one method per grammar level:
    alternation := sequence ('|' sequence)* ; sequence := quantified* ; quantified := atom quantifier*"""

    def __init__(self, pattern: str):
        self.pattern, self.pos = pattern, 0

    def error(self, what: str, pos: int | None = None) -> ValueError:
        pos = self.pos if pos is None else pos
        return ValueError(f"regex {self.pattern!r}: {what} at position {pos}")

    def peek(self, ahead: int = 0) -> str | None:
        i = self.pos + ahead
        return self.pattern[i] if i < len(self.pattern) else None

    def parse(self):
        if self.peek() == "^":                       # leading anchor: the whole output matches anyway
            self.pos += 1
        node = self.alternation()
        if self.pos < len(self.pattern):             # only an unmatched ')' stops alternation early
            raise self.error("unbalanced ')'")
        return node

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Alternation(tuple(options))

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$" and self.pos == len(self.pattern) - 1:
                self.pos += 1                        # trailing anchor: ignored
                break
            items.append(self.quantified())
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def quantified(self):
        node = self.atom()
        start = self.pos
        bounds = self.quantifier()
        if bounds is None:
            return node
        if self.peek() == "?":                       # lazy: same language under a full match
            self.pos += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifier is not supported")
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.quantifier(probe=True)):
            raise self.error("multiple repeat (a quantifier on a quantifier)")
        if bounds[1] is not None and bounds[0] > bounds[1]:
            raise self.error(f"bad repeat range {{{bounds[0]},{bounds[1]}}}", start)
        if max(bounds[0], bounds[1] or 0) > MAX_REPEAT:
            raise self.error(f"repeat count above {MAX_REPEAT}", start)
        return Repeat(node, *bounds)

    def quantifier(self, probe: bool = False) -> tuple[int, int | None] | None:
        """(min, max) of a `* + ? {m} {m,} {,n} {m,n}` at pos (consumed unless probe), else None."""
        c = self.peek()
        simple = {"*": (0, None), "+": (1, None), "?": (0, 1)}
        if c in simple:
            if not probe:
                self.pos += 1
            return simple[c]
        if c != "{":
            return None
        end = self.pattern.find("}", self.pos)
        lo, comma, hi = self.pattern[self.pos + 1:end].partition(",") if end > 0 else ("", "", "")
        numbers = all(part == "" or (part.isascii() and part.isdigit()) for part in (lo, hi))
        if end < 0 or not numbers or not (lo or (comma and hi)):
            raise self.error("'{' that does not start a {m}, {m,}, {,n} or {m,n} quantifier (escape it as \\{)")
        if not probe:
            self.pos = end + 1
        low = int(lo) if lo else 0
        return (low, low) if not comma else (low, int(hi) if hi else None)

    def atom(self):
        c, start = self.peek(), self.pos
        if c in ("*", "+", "?", "{"):
            raise self.error(f"nothing to repeat before {c!r}")
        self.pos += 1
        if c == "(":
            return self.group(start)
        if c == "[":
            return self.char_class(start)
        if c == ".":
            return ANY_BUT_NEWLINE
        if c == "\\":
            got = self.escape(in_class=False)
            return got if isinstance(got, CharSet) else char_set([(got, got)])
        if c in ("^", "$"):
            raise self.error(f"anchor {c!r} inside the pattern (only a leading ^ and a trailing $ are allowed)",
                             start)
        return _single(c)

    def group(self, start: int):
        if self.peek() == "?":
            if self.pattern.startswith("?:", self.pos):
                self.pos += 2
            else:
                lookaround = {"?=": "lookahead", "?!": "negative lookahead", "?<=": "lookbehind",
                              "?<!": "negative lookbehind", "?P=": "named backreference"}
                for prefix, name in lookaround.items():
                    if self.pattern.startswith(prefix, self.pos):
                        raise self.error(f"{name} '({prefix}' is not supported", start)
                raise self.error(f"unsupported group construct '({self.pattern[self.pos:self.pos + 2]}'", start)
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ')' for the group opened", start)
        self.pos += 1
        return node

    def char_class(self, start: int) -> CharSet:
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        ranges, first = [], True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character class opened", start)
            if c == "]" and not first:               # a ']' right after '[' or '[^' is a literal
                self.pos += 1
                break
            first = False
            item_pos = self.pos
            lo = self.class_item()
            if isinstance(lo, int) and self.peek() == "-" and self.peek(1) not in ("]", None):
                self.pos += 1
                hi = self.class_item()
                if not isinstance(hi, int) or hi < lo:
                    raise self.error("bad character range", item_pos)
                ranges.append((lo, hi))
            elif isinstance(lo, int):
                ranges.append((lo, lo))
            else:
                ranges.extend(lo.ranges)
        cs = char_set(ranges)
        return complement(cs) if negate else cs

    def class_item(self) -> int | CharSet:
        c = self.peek()
        self.pos += 1
        if c == "\\":
            return self.escape(in_class=True)
        return ord(c)

    def escape(self, in_class: bool) -> int | CharSet:
        """After a backslash: a code point (int) or a class (CharSet)."""
        start = self.pos - 1
        c = self.peek()
        if c is None:
            raise self.error("pattern ends with a lone backslash", start)
        self.pos += 1
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CONTROL_ESCAPES:
            return ord(CONTROL_ESCAPES[c])
        if c == "b" and in_class:                    # inside [...] \b is backspace, as in Python
            return 0x08
        if c in HEX_ESCAPES:
            digits = self.pattern[self.pos:self.pos + HEX_ESCAPES[c]]
            if len(digits) != HEX_ESCAPES[c] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs exactly {HEX_ESCAPES[c]} hex digits", start)
            self.pos += len(digits)
            if int(digits, 16) > MAX_CODE_POINT:
                raise self.error(f"\\{c}{digits} is beyond U+10FFFF", start)
            return int(digits, 16)
        if c.isdigit():
            raise self.error(f"backreference \\{c} is not supported (not a regular language)", start)
        if c in REFUSED_ESCAPES:
            raise self.error(f"{REFUSED_ESCAPES[c]} is not supported", start)
        if c.isascii() and c.isalnum():
            raise self.error(f"unknown escape \\{c}", start)
        return ord(c)                                # \. \\ \/ \- \{ ... : the character itself
