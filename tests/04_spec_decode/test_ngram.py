"""N-gram prompt lookup: the numpy search == the readable double loop, on every input."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from spec_decode.ngram_proposer import NgramProposer, find_ngram, find_ngram_reference
from spec_decode.proposer import DraftRequest


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), min_n=st.integers(1, 4),
       extra=st.integers(0, 3), k=st.integers(1, 6), cap=st.one_of(st.none(), st.integers(0, 50)))
def test_numpy_equals_reference(tokens, min_n, extra, k, cap):
    """A 4-letter alphabet makes repeats, overlaps and ties everywhere."""
    max_n = min_n + extra
    got = find_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k, cap).tolist()
    assert got == find_ngram_reference(tokens, min_n, max_n, k, cap)


def test_worked_examples():
    # vLLM's docstring example: [4,2,3] has no earlier match, [2,3] does; 3 tokens follow it.
    assert find_ngram_reference([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]
    # Two earlier occurrences of the longest suffix [1, 2]: the EARLIEST wins (vLLM's rule).
    ctx = [5, 1, 2, 7, 1, 2, 8, 1, 2]
    assert find_ngram_reference(ctx, 2, 2, 3) == [7, 1, 2]
    # The longest suffix wins over a shorter, earlier one: [9, 1, 2] occurs only once.
    ctx = [1, 2, 6, 9, 1, 2, 4, 9, 1, 2]
    assert find_ngram_reference(ctx, 1, 3, 2) == [4, 9]
    # An occurrence may overlap the suffix: [a a a a] -> the next 'a'.
    assert find_ngram_reference([3, 3, 3, 3], 1, 3, 5) == [3]
    # No match shorter than prompt_lookup_min counts; nothing past max_model_len.
    assert find_ngram_reference([1, 2, 3, 1], 2, 3, 3) == []
    assert find_ngram_reference([1, 2, 3, 1, 2], 2, 3, 3, max_model_len=6) == [3]
    for ctx in ([1, 2, 3, 4, 2, 3], [5, 1, 2, 7, 1, 2, 8, 1, 2], [3, 3, 3, 3], []):
        assert find_ngram(np.array(ctx, dtype=np.int64), 1, 3, 3).tolist() == find_ngram_reference(ctx, 1, 3, 3)


def test_long_context_with_a_copy():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 50_000, 3000)
    ctx = np.concatenate((doc, rng.integers(0, 50_000, 500), doc[:1200]))   # the output is copying the doc
    assert find_ngram(ctx, 2, 4, 8).tolist() == doc[1200:1208].tolist()
    assert find_ngram(ctx, 2, 4, 8).tolist() == find_ngram_reference(ctx.tolist(), 2, 4, 8)


def test_proposer_interface():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    reqs = [DraftRequest("a", [1, 2, 3, 4, 2, 3]), DraftRequest("b", [9]), DraftRequest("c", [5, 6, 5])]
    assert p.propose(reqs) == [[4, 2, 3], [], [6, 5]]
    table = np.zeros((3, 10), dtype=np.int64)
    for i, r in enumerate(reqs):
        table[i, :len(r.token_ids)] = r.token_ids
    assert p.propose_batch(table, np.array([6, 1, 3])) == [[4, 2, 3], [], [6, 5]]
    p.remove_requests(["a"])


@pytest.mark.parametrize("kwargs", [dict(num_speculative_tokens=0), dict(num_speculative_tokens=-2),
                                    dict(num_speculative_tokens=3, prompt_lookup_min=0),
                                    dict(num_speculative_tokens=3, prompt_lookup_min=4, prompt_lookup_max=2)])
def test_bad_config(kwargs):
    with pytest.raises(ValueError):
        NgramProposer(**kwargs)
