"""Hidden edge cases of chapters 04 and 06 (tests/course/tasks/conftest.py): inputs at the
ends of the range, each rule stated in the function's docstring (or its task's ASSIGNMENT.md)."""
import numpy as np
import pytest

from global_prefix_cache.grouping import group_concurrent_contiguous
from spec_decode.ngram_proposer import find_ngram, find_ngram_reference


def test_grouping_nothing_and_one_block():
    """No blocks: no runs; one block: one run of one; the lengths must agree (ValueError)."""
    assert group_concurrent_contiguous([], []) == ([], [])
    assert group_concurrent_contiguous([7], [0]) == ([[7]], [[0]])
    with pytest.raises(ValueError):
        group_concurrent_contiguous([1, 2], [1])


def test_grouping_breaks_on_a_step_down_or_a_repeat():
    """A run continues only when BOTH sides go up by exactly one: a step back, a repeated id or a
    jump on one side starts a new run."""
    src, dst = group_concurrent_contiguous([3, 4, 4, 5, 2, 3], [0, 1, 2, 3, 4, 5])
    assert src == [[3, 4], [4, 5], [2, 3]] and dst == [[0, 1], [2, 3], [4, 5]]
    src, dst = group_concurrent_contiguous([0, 1, 2], [9, 8, 7])
    assert src == [[0], [1], [2]] and dst == [[9], [8], [7]]


@pytest.mark.parametrize("tokens,expected", [
    ([], []), ([5], []), ([5, 5], []),                     # too short for a suffix of min_n=2 and a draft
    ([1, 2, 3, 1, 2], [3, 1, 2]),                          # the earliest occurrence of the longest suffix
    ([1, 2, 9, 1, 2, 8, 1, 2], [9, 1, 2]),
    ([1, 2, 3, 4], []),                                    # no earlier occurrence
])
def test_ngram_at_the_ends(tokens, expected):
    """find_ngram and find_ngram_reference agree on contexts too short to match, on no match,
    and pick the earliest occurrence of the longest matching suffix (k caps the draft)."""
    assert find_ngram_reference(tokens, 2, 3, 3) == expected
    got = find_ngram(np.asarray(tokens, dtype=np.int64), 2, 3, 3)
    assert got.tolist() == expected


def test_ngram_draft_stops_at_max_model_len():
    """A draft never takes the sequence past max_model_len."""
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert find_ngram_reference(tokens, 2, 2, 5, max_model_len=9) == [3, 4]
    assert find_ngram(np.asarray(tokens), 2, 2, 5, max_model_len=9).tolist() == [3, 4]
