"""The composition matrix through the OpenAI server (AsyncLLM, its core in a process of its own, asked
over HTTP), half 1 of the pairs CI runs through the server (composition_cases.py): each gives the plain engine's tokens, children, beams and logprobs, or is
refused where vLLM 0.32 refuses the same pair, with its reason (benchmarks/composition_matrix.py). After
each pair the server's core reports every KV block free."""
from __future__ import annotations

import pytest

from benchmarks import composition_matrix as cm
from composition_cases import SERVE_PAIRS, matrix, pair_params  # noqa: F401 (the fixture)

PAIRS = SERVE_PAIRS[1::2]


@pytest.mark.parametrize("pair", pair_params(PAIRS))
def test_pair_through_the_server(pair, matrix):
    ctx, expect = matrix
    assert cm.run_pair_serve(ctx, pair, expect) in ("same tokens", *(
        f"refused as vLLM ({where})" for _, where in cm.VLLM_REFUSES.values()))
