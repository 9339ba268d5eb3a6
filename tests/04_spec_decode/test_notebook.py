"""The chapter's walkthrough notebook executes top to bottom within its budget, and its checks hold."""
import pytest

from notebook_runner import run_notebook


@pytest.mark.notebook
def test_notebook_runs():
    nb = run_notebook("04_spec_decode", budget_s=90)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "emitted: ['cat'" in outputs
    assert "greedy output identical to plain decoding: True" in outputs
    assert "correct sampler passes at significance 1e-4: True" in outputs
    assert "buggy sampler rejected (p < 1e-12): True" in outputs
    assert "one tree pass == every branch separately: True" in outputs
    assert "computed=7 tokens=8" in outputs
    assert "held-out (greedy, k=4)" in outputs and "parents: [-1, 0" in outputs   # the head's numbers; a tree
