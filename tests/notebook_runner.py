"""Execute a chapter's walkthrough notebook top to bottom, as a test.

Each chapter's tests call `run_notebook("NN_topic")`, so `make test CH=NN` runs that
chapter's notebook too. A notebook that raises, or takes longer than its budget, fails.
"""
import os
import pathlib
import time

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_notebook(stem: str, budget_s: float = 120.0) -> nbformat.NotebookNode:
    path = ROOT / "notebooks" / f"{stem}.ipynb"
    assert path.exists(), f"missing notebook {path}"
    nb = nbformat.read(path, as_version=4)
    env_cwd = str(ROOT / "notebooks")
    client = NotebookClient(nb, timeout=int(budget_s * 2), kernel_name="python3",
                            resources={"metadata": {"path": env_cwd}})
    # The kernel inherits os.environ, so TRITON_INTERPRET=1 (set by conftest) reaches it.
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0
    assert elapsed < budget_s, f"{stem}.ipynb took {elapsed:.0f} s (budget {budget_s:.0f} s)"
    return nb
