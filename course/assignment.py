"""ASSIGNMENT.md, one per assigned chapter of the student edition: the tasks in order, where each
is (its functions' docstrings), the rules its tests enforce (each test's docstring, or its name
when it has none — hidden tests included, as rules, without their code), what else its tests
run and what is stubbed in this edition, how it is graded, and what the reference achieves
(measured numbers quoted from the READMEs, each with the command that reproduces it)."""
from __future__ import annotations

import ast
import pathlib
import re

from course.layout import ROOT, Chapter
from course.regions import parse_python
from course.manifest import Manifest, Task

NUMBER = re.compile(r"\d+(\.\d+)?\s*(%|ms|µs|us|ns|s\b|×|x\b|tok/s|req/s|GB|MB|KiB|MiB)")
COMMAND = re.compile(r"`((?:python|pytest|make|\.venv/bin/python)[^`]*)`")


def _docstrings(path: pathlib.Path) -> dict[str, str]:
    """{qualified function or class name: first paragraph of its docstring}."""
    try:
        tree = parse_python(path.read_text())
    except (SyntaxError, UnicodeDecodeError, FileNotFoundError):
        return {}
    out = {"": " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())}

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


def rule_of(test_id: str, cache: dict) -> str:
    """What a test checks, in a sentence: its docstring's first paragraph, else its name."""
    path, _, rest = test_id.partition("::")
    if path not in cache:
        cache[path] = _docstrings(ROOT / path)
    if not rest:
        doc = cache[path].get("", "")
        return doc or f"every test of {pathlib.PurePosixPath(path).name}"
    name = rest.partition("[")[0].replace("::", ".")
    doc = cache[path].get(name, "")
    if doc:
        return doc
    words = name.split(".")[-1].removeprefix("test_").replace("_", " ")
    return words[:1].upper() + words[1:]


def _task_section(task: Task, manifest: Manifest, info: dict, cache: dict) -> list[str]:
    optional = " (optional: performance track)" if task.optional else ""
    lines = [f"### {task.id} — {task.title}{optional}", ""]
    by_file: dict[str, list[str]] = {}
    for key in task.regions:
        path, _, func = key.partition("::")
        by_file.setdefault(path, []).append(func)
    stub = ("an `#error` naming the task (the kernel does not build until it is written; the engine then "
            "runs on torch ops)" if task.error_stub else
            f"a stub raising `NotImplementedError(\"{task.id}: ...\")`")
    lines += [f"**Where** (each `BEGIN SOLUTION` / `END SOLUTION` region now holds {stub}):", ""]
    for path, funcs in by_file.items():
        if path not in cache:
            cache[path] = _docstrings(ROOT / path) if path.endswith(".py") else {}
        for func in funcs:
            doc = cache[path].get(func.split("#")[0], "")
            lines.append(f"- `{path}` — `{func}`" + (f": {doc}" if doc else ""))
    lines.append("")
    hidden = manifest.hidden_ids()
    public = [t for t in task.public if t not in hidden and not t.startswith("tests/course/")]
    secret = [t for t in task.all_tests if t not in public]
    lines += [f"**Rules its tests enforce** (public: run them with `make test-task T={task.id}`, or "
              f"`pytest -m {task.id}`):", ""]
    lines += [f"- {rule_of(t, cache)} — `{t}`" for t in public] or ["- (no public test)"]
    if secret:
        lines += ["", f"Hidden tests ({len(secret)}, run only by the grader) check these rules too:", ""]
        lines += [f"- {rule_of(t, cache)}" for t in secret]
    lines.append("")
    by_id = {t.id: t for t in manifest.tasks}
    uses = [by_id[u] for u in task.uses if u in by_id]
    if uses:
        solved = set(info.get("solved", []))
        todo = [u for u in uses if u.id not in solved]
        given = [u for u in uses if u.id in solved]
        text = "**Its tests also run** "
        parts = []
        if given:
            parts.append("code given solved in this edition (" + ", ".join(f"`{u.id}`" for u in given) + ")")
        if todo:
            parts.append("other tasks' code: " + ", ".join(f"`{u.id}` ({u.title})" for u in todo) +
                         " — locally they pass once those are done too; the grader fills in their reference "
                         "while grading this task, so its grade does not depend on them")
        lines += [text + "; ".join(parts) + ".", ""]
    lines.append(f"**Graded**: each of its {len(task.tests)} tests passes or not (score = the share passed; the "
                 f"task passes when all do); each test has {task.test_timeout_s:.0f} s, the task {task.timeout_s:.0f} s "
                 "in all; a test that runs out of time fails, the others still count."
                 + (" Optional: the score table lists it apart and it never fails the grade." if task.optional else "")
                 + (f" Not graded, yours to run: {', '.join(f'`{u}`' for u in task.unjudged)} — {task.unjudged_why}"
                    if task.unjudged else ""))
    if task.notes:
        lines += ["", task.notes]
    lines.append("")
    return lines


def render(chapter: Chapter, manifest: Manifest, info: dict) -> str:
    assigned = set(info["assigned"])
    tasks = [t for t in manifest.of_chapter(chapter.folder) if t.id in assigned]
    by_id = {t.id: t for t in manifest.tasks}
    solved = sorted({by_id[t].chapter for t in info.get("solved", [])})
    later = sorted({by_id[t].chapter for t in info.get("later", [])})
    others = sorted({by_id[t].chapter for t in assigned} - {chapter.folder})
    lines = [f"# Assignment — {_chapter_title(chapter)}", "",
             f"Import name `{chapter.package}`; the chapter's walkthrough is `{chapter.folder}/README.md` "
             "and the notebook under `notebooks/`.", "",
             "## What is stubbed in this edition", ""]
    if info.get("edition") == "full":
        lines.append("This is the full edition: every task of every chapter is stubbed, this chapter's and all "
                     "the others' (each chapter has its ASSIGNMENT.md). Tests of this chapter that run an "
                     "earlier chapter's code pass once you have done that chapter's tasks; each task below "
                     "says which other tasks its tests run.")
    else:
        lines.append("Given solved: " + (", ".join(solved) if solved else "nothing (this is the first chapter)") + ".")
        if others:
            lines.append(f"Also assigned in this edition: {', '.join(others)}.")
        if later:
            lines.append(f"Stubbed and not assigned here (handed out later): {', '.join(later)}. No test of "
                         "this chapter's tasks runs their code; yours must not call into it either.")
    lines += ["",
              "## How it works", "",
              "Each task below is one or more regions between `### BEGIN SOLUTION` and `### END SOLUTION` "
              "(`// ### ...` in C++/CUDA). The docstrings, signatures and shape comments around them are the "
              "specification, and the rules each task's tests enforce are listed with it.", "",
              f"- run a task's public tests: `make test-task T={tasks[0].id if tasks else 'chNN_taskK'}` "
              "(Triton kernels run under `TRITON_INTERPRET=1` on a CPU; CUDA kernels run in the CPU emulator, "
              "compiled with g++ — no GPU needed);",
              "- grading (instructor): `python -m course grade <your tree>` runs the public and hidden tests of "
              "every task, with the reference filled in for the tasks it builds on. Each test is judged from "
              "what your code computes: your code runs in a sandboxed process that logs every call into the "
              "task's code, and the test's assertions run in the judge's process on those outputs (README.md, "
              "'How you are graded'). It prints a score table and the first line of every failure, lists every "
              "test that did not run and why, and writes a JSON report. A test that hangs is stopped at its "
              "time limit and fails; the others still count.",
              "", "## Tasks", ""]
    cache: dict = {}
    for task in tasks:
        lines += _task_section(task, manifest, info, cache)
    lines += ["## What the reference achieves", "",
              "Measured numbers of the reference implementation, quoted from the READMEs with the command "
              "that reproduces each (a correct solution should come close on the same machine):", ""]
    quotes = measured_lines(chapter)
    lines += [f"- {q}" for q in quotes] or ["- (this chapter's README quotes no measured numbers)"]
    return "\n".join(lines) + "\n"


def write_assignments(out: pathlib.Path, selected: list[Chapter], manifest: Manifest, info: dict) -> None:
    for ch in selected:
        if manifest.of_chapter(ch.folder) and (out / ch.folder).is_dir():
            (out / ch.folder / "ASSIGNMENT.md").write_text(render(ch, manifest, info))
