"""Code point ranges -> sequences of BYTE ranges: how a Unicode character class becomes a byte automaton.

A model's tokens are byte strings, and a byte-level BPE token may end in the middle of a
multi-byte character. So the automaton that masks tokens must read BYTES, and every set of code
points (the leaves of regex_parser's tree) must be re-expressed as UTF-8 byte sequences. Listing
every code point would be a million edges; instead a range [lo, hi] of code points is split into a
few pieces whose UTF-8 encodings form a product of byte ranges, e.g.

    U+0080..U+07FF  ->  [C2-DF][80-BF]
    U+0800..U+FFFF  ->  [E0][A0-BF][80-BF] | [E1-EC][80-BF][80-BF] | [ED][80-9F][80-BF]
                        | [EE-EF][80-BF][80-BF]          (surrogates D800-DFFF already removed)

This is the classic construction of Russ Cox / Ken Thompson's UTF-8 automata (Rust's
`regex-syntax` `utf8.rs`, which outlines-core relies on, does the same); written here from the idea:
  1. split at the boundaries of the encoded length (1, 2, 3 or 4 bytes);
  2. then, from the last continuation byte up, split until for every suffix of i continuation
     bytes either lo and hi agree on everything above them, or the suffix runs over its full
     range (lo's low bits all 0 and hi's all 1). Then byte k of the encodings of lo and hi bound
     byte k of every code point in between, independently: the range is a product.
"""
from __future__ import annotations

ByteSeq = list[tuple[int, int]]          # one inclusive (lo, hi) byte range per byte position

LENGTH_LIMITS = (0x7F, 0x7FF, 0xFFFF)    # the last code point of each UTF-8 length (1, 2, 3 bytes)


def utf8_sequences(ranges) -> list[ByteSeq]:
    """All byte-range sequences whose union is exactly the UTF-8 encodings of `ranges`
    (inclusive code point pairs, none of which may contain a surrogate)."""
    out: list[ByteSeq] = []
    for lo, hi in ranges:
        _split(lo, hi, out)
    return out


def _split(lo: int, hi: int, out: list[ByteSeq]) -> None:
    for limit in LENGTH_LIMITS:                        # 1. one encoded length at a time
        if lo <= limit < hi:
            _split(lo, limit, out)
            _split(limit + 1, hi, out)
            return
    n = len(chr(lo).encode("utf-8"))
    for i in range(1, n):                              # 2. align the last i continuation bytes
        low_bits = (1 << (6 * i)) - 1
        if lo & ~low_bits != hi & ~low_bits:           # lo and hi differ above those bytes ...
            if lo & low_bits != 0:                     # ... and lo does not start a full block
                _split(lo, lo | low_bits, out)
                _split((lo | low_bits) + 1, hi, out)
                return
            if hi & low_bits != low_bits:              # ... or hi does not end one
                _split(lo, (hi & ~low_bits) - 1, out)
                _split(hi & ~low_bits, hi, out)
                return
    out.append(list(zip(chr(lo).encode("utf-8"), chr(hi).encode("utf-8"))))
