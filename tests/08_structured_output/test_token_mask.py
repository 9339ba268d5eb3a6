"""token_mask.py: token masks from the PDA, checked against xgrammar's bitmask on SmolLM2's vocabulary.

  * along token paths (real tokenizations of documents, and random paths drawn from our own masks)
    the bitmask `PDAGrammar.fill_bitmask` writes equals xgrammar's `fill_next_token_bitmask`, word for
    word, for the JSON and the arithmetic grammar; the split mask equals the plain trie walk;
  * the split leaves only a sliver of the vocabulary to walk at run time (its whole point);
  * the trie and the plain walk against token-by-token PDA runs on a small vocabulary; the packed
    layout against xgrammar's own converters; the StructuredOutputGrammar contract (accept, validate,
    rollback, EOS, termination, reset).
One difference is expected and excluded: xgrammar's TokenizerInfo for SmolLM2 lists no special
tokens, so it allows `<|im_start|>` etc. inside a JSON string as literal text; we never allow them.
"""
import random

import numpy as np
import pytest
import torch
import xgrammar as xgr

from structured_output.grammar import JSON_GRAMMAR
from structured_output.pda import DEAD, compile_grammar
from structured_output.token_index import pack_bits
from structured_output.token_mask import PDAGrammar, TokenMasker, VocabTrie
from structured_output.vocabulary import eos_token_ids, token_bytes

ARITH_GRAMMAR = r"""
root   ::= expr
expr   ::= term ( [ ]* [-+] [ ]* term )*
term   ::= factor ( [ ]* [*/] [ ]* factor )*
factor ::= number | "(" [ ]* expr [ ]* ")" | "-" factor
number ::= [0-9]+ ( "." [0-9]+ )?
"""
GRAMMARS = {"json": JSON_GRAMMAR, "arith": ARITH_GRAMMAR}
DOCUMENTS = {
    "json": ['{"name": "Ada Lovelace", "born": 1815, "tags": ["math", "po\\u00e9t"], "ok": true}',
             '{\n  "x": {"y": [1.5e3, null, -0, {}]},\n  "z": "ünï\\"cødé 😀"\n}'],
    "arith": ["(12 + 3.5) * -(4 / 2) - 7", "((1))*2+3 / (44-5.25)"],
}
VOCAB = 49152


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from mini_vllm.default_model import default_model_path
    tok = AutoTokenizer.from_pretrained(default_model_path())
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    return tok, token_bytes(tok), eos_token_ids(tok), xgr.GrammarCompiler(info)


@pytest.fixture(scope="module")
def maskers(smollm2):
    _, tb, _, _ = smollm2
    return {name: TokenMasker(compile_grammar(text), tb) for name, text in GRAMMARS.items()}


def unpack(words: torch.Tensor) -> np.ndarray:
    return np.unpackbits(words.numpy().view(np.uint8), bitorder="little").astype(bool)


def random_path(grammar: PDAGrammar, rng, length: int) -> list[int]:
    """Tokens drawn from our own masks, a third each from: the allowed context-DEPENDENT tokens (they
    cross rule boundaries: `",` `}]`), short tokens (brackets, quotes, digits), any allowed token.
    Never one that would leave nothing but EOS to say."""
    masker, pda, path = grammar.masker, grammar.masker.pda, []
    for _ in range(length):
        mask = grammar.allowed_tokens()
        allowed = [t for t in np.flatnonzero(mask).tolist() if t not in grammar.eos_token_ids]
        short = [t for t in allowed if len(masker.token_bytes[t]) <= 2]
        dependent = sorted({t for s in pda.stacks(grammar.matcher.state) if pda.nodes[pda.top[s]].edges
                            for t in masker.classify(pda.top[s])[1].tolist() if mask[t]})
        for _attempt in range(20):
            pools = [p for p in (dependent, short) if p and rng.random() < 0.5]
            t = rng.choice(pools[0] if pools else allowed)
            if pda.next_bytes(pda.advance(grammar.matcher.state, grammar.masker.token_bytes[t])):
                break
        assert grammar.accept_tokens("r", [t])
        path.append(t)
    grammar.reset()
    return path


