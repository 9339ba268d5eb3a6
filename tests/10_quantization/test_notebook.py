"""The chapter's walkthrough notebook executes top to bottom within its budget, and its checks hold
(SmolLM2's first layers, quantized in the notebook; the roofline from the committed benchmark JSON)."""
import pytest

from notebook_runner import run_notebook


@pytest.mark.notebook
@pytest.mark.model
def test_notebook_runs():
    nb = run_notebook("10_quantization", budget_s=180)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "decoder linears 106,168,320 weights, lm_head 28,311,552" in outputs
    assert "int4 groups of 64" in outputs and "3.11x fewer than fp32" in outputs
    assert "-> word 0xfeba9870" in outputs                          # q + 8 = 0 7 8 9 a b e f, value 0 lowest
    assert "equal to compressed-tensors' pack_to_int32: True" in outputs
    assert "unpacked back: [-8, -1, 0, 1, 2, 3, 6, 7]" in outputs
    assert "torch == reference: True" in outputs
    assert "C++ == reference: True" in outputs or "do not build here" in outputs
    assert "'num_bits': 4" in outputs and "'group_size': 64" in outputs
    assert "int8_per_token_head  12 bytes a row, scale 0.02441, max error 0.0110" in outputs   # 3.1 / 127, <= scale / 2
