"""What the three composition-matrix test files share (test_composition_llm.py, test_composition_serve_*.py):
the pairs (benchmarks/composition_matrix.py defines them and runs them), the engines' resources, the oracle.

Which path runs which pair in CI. `python -m benchmarks.composition_matrix` runs every pair through both
front ends (LLM and the server) and commits the verdicts (results/composition_matrix.json, the README's
table). CI checks every pair ONCE: each feature alone through both paths, and each pair of two features
through one of them, alternately in the matrix's order (a pair with DP, which has no LLM path, through
the server). The front ends are the same engine behind a different door — the door's own behaviour is
the server's and AsyncLLM's tests — so a pair's composition is the engine's, and one door shows it; the
split halves the matrix's share of CI time."""
from __future__ import annotations

import pytest

from benchmarks import composition_matrix as cm

def _has_llm_path(pair) -> bool:
    return all(cm.BY_NAME[n].llm for n in pair)


_PAIRS = [p for p in cm.pairs() if p[0] != p[1]]
SINGLES = [p for p in cm.pairs() if p[0] == p[1]]
LLM_PAIRS = [p for p in SINGLES if _has_llm_path(p)] + [p for i, p in enumerate(_PAIRS)
                                                         if i % 2 == 0 and _has_llm_path(p)]
SERVE_PAIRS = SINGLES + [p for i, p in enumerate(_PAIRS) if i % 2 == 1 or not _has_llm_path(p)]


def pair_params(pairs):
    return [pytest.param(p, id=" + ".join(dict.fromkeys(p))) for p in pairs]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(Context, (the plain engine's results, as the server reports them))."""
    from benchmarks.bench_engine import tiny_model_dir
    root = tmp_path_factory.mktemp("composition")
    ctx = cm.Context(tiny_model_dir(root), root)
    yield ctx, cm.plain_results(ctx)
    ctx.close()
