"""What the three composition-matrix test files share (test_composition_llm.py, test_composition_serve_*.py):
the pairs (benchmarks/composition_matrix.py defines them and runs them), the engines' resources, the oracle."""
from __future__ import annotations

import pytest

from benchmarks import composition_matrix as cm

# Refusals of ours that vLLM 0.32 does not make: composing them is open work, so each is a strict
# xfail — the test fails the day the pair composes, and the mark must go.
NOT_COMPOSED = {
    frozenset({"KV connector (scratch)", "TP=2"}), frozenset({"KV connector (scratch)", "PP=2"}),
    frozenset({"KV connector (Mooncake)", "TP=2"}), frozenset({"KV connector (Mooncake)", "PP=2"}),
}
GAP = ("the KV connector's worker half runs in the engine's one model runner: each rank saving and loading its "
       "own heads (vLLM's KVConnectorBase_V1 in every worker) is not built yet")


def pair_params(pairs):
    return [pytest.param(p, id=" + ".join(dict.fromkeys(p)),
                         marks=[pytest.mark.xfail(strict=True, reason=GAP)] if frozenset(p) in NOT_COMPOSED else [])
            for p in pairs]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(Context, the plain engine's results, as the server reports them)."""
    from benchmarks.bench_engine import tiny_model_dir
    root = tmp_path_factory.mktemp("composition")
    ctx = cm.Context(tiny_model_dir(root), root)
    expect, served = cm.plain_results(ctx)
    yield ctx, expect, served
    ctx.close()
