"""Every token id -> the exact BYTES it adds to the output: what the token index walks the DFA with.

A tokenizer's vocabulary stores token STRINGS in an encoding of its own, and the grammar needs the
bytes the detokenizer will produce. Two encodings cover the HuggingFace models vLLM serves
(outlines-core's `src/vocabulary/processor.rs` and xgrammar's `TokenizerInfo` make the same split):

  * byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): every byte 0..255 is mapped to a printable
    character (GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the other
    68 bytes become U+0100.. in order; so 'Ġ' is the space 0x20, 'Ċ' the newline 0x0A). The
    bytes are that table inverted, character by character.
  * SentencePiece style (Llama 2, Mistral, Gemma): the piece is text with '▁' standing for a
    space, and with byte fallback a piece `<0x0A>` is ONE raw byte (a character the vocabulary
    lacks is spelled out byte by byte). The leading space of a word-initial piece is real: the
    decoder drops it only at the very start of a text, which a token mask never sees.

Special tokens (added tokens flagged special: <|im_end|>, </s> ...) have no bytes (None): the
detokenizer skips them, and a grammar can never produce one — except EOS, which the token index
allows exactly in accepting states. The style is read from the tokenizer's own decoder
configuration, never guessed from its name.
"""
from __future__ import annotations

import json
import re
from typing import Any

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table (the idea from `encoder.py` of openai/gpt-2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:                                    # not printable: shift past Latin-1, in byte order
            table[b] = chr(256 + extra)
            extra += 1
    return table


UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def backend_of(tokenizer: Any):
    """The `tokenizers.Tokenizer` behind a transformers tokenizer (or the Tokenizer itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise ValueError(f"{type(tokenizer).__name__} is not backed by a `tokenizers` Tokenizer")
    return backend


def _components(config: dict | None) -> list[dict]:
    """A decoder / pre-tokenizer config flattened (a "Sequence" holds a list of them)."""
    if not config:
        return []
    if config.get("type") == "Sequence":
        inner = config.get("decoders") or config.get("pretokenizers") or []
        return [c for sub in inner for c in _components(sub)]
    return [config]


def detect_style(config: dict) -> str:
    """'byte_level' or 'sentencepiece', from the tokenizer's decoder (its JSON configuration)."""
    # The decoder says how pieces become text; a tokenizer saved without one still has the
    # matching pre-tokenizer (ByteLevel / Metaspace).
    kinds = {c["type"] for c in _components(config.get("decoder") or config.get("pre_tokenizer"))}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"Metaspace", "ByteFallback"} or ("Replace" in kinds and config["model"].get("byte_fallback")):
        return "sentencepiece"
    raise ValueError(f"cannot tell how this tokenizer's tokens map to bytes (decoder parts: {sorted(kinds)})")


def _space_symbol(config: dict) -> str:
    """The character standing for a space ('▁' unless the configuration says otherwise)."""
    for part in _components(config.get("decoder")) + _components(config.get("pre_tokenizer")):
        if part["type"] == "Metaspace":
            return part.get("replacement", "▁")
        if part["type"] == "Replace" and part.get("content") == " ":
            return part["pattern"].get("String", "▁")
    return "▁"


def piece_bytes(piece: str, style: str, space: str = "▁", byte_fallback: bool = True) -> bytes:
    """One vocabulary entry's bytes."""
    if style == "byte_level":
        return bytes(UNICODE_TO_BYTE[c] for c in piece)
    fallback = BYTE_FALLBACK.fullmatch(piece) if byte_fallback else None
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return piece.replace(space, " ").encode("utf-8")


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """Index = token id: the token's bytes, or None for special tokens and unused ids."""
    backend = backend_of(tokenizer)
    config = json.loads(backend.to_str())
    style, space = detect_style(config), _space_symbol(config)
    byte_fallback = bool(config["model"].get("byte_fallback"))
    vocab = backend.get_vocab(with_added_tokens=False)          # piece -> id, the model's own entries
    added = {t["id"]: t for t in config.get("added_tokens", [])}
    size = max([*vocab.values(), *added, -1]) + 1
    out: list[bytes | None] = [None] * size
    for piece, i in vocab.items():
        out[i] = piece_bytes(piece, style, space, byte_fallback)
    for i, token in added.items():
        # An added token matches its literal text in the input, so its bytes are that text; a
        # special one is skipped by the detokenizer: no bytes at all.
        out[i] = None if token["special"] else token["content"].encode("utf-8")
    return out


def eos_token_ids(tokenizer: Any) -> set[int]:
    """The ids that end generation, as the tokenizer declares them."""
    ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple, set)) else {ids}
