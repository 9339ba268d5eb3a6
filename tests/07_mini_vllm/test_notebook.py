"""The walkthrough notebook executes top to bottom within its budget."""
import pytest


@pytest.mark.notebook
@pytest.mark.model
def test_notebook_runs():
    from notebook_runner import run_notebook

    run_notebook("07_mini_vllm", budget_s=120)
