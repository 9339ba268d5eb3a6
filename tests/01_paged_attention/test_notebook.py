"""The chapter's walkthrough notebook executes top to bottom within its budget."""
import pytest

from notebook_runner import run_notebook


@pytest.mark.notebook
def test_notebook_runs():
    nb = run_notebook("01_paged_attention", budget_s=60)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "backends agree bit for bit: True" in outputs
    assert "NaN: True" not in outputs
    assert "padding row (seq_len 0) is all zeros: True" in outputs
