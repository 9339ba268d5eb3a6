"""The chapter's walkthrough notebook executes top to bottom."""
import pytest

from notebook_runner import run_notebook


@pytest.mark.notebook
def test_notebook_runs():
    run_notebook("05_chunked_prefill", budget_s=90)
