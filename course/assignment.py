"""ASSIGNMENT.md, one per chapter of the student edition: the tasks in order, what each must
satisfy (its functions' docstrings, its tests), how it is graded, and what the reference
achieves (measured numbers quoted from the READMEs, each with the command that reproduces it)."""
from __future__ import annotations

import ast
import pathlib
import re

from course.layout import ROOT, Chapter
from course.manifest import Manifest, Task

NUMBER = re.compile(r"\d+(\.\d+)?\s*(%|ms|µs|us|ns|s\b|×|x\b|tok/s|req/s|GB|MB|KiB|MiB)")
COMMAND = re.compile(r"`((?:python|pytest|make|\.venv/bin/python)[^`]*)`")


def _docstrings(path: pathlib.Path) -> dict[str, str]:
    """{qualified function name: first paragraph of its docstring}."""
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return {}
    out = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                doc = ast.get_docstring(child) or ""
                out[name] = " ".join(doc.split("\n\n")[0].split())
                walk(child, name + ".")

    walk(tree, "")
    return out


def measured_lines(chapter: Chapter) -> list[str]:
    """README lines with a measured number and the command that reproduces it."""
    quotes = []
    top = (ROOT / "README.md").read_text().splitlines()
    for line in top:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and cells[0] == chapter.short and NUMBER.search(line):
            quotes.append(f"(README.md) {line.strip()}")
    readme = ROOT / chapter.folder / "README.md"
    if readme.exists():
        for line in readme.read_text().splitlines():
            if NUMBER.search(line) and COMMAND.search(line):
                quotes.append(f"({chapter.folder}/README.md) {line.strip()}")
    return quotes


def _chapter_title(chapter: Chapter) -> str:
    readme = ROOT / chapter.folder / "README.md"
    if readme.exists():
        for line in readme.read_text().splitlines():
            if line.startswith("# "):
                return line[2:].strip()
    return chapter.folder


def _task_section(task: Task, hidden: set[str], docs_cache: dict) -> list[str]:
    lines = [f"### {task.id} — {task.title}", ""]
    by_file: dict[str, list[str]] = {}
    for key in task.regions:
        path, _, func = key.partition("::")
        by_file.setdefault(path, []).append(func)
    lines.append("**Where** (fill in the `BEGIN SOLUTION` / `END SOLUTION` regions; each now raises "
                 f"`NotImplementedError(\"{task.id}: ...\")`):")
    lines.append("")
    for path, funcs in by_file.items():
        if path not in docs_cache:
            docs_cache[path] = _docstrings(ROOT / path) if path.endswith(".py") else {}
        for func in funcs:
            name = func.split("#")[0]
            doc = docs_cache[path].get(name, "")
            lines.append(f"- `{path}` — `{func}`" + (f": {doc}" if doc else ""))
    lines.append("")
    public = [t for t in task.public if t not in hidden]
    num_hidden = len(task.tests) - len(public)
    lines.append("**Must satisfy** (graded by these tests; run them with "
                 f"`pytest -m {task.id}`):")
    lines.append("")
    lines += [f"- `{t}`" for t in public] or ["- (hidden tests only)"]
    if num_hidden:
        lines.append(f"- and {num_hidden} hidden test{'s' if num_hidden > 1 else ''} run only by the grader")
    lines.append("")
    lines.append(f"**Graded**: passes when every one of its tests passes (score = share of its tests passed); "
                 f"time limit {task.timeout_s:.0f} s, a task that runs out of time scores 0.")
    if task.notes:
        lines += ["", task.notes]
    lines.append("")
    return lines


def render(chapter: Chapter, manifest: Manifest, hidden: set[str]) -> str:
    tasks = manifest.of_chapter(chapter.folder)
    lines = [f"# Assignment — {_chapter_title(chapter)}", "",
             f"Import name `{chapter.package}`; the chapter's walkthrough is `{chapter.folder}/README.md` "
             "and the notebook under `notebooks/`.", "",
             "## How it works", "",
             "Each task below is one or more regions between `### BEGIN SOLUTION` and `### END SOLUTION` "
             "(`// ### ...` in C++/CUDA). The docstrings, signatures and shape comments around them are the "
             "specification. Every other chapter's code is complete, and the other tasks of this chapter are "
             "never needed by a task's tests: each task is graded on its own.", "",
             f"- run a task's public tests: `pytest -m {tasks[0].id if tasks else 'chNN_taskK'}` "
             "(Triton kernels run under `TRITON_INTERPRET=1` on a CPU; CUDA kernels run in the CPU emulator "
             "under tests/, compiled with g++ — no GPU needed);",
             "- grading (instructor): `python -m course grade <your tree>` runs the public and hidden tests of "
             "every task in a separate process that imports only your code, prints a score table and writes "
             "a JSON report; a task that hangs is stopped at its time limit and scores 0.", "",
             "## Tasks", ""]
    docs_cache: dict = {}
    for task in tasks:
        lines += _task_section(task, hidden, docs_cache)
    lines += ["## What the reference achieves", "",
              "Measured numbers of the reference implementation, quoted from the READMEs with the command "
              "that reproduces each (a correct solution should come close on the same machine):", ""]
    quotes = measured_lines(chapter)
    lines += [f"- {q}" for q in quotes] or ["- (this chapter's README quotes no measured numbers)"]
    return "\n".join(lines) + "\n"


def write_assignments(out: pathlib.Path, selected: list[Chapter], manifest: Manifest,
                      hidden_files: dict) -> None:
    hidden = manifest.hidden_ids()
    for ch in selected:
        if manifest.of_chapter(ch.folder) and (out / ch.folder).is_dir():
            (out / ch.folder / "ASSIGNMENT.md").write_text(render(ch, manifest, hidden))