@pytest.mark.model
@pytest.mark.parametrize("name", list(GRAMMARS))
def test_bitmask_equals_xgrammar_along_token_paths(name, smollm2, maskers):
    tok, tb, eos, compiler = smollm2
    masker = maskers[name]
    compiled = compiler.compile_grammar(xgr.Grammar.from_ebnf(GRAMMARS[name]))
    no_bytes = pack_bits(np.array([b is None and t not in eos for t, b in enumerate(tb)]), VOCAB // 32)
    rng = random.Random(name)
    paths = [tok.encode(doc, add_special_tokens=False) for doc in DOCUMENTS[name]]
    paths += [random_path(PDAGrammar(masker, VOCAB, eos), rng, 20) for _ in range(2)]
    theirs = xgr.allocate_token_bitmask(1, VOCAB)
    ours = torch.zeros_like(theirs)
    for path in paths:
        grammar, matcher = PDAGrammar(masker, VOCAB, eos), xgr.GrammarMatcher(compiled)
        for step, t in enumerate(path + [None]):
            matcher.fill_next_token_bitmask(theirs)
            grammar.fill_bitmask(ours, 0)
            expected = theirs[0] & ~no_bytes                 # xgrammar lets special tokens through as text
            assert torch.equal(ours[0], expected), (name, tok.decode(path[:step]), step)
            state = grammar.matcher.state
            assert np.array_equal(masker.split_mask(state), masker.plain_mask(state))
            if t is not None:
                assert grammar.accept_tokens("r", [t]) and matcher.accept_token(t)
        if grammar.matcher.can_end():                        # EOS allowed exactly here; it terminates
            e = min(eos)
            assert unpack(ours[0])[e] and grammar.accept_tokens("r", [e]) and matcher.accept_token(e)
            assert grammar.is_terminated() and matcher.is_terminated()


@pytest.mark.model
def test_split_walks_only_a_sliver_of_the_vocabulary(smollm2, maskers):
    tok, _, _, _ = smollm2
    masker = maskers["json"]
    pda = masker.pda
    inside_string = pda.advance(pda.start, b'{"note": "a long')
    after_colon = pda.advance(pda.start, b'{"note": ')
    for state in (inside_string, after_colon):
        mask = masker.split_mask(state)
        assert masker.last_walked < 0.01 * VOCAB, masker.last_walked
        assert np.array_equal(mask, masker.plain_mask(state))
    assert masker.split_mask(inside_string).sum() > 0.9 * VOCAB      # and still almost all are allowed there
    # Every precomputed class agrees with running each token from a lone frame on that node.
    node = pda.top[next(iter(pda.stacks(inside_string)))]
    accepted, dependent = masker.classify(node)
    probe = pda.probe_state(node)
    for t in random.Random(0).sample(range(VOCAB), 300) + dependent[:50].tolist():
        data = masker.token_bytes[t]
        if data:
            assert accepted[t] == (pda.advance(probe, data) != DEAD), data


# --- small vocabularies: the trie, the plain walk, the packed layout, the grammar contract ------

SMALL = [None, b"{", b"}", b'"', b'"a', b'a"', b":", b" ", b"1", b"12", b'{"a":1}', b"\xc3", b"\xa9", b"x",
         b"", b'"}', b"1}", b"a", b"1", b"\x00"]           # id 0: EOS (no bytes); 14: empty; 18: a duplicate


def test_trie_holds_every_token_and_plain_walk_equals_token_by_token_runs():
    rng = random.Random(3)
    vocab = SMALL + [bytes(rng.choice(b'{}[]":,01 ae\\\xc3\xa9') for _ in range(rng.randint(1, 5))) for _ in range(400)]
    trie = VocabTrie(vocab)
    for t, data in enumerate(vocab):
        if not data:
            assert t not in trie.order
            continue
        node = 0
        for byte in data:
            node = dict(trie.children[node])[byte]
        assert t in trie.order[trie.lo[node]:trie.end[node]]
        assert trie.lo[node] <= list(trie.order).index(t) < trie.hi[node]
    masker = TokenMasker(compile_grammar(JSON_GRAMMAR), vocab)
    pda = masker.pda
    for prefix in [b"", b"{", b'{"a', b'{"a":', b'{"a": [1', b'{"a": "\xc3', b'{"a":1}']:
        state = pda.advance(pda.start, prefix)
        expected = [bool(d) and pda.advance(state, d) != DEAD for d in vocab]
        assert masker.plain_mask(state).tolist() == expected, prefix
        assert masker.split_mask(state).tolist() == expected, prefix


def test_packed_layout_matches_xgrammar_converters():
    rng = np.random.default_rng(0)
    allowed = rng.random(128) < 0.5
    allowed[[31, 63, 95, 127]] = True                           # bit 31: the sign bit of a word
    words = pack_bits(allowed, 5).numpy()                        # one word more than needed
    assert words.dtype == np.int32 and words[4] == 0 and (words[:4] < 0).all()
    assert torch.equal(torch.from_numpy(words[:4])[None], xgr.testing.bool_mask_to_bitmask(torch.from_numpy(allowed)[None]))
    assert xgr.testing.bitmask_to_bool_mask(torch.from_numpy(words)[None], 128)[0].numpy().tolist() == allowed.tolist()


def test_grammar_contract_accept_validate_rollback_terminate():
    masker = TokenMasker(compile_grammar(JSON_GRAMMAR), SMALL)
    g = PDAGrammar(masker, vocab_size=40, eos_token_ids={0})
    allowed = lambda: set(np.flatnonzero(g.allowed_tokens()).tolist())   # noqa: E731
    assert allowed() == {1, 10}                                   # "{" and '{"a":1}'
    assert g.accept_tokens("r", [1, 4, 5, 2, 6]) is False         # `}` after a key: stops there
    assert g.matcher.num_accepted == 3                            # '{', '"a', 'a"' stayed accepted
    assert g.validate_tokens([6, 7, 9, 2, 2]) == [6, 7, 9, 2]     # ': 12}' then nothing: no move
    assert g.matcher.num_accepted == 3
    assert 11 not in allowed() and 0 not in allowed()
    assert g.accept_tokens("r", [6, 3, 11, 12])                   # a value "é" split inside the character
    before = allowed()
    assert g.accept_tokens("r", [3]) and not g.accept_tokens("r", [0])   # EOS refused: object still open
    g.rollback(1)
    assert allowed() == before
    assert g.accept_tokens("r", [15]) and allowed() == {0}        # '"}' closes it all: only EOS now
    assert not g.is_terminated() and g.accept_tokens("r", [0]) and g.is_terminated()
    assert not g.accept_tokens("r", [0]) and allowed() == {0}
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    g.fill_bitmask(bitmask, 1)
    assert bitmask.tolist() == [[0, 0], [1, 0]]                   # row 1: only token 0; padding never
    g.rollback(2)                                                 # EOS and '"}'
    assert not g.is_terminated() and allowed() == before
    assert all(t not in allowed() for t in (0, 14))               # no special, no empty token
    g.reset()
    assert g.matcher.num_accepted == 0 and allowed() == {1, 10}
    assert g.accept_tokens("r", [10, 0]) and g.is_terminated()
