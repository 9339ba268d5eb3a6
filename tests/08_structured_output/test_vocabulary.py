"""Token id -> bytes (structured_output.vocabulary), on both vocabulary styles.

Oracles: the tokenizer itself (the bytes of the tokens of `encode(text)` must spell `text`) and
xgrammar's own decoding of the same vocabulary (`TokenizerInfo.decoded_vocab`). Byte-level BPE is
SmolLM2's real tokenizer; SentencePiece-style byte fallback has no tokenizer on disk, so one is
trained here (BPE with byte_fallback, Metaspace, Llama's decoder) on stdlib source in well under
a second.
"""
import json
import pathlib

import pytest
import xgrammar as xgr
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from structured_output.vocabulary import bytes_to_unicode, detect_style, eos_token_ids, token_bytes

SPECIALS = ["<unk>", "<s>", "</s>"]


def smollm2_tokenizer():
    import subprocess

    from transformers import AutoTokenizer

    from mini_vllm.default_model import default_model_path
    try:
        return AutoTokenizer.from_pretrained(default_model_path())
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"SmolLM2's tokenizer is not installed here ({type(e).__name__}: {e})")


def train_sentencepiece_style() -> Tokenizer:
    """Llama 2's layout: <unk> <s> </s>, then the 256 byte pieces <0x00>..<0xFF>, then BPE pieces."""
    sources = sorted(pathlib.Path(json.__file__).parent.parent.glob("*.py"))[:40]
    text = "".join(p.read_text(errors="ignore") for p in sources)[:300_000]
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator([text], trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIALS,
                                                            show_progress=False))
    model = json.loads(trained.to_str())["model"]
    pieces = [p for p, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if p not in SPECIALS]
    vocab = {p: i for i, p in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in model["merges"]], unk_token="<unk>",
                               byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()          # prepend_scheme "always"
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(SPECIALS)
    return tok


@pytest.fixture(scope="module")
def smollm2():
    tok = smollm2_tokenizer()
    return tok, token_bytes(tok)


@pytest.fixture(scope="module")
def sentencepiece():
    from transformers import PreTrainedTokenizerFast
    tok = train_sentencepiece_style()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return tok, hf, token_bytes(tok)


# Text the tokenizers see as plain text: no surrogates, no '▁' (SentencePiece reads it as a space).
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="▁"), max_size=30)


def test_bytes_to_unicode_is_gpt2s_table():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[0x20] == "Ġ" and table[0x0A] == "Ċ" and table[ord("a")] == "a" and table[0xFF] == "ÿ"


def test_smollm2_is_byte_level_and_matches_xgrammar(smollm2):
    tok, tb = smollm2
    assert detect_style(json.loads(tok.backend_tokenizer.to_str())) == "byte_level"
    assert len(tb) == len(tok) == 49152
    added = json.loads(tok.backend_tokenizer.to_str())["added_tokens"]     # 17, all flagged special
    assert [i for i, b in enumerate(tb) if b is None] == [t["id"] for t in added] == list(range(17))
    decoded = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tb)).decoded_vocab
    assert all(b == decoded[i] for i, b in enumerate(tb) if b is not None)
    assert eos_token_ids(tok) == {tok.eos_token_id} == {2}


@settings(max_examples=40, deadline=None)
@given(text=TEXT)
def test_smollm2_token_bytes_spell_the_text(smollm2, text):
    """SmolLM2's vocabulary lacks a few single-byte tokens (0x04, 0xF1 ...: never seen in its
    training data), so it cannot spell some text at all; those texts are skipped."""
    tok, tb = smollm2
    ids = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assume(tok.decode(ids) == text)
    assert b"".join(tb[i] for i in ids) == text.encode("utf-8")


def test_sentencepiece_style_layout(sentencepiece):
    tok, hf, tb = sentencepiece
    assert detect_style(json.loads(tok.to_str())) == "sentencepiece"
    assert tb[:3] == [None, None, None]
    assert tb[3:259] == [bytes([b]) for b in range(256)]          # <0x00>..<0xFF>: one raw byte each
    assert tb[tok.token_to_id("▁t")] == b" t"
    assert token_bytes(hf) == tb and eos_token_ids(hf) == {2}
    decoded = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(tb)).decoded_vocab
    assert all(b == decoded[i] for i, b in enumerate(tb) if b is not None)


@settings(max_examples=40, deadline=None)
@given(text=TEXT)
def test_sentencepiece_token_bytes_spell_the_text(sentencepiece, text):
    """Metaspace (prepend_scheme "always") puts a space before the text unless it starts with one;
    that space is real in the token bytes (the decoder strips it only at the start of a text)."""
    tok, _, tb = sentencepiece
    ids = tok.encode(text, add_special_tokens=False).ids
    expected = (b" " if text and not text.startswith(" ") else b"") + text.encode("utf-8")
    assert b"".join(tb[i] for i in ids) == expected
    assert tok.decode(ids).encode() == expected.removeprefix(b" ")   # its decoder drops that one space


def test_unknown_decoder_is_refused():
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="cannot tell how this tokenizer's tokens map to bytes"):
        token_bytes(tok)
