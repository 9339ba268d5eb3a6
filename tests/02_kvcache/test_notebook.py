"""The chapter's walkthrough notebook executes top to bottom, within its time budget."""
import pytest
from notebook_runner import run_notebook


@pytest.mark.notebook
def test_notebook_runs():
    nb = run_notebook("02_kvcache", budget_s=45)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
