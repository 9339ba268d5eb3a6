"""The chapter's walkthrough notebook executes top to bottom (embedded layer only)."""
import pytest

from notebook_runner import run_notebook


@pytest.mark.notebook
def test_notebook_runs():
    run_notebook("06_global_prefix_cache", budget_s=90)
