"""FSMGrammar (structured_output.fsm_grammar): vLLM's per-request grammar semantics — accept,
validate without advancing, exact rollback, EOS termination — on a small vocabulary, then one
JSON document end to end with SmolLM2's real tokenizer."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.structured_output_backend import StructuredOutputGrammar, bitmask_words
from structured_output.fsm_grammar import FSMGrammar
from structured_output.json_schema import schema_to_regex
from structured_output.regex_dfa import compile_regex
from structured_output.token_index import TokenIndex

EOS = 0
VOCAB = [None, b"a", b"b", b"ab", b"1", b"x", b"ba", b"b1", b"11"]
A, B, AB, ONE, X, BA, B1, ONE_ONE = range(1, 9)
VOCAB_SIZE = 40                                     # wider than the vocabulary: a padded LM head


def grammar(pattern: str = "(ab|b)+1?", eos=(EOS,)) -> FSMGrammar:
    return FSMGrammar(TokenIndex(compile_regex(pattern), VOCAB, VOCAB_SIZE, eos))


def allowed(g: FSMGrammar) -> set[int]:
    mask = torch.zeros(1, bitmask_words(VOCAB_SIZE), dtype=torch.int32)
    g.fill_bitmask(mask, 0)
    t = torch.arange(VOCAB_SIZE)
    return set(torch.nonzero((mask[0][t // 32] >> (t % 32)) & 1).flatten().tolist())


def test_is_the_engine_interface():
    assert isinstance(grammar(), StructuredOutputGrammar)


def test_accept_stops_at_the_first_bad_token():
    g = grammar()
    assert g.accept_tokens("r", [A, B]) and g.num_processed_tokens == 2
    state = g.state
    assert not g.accept_tokens("r", [X])
    assert g.state == state and g.num_processed_tokens == 2
    assert not g.accept_tokens("r", [B, X, B])          # B is taken, X refused, the rest ignored
    assert g.num_processed_tokens == 3
    assert allowed(g) == {EOS, A, B, AB, ONE, BA, B1}


def test_validate_returns_the_allowed_prefix_without_advancing():
    g = grammar()
    g.accept_tokens("r", [B])
    before = (g.state, g.num_processed_tokens)
    assert g.validate_tokens([A, B, ONE, ONE]) == [A, B, ONE]   # "ab1" then a second "1" is too many
    assert g.validate_tokens([X]) == [] and g.validate_tokens([]) == []
    assert g.validate_tokens([B1, EOS, B]) == [B1, EOS]         # nothing after EOS
    assert (g.state, g.num_processed_tokens) == before


def test_eos_only_when_accepting_then_nothing_more():
    g = grammar()
    assert EOS not in allowed(g) and not g.accept_tokens("r", [EOS])
    assert g.accept_tokens("r", [AB, EOS]) and g.is_terminated()
    assert allowed(g) == set() and not g.accept_tokens("r", [B]) and g.validate_tokens([B]) == []
    g.rollback(1)
    assert not g.is_terminated() and EOS in allowed(g) and g.accept_tokens("r", [B])


def test_a_dead_end_is_an_empty_mask_not_termination():
    """An accepting end with no EOS id configured: no token at all is allowed (the engine fails such
    a request with a reason); only an accepted EOS terminates."""
    g = grammar("ab", eos=())
    assert g.accept_tokens("r", [A]) and not g.is_terminated()
    assert g.accept_tokens("r", [B]) and not g.is_terminated() and allowed(g) == set()


def test_rollback_and_reset_bounds():
    g = grammar()
    g.accept_tokens("r", [B, AB])
    with pytest.raises(ValueError, match="cannot roll back 3 tokens"):
        g.rollback(3)
    g.rollback(0)
    assert g.num_processed_tokens == 2
    g.reset()
    assert g.num_processed_tokens == 0 and g.state == g.index.start


def test_fill_bitmask_writes_only_its_row():
    g = grammar()
    mask = torch.full((3, bitmask_words(VOCAB_SIZE)), 7, dtype=torch.int32)
    g.fill_bitmask(mask, 1)
    assert (mask[0] == 7).all() and (mask[2] == 7).all()
    assert torch.equal(mask[1], g.index.allowed(g.state))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_rollback_restores_the_exact_state(data):
    """Walk a random allowed path (EOS included), then roll back k tokens: state, termination and
    mask equal those of a fresh grammar that accepted only the first n - k tokens."""
    pattern = data.draw(st.sampled_from(["(ab|b)+1?", "[ab1]{0,5}", "a*b*1+"]))
    g, path = grammar(pattern), []
    for _ in range(data.draw(st.integers(0, 8))):
        options = sorted(allowed(g))
        if not options:
            break
        token = data.draw(st.sampled_from(options))
        assert g.accept_tokens("r", [token])
        path.append(token)
    k = data.draw(st.integers(0, len(path)))
    g.rollback(k)
    fresh = grammar(pattern)
    assert fresh.accept_tokens("r", path[:len(path) - k])
    assert (g.state, g.is_terminated(), g.num_processed_tokens) == (fresh.state, fresh.is_terminated(),
                                                                     fresh.num_processed_tokens)
    assert allowed(g) == allowed(fresh)
    assert g.accept_tokens("r", path[len(path) - k:])   # the undone tokens are accepted again


def test_a_json_document_end_to_end_on_smollm2():
    import subprocess

    from transformers import AutoTokenizer

    from mini_vllm.default_model import default_model_path
    from structured_output.vocabulary import eos_token_ids, token_bytes
    try:
        tok = AutoTokenizer.from_pretrained(default_model_path())
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"SmolLM2's tokenizer is not installed here ({type(e).__name__}: {e})")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    index = TokenIndex(compile_regex(schema_to_regex(schema)), token_bytes(tok), 49152, eos_token_ids(tok))
    good = tok.encode('{"name": "Ann", "age": 31}', add_special_tokens=False)
    g = FSMGrammar(index)
    assert not g.accept_tokens("r", good[:-1] + [tok.eos_token_id])   # "}" missing: EOS refused
    g.rollback(g.num_processed_tokens)
    assert g.accept_tokens("r", good + [tok.eos_token_id]) and g.is_terminated()
    bad = tok.encode('{"age": 31}', add_special_tokens=False)
    g.reset()
    prefix = g.validate_tokens(bad)                       # stops where "age" leaves '{"name"'
    assert len(prefix) < len(bad) and '{"name"'.startswith(tok.decode(prefix))
    assert not g.accept_tokens("r", bad) and g.num_processed_tokens == len(prefix)
