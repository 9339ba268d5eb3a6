"""Notebooks: strip them for students (nbgrader-style) and execute them in place (`make notebooks`).

Stripping: every output and execution count goes; a solution cell keeps only a stub —
a cell is a solution cell when it is tagged `solution`, carries nbgrader's
`{"nbgrader": {"solution": true}}` metadata, or holds `### BEGIN SOLUTION` markers (then
only the marked lines are replaced, as in source files).

Executing: `python -m course notebooks` runs every notebooks/*.ipynb top to bottom with
nbclient (kernel cwd notebooks/, TRITON_INTERPRET=1 without CUDA) and writes it back with
its outputs and figures, so the committed notebooks read like a book. CI executes them too
(tests/*/test_notebook.py) but in memory: the tracked files are never rewritten there.
"""
from __future__ import annotations

import os
import pathlib
import time

import nbformat

from course.layout import ROOT

PY_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
MD_STUB = "YOUR ANSWER HERE"
NOTEBOOKS = ROOT / "notebooks"


def is_solution_cell(cell) -> bool:
    meta = cell.get("metadata", {})
    return "solution" in meta.get("tags", []) or bool(meta.get("nbgrader", {}).get("solution"))


def _strip_marked(source: str) -> str:
    out, inside = [], False
    for line in source.splitlines():
        marker = line.strip()
        if marker == "### BEGIN SOLUTION":
            if inside:
                raise ValueError("nested BEGIN SOLUTION in a notebook cell")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [line, f"{indent}raise NotImplementedError()"]
        elif marker == "### END SOLUTION":
            if not inside:
                raise ValueError("END SOLUTION without BEGIN in a notebook cell")
            inside = False
            out.append(line)
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("BEGIN SOLUTION never closed in a notebook cell")
    return "\n".join(out)


def strip_notebook(text: str) -> str:
    nb = nbformat.reads(text, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
        if is_solution_cell(cell):
            cell.source = PY_STUB if cell.cell_type == "code" else MD_STUB
        elif cell.cell_type == "code" and "### BEGIN SOLUTION" in cell.source:
            cell.source = _strip_marked(cell.source)
    return nbformat.writes(nb)


def execute(path: pathlib.Path, timeout_s: int = 600) -> float:
    """Execute one notebook in place; returns seconds taken. Raises on a failing cell."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("TRITON_INTERPRET")
    try:
        import torch
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        t0 = time.perf_counter()
        client.execute()
        elapsed = time.perf_counter() - t0
    finally:
        if env_before is None:
            os.environ.pop("TRITON_INTERPRET", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)       # timestamps: churn in every diff
    nbformat.write(nb, path)
    return elapsed


def execute_all(names: list[str] | None = None) -> dict[str, object]:
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if names:
        paths = [p for p in paths if any(p.stem.startswith(n) or p.stem == n for n in names)]
    report: dict[str, object] = {}
    for p in paths:
        try:
            report[p.name] = round(execute(p), 1)
            print(f"{p.name}: executed in {report[p.name]} s, {p.stat().st_size // 1024} KiB")
        except Exception as e:          # report every notebook, then fail
            report[p.name] = f"FAILED: {type(e).__name__}: {str(e)[-500:]}"
            print(f"{p.name}: {report[p.name]}")
    return report
