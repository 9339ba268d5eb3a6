"""The walkthrough notebook executes top to bottom within its budget."""
import pytest


@pytest.mark.notebook
@pytest.mark.model
def test_notebook_runs():
    from notebook_runner import run_notebook

    # 118 s on a 2-core machine busy with other test processes (2026-12-05): room for a loaded CI
    run_notebook("07_mini_vllm", budget_s=240)
