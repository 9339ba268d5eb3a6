"""The composition matrix through `LLM`: every feature alone and its share of the pairs (composition_cases.py:
CI checks each pair through one front end) give the plain engine's greedy tokens, n > 1 children, beams,
penalties' tokens and logprobs — or are refused where vLLM 0.32 refuses the same pair, with its reason
(benchmarks/composition_matrix.py says what each feature and request is). Every engine's KV blocks are free
after each pair (tests/conftest.py's registry)."""
from __future__ import annotations

import pytest

from benchmarks import composition_matrix as cm
from composition_cases import LLM_PAIRS, matrix, pair_params  # noqa: F401 (the fixture)


@pytest.mark.parametrize("pair", pair_params(LLM_PAIRS))
def test_pair_through_llm(pair, matrix, engine_registry):
    ctx, expect = matrix
    assert cm.run_pair_llm(ctx, pair, expect, engine_registry) in ("same tokens", *(
        f"refused as vLLM ({where})" for _, where in cm.VLLM_REFUSES.values()))
