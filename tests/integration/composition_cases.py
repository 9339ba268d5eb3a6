"""What the three composition-matrix test files share (test_composition_llm.py, test_composition_serve_*.py):
the pairs (benchmarks/composition_matrix.py defines them and runs them), the engines' resources, the oracle."""
from __future__ import annotations

import pytest

from benchmarks import composition_matrix as cm

def pair_params(pairs):
    return [pytest.param(p, id=" + ".join(dict.fromkeys(p))) for p in pairs]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(Context, the plain engine's results, as the server reports them)."""
    from benchmarks.bench_engine import tiny_model_dir
    root = tmp_path_factory.mktemp("composition")
    ctx = cm.Context(tiny_model_dir(root), root)
    expect, served = cm.plain_results(ctx)
    yield ctx, expect, served
    ctx.close()
