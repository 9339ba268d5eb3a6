"""The target distribution p: temperature -> min-p -> top-k -> top-p, batched == per row, and
the random-number helpers (per-request seeding)."""
import math

import torch
from hypothesis import given, settings, strategies as st

from spec_decode.sampling import (SpecSamplingMetadata, compute_probs, expand_batch_to_tokens,
                                  generate_inv_exponential, generate_uniform_probs)


def row_reference(logits, temperature, top_k, top_p, min_p):
    """One row, spelled out on Python lists."""
    t = temperature if temperature > 0 else 1.0
    x = [v / t for v in logits.tolist()]
    V = len(x)
    if min_p > 0:
        m = max(x)
        p = [math.exp(v - m) for v in x]
        s = sum(p)
        p = [v / s for v in p]
        x = [v if p[i] >= min_p * max(p) else -math.inf for i, v in enumerate(x)]
    if 1 <= top_k < V:
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if top_p < 1:
        m = max(x)
        p = [math.exp(v - m) if v > -math.inf else 0.0 for v in x]
        s = sum(p)
        p = [v / s for v in p]
        order = sorted(range(V), key=lambda i: -x[i])
        mass = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and mass >= top_p:
                x[i] = -math.inf
            mass += p[i]
    m = max(x)
    p = [math.exp(v - m) if v > -math.inf else 0.0 for v in x]
    s = sum(p)
    return torch.tensor([v / s for v in p])


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from([0.0, 0.3, 1.0, 2.5]), st.integers(-1, 12),
                               st.sampled_from([1.0, 0.9, 0.5, 0.05]), st.sampled_from([0.0, 0.1])),
                     min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_compute_probs_equals_row_reference(rows, seed):
    g = torch.Generator().manual_seed(seed)
    num_draft = [1 + (i % 3) for i in range(len(rows))]
    logits = torch.randn(sum(num_draft), 10, generator=g) * 3
    sm = SpecSamplingMetadata.from_lists([r[0] for r in rows], top_k=[r[1] for r in rows],
                                         top_p=[r[2] for r in rows], min_p=[r[3] for r in rows])
    probs = compute_probs(logits, num_draft, sm)
    req = expand_batch_to_tokens(torch.arange(len(rows)), num_draft).tolist()
    for t, i in enumerate(req):
        torch.testing.assert_close(probs[t], row_reference(logits[t], *rows[i]).float(), atol=1e-5, rtol=1e-4)


def test_seeded_randomness_depends_only_on_the_request():
    def draws(num_draft, row):
        gens = {row: torch.Generator().manual_seed(7)}
        shared = torch.Generator().manual_seed(len(num_draft))
        u = generate_uniform_probs(num_draft, gens, shared)
        e = generate_inv_exponential(num_draft, 11, gens, shared)
        start = sum(num_draft[:row])
        return u[start:start + num_draft[row]], e[row]
    u1, e1 = draws([3], 0)
    u2, e2 = draws([2, 0, 3, 1], 2)
    assert torch.equal(u1, u2) and torch.equal(e1, e2)
    assert (e1 > 0).all() and torch.isfinite(e1).all()
