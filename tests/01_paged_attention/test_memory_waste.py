"""Memory-waste arithmetic [Kwon 2025, Fig. 3.2]: exact on a hand-computed snapshot, invariants on random ones."""
import pytest
from hypothesis import given, settings, strategies as st

from paged_attention.memory_waste import POLICIES, Snapshot, kv_usage, next_pow2, sharegpt_like_snapshot


def test_hand_computed_snapshot():
    # request A: prompt 10, will output 25, has output 5 (15 tokens cached); request B: prompt 3, output 0.
    snap = Snapshot(prompt_lens=[10, 3], output_lens=[25, 0], generated=[5, 0])
    got = {p: kv_usage(snap, p, block_size=16, max_seq_len=64) for p in POLICIES}
    assert (got["max"].allocated, got["max"].used, got["max"].reserved, got["max"].internal) == (128, 18, 20, 90)
    assert (got["pow2"].allocated, got["pow2"].reserved, got["pow2"].internal) == (10 + 32 + 3 + 1, 20, 7 + 1)
    assert (got["oracle"].allocated, got["oracle"].reserved, got["oracle"].internal) == (38, 20, 0)
    assert (got["paged"].allocated, got["paged"].reserved, got["paged"].internal) == (32, 0, 1 + 13)
    assert got["paged"].utilization == 18 / 32


def test_next_pow2():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 25, 32, 33)] == [1, 1, 2, 4, 32, 32, 64]


def test_bad_input():
    with pytest.raises(ValueError, match="0 <= generated <= output"):
        Snapshot([4], [2], [3])
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        kv_usage(Snapshot([4], [5], [0]), "max", max_seq_len=8)
    with pytest.raises(ValueError, match="unknown policy"):
        kv_usage(Snapshot([4], [1], [0]), "buddy")


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 500), st.integers(0, 500), st.floats(0, 1)), min_size=1, max_size=30),
       block_size=st.sampled_from([1, 8, 16, 256]))
def test_accounting_invariants(reqs, block_size):
    snap = Snapshot([p for p, _, _ in reqs], [o for _, o, _ in reqs], [int(f * o) for _, o, f in reqs])
    usages = {p: kv_usage(snap, p, block_size, max_seq_len=1024) for p in POLICIES}
    for u in usages.values():
        assert u.allocated == u.used + u.reserved + u.internal      # every slot is accounted for once
        assert u.used == usages["paged"].used                       # same tokens, whatever the policy
    assert usages["paged"].internal < block_size * len(reqs)        # < one block of slack per request
    assert usages["paged"].reserved == 0
    assert usages["max"].allocated >= usages["pow2"].allocated >= usages["oracle"].allocated >= usages["paged"].used
    if block_size == 1:
        assert usages["paged"].utilization == 1.0


def test_sharegpt_like_workload_reproduces_the_papers_ordering():
    snap = sharegpt_like_snapshot(1000)
    util = {p: kv_usage(snap, p).utilization for p in POLICIES}
    assert util["max"] < util["pow2"] < util["oracle"] < util["paged"]
    assert util["paged"] > 0.95 and util["max"] < 0.4
