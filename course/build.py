"""The student edition: `python -m course build [CHAPTERS] --out build/student`.

Which code is solved, assigned or stripped:
  * no CHAPTERS: the FULL edition — every task of every chapter is assigned and stripped;
  * CHAPTERS (e.g. `02`, or `02 cuda`): their tasks are assigned; the chapters BEFORE the first
    one chosen stay solved (released: a chapter builds on the earlier ones); everything else —
    later chapters, kernel packages not chosen — is stripped too, unassigned, so that releasing
    chapters one at a time never hands out a later chapter's solution.

What it is built from: the files git tracks (`git ls-files`: committed or staged), as they are in
the working tree — never an untracked file (a scratch copy, a `.orig`, a report a grading left).
Where: an edition-named folder (`build/student` for the full edition, `build/student-ch02` for
chapter 02's: `default_out`). A folder the build finds there is replaced only if it is an edition
it wrote and nothing in it has changed since (course_build.json lists every file it wrote, with its
hash): a student's work, or another edition, is never overwritten (`--force` to replace anyway).

The tree written:
  * every stripped region holds a stub naming its task (markers kept: course/regions.py);
  * notebooks lose their outputs and their solution cells (nbgrader-style);
  * hidden tests are left out (whole files, or test functions/classes cut from their file);
  * it is its own project (course/student_files.py): a pyproject.toml installable with
    `pip install -e .`, a Makefile (`make setup`, `make test-task T=ch02_task1`, `make grade`),
    a README.md for students, and a root conftest.py that (1) makes every import resolve inside
    the tree even where the instructor's editable install is active, (2) gives each task a
    pytest marker (`pytest -m ch02_task3`) from course_tasks.json, (3) prints a per-task summary;
  * each assigned chapter gets an ASSIGNMENT.md (course/assignment.py);
  * the grader (course/), its tests (tests/course/), the instructor's Makefile and README are
    not included.
"""
from __future__ import annotations

import ast
import json
import pathlib
import shutil

from course import regions as R
from course.layout import ROOT, Chapter, chapters, find_chapter, repo_files
from course.manifest import Manifest, Task, chapter_order, chapters_with_regions, load, problems
from course.notebooks import strip_notebook
from course.trees import code_files, share_csrc, write_tree

BUILD_INFO = "course_build.json"
EXCLUDE_TOPS = {"course", "build", ".ci"}
REPLACED = {"README.md", "Makefile", "pyproject.toml", "conftest.py"}     # written for students instead
INSTRUCTOR_ONLY = {"tests/test_repository.py", "tests/test_self_contained.py"}   # checks of this repository


# What a student edition may gain without its build being "changed": its virtual environment,
# caches, an editable install's metadata, the local grade's report.
SCRATCH = (".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints", ".egg-info",
           "grade_report.json", ".installed")


def default_out(names: list[str]) -> pathlib.Path:
    """build/student (the full edition), build/student-ch02 (chapter 02's), build/student-ch02-cuda."""
    if not names:
        return ROOT / "build" / "student"
    return ROOT / "build" / ("student-" + "-".join(c.prefix for c in selected_chapters(names)))


def _digest(path: pathlib.Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _scratch(rel: str) -> bool:
    return any(part in SCRATCH or part.endswith(".egg-info") for part in pathlib.PurePosixPath(rel).parts)


def changes_since_build(out: pathlib.Path) -> list[str]:
    """What differs in `out` from what the build wrote there (course_build.json's file list):
    files changed, added or removed, scratch (caches, .venv) aside. A folder without the list (or
    the list from an older build) counts as changed if it has any file."""
    info_path = out / BUILD_INFO
    if not info_path.exists():
        return [p.relative_to(out).as_posix() for p in sorted(out.rglob("*"))
                if p.is_file() and not _scratch(p.relative_to(out).as_posix())][:20]
    written = json.loads(info_path.read_text()).get("files")
    if written is None:
        return ["(course_build.json lists no files: built by an older version; pass --force)"]
    out_files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() or p.is_symlink()}
    changed = []
    for rel in sorted(out_files - {BUILD_INFO}):
        if _scratch(rel):
            continue
        if rel not in written:
            changed.append(f"{rel} (added)")
        elif _digest(out / rel) != written[rel]:
            changed.append(f"{rel} (changed)")
    changed += [f"{rel} (removed)" for rel in sorted(set(written) - out_files)]
    return changed


def _may_replace(out: pathlib.Path, names: list[str]) -> None:
    """Refuse (SystemExit) to replace `out` unless it is this very edition, untouched since built."""
    changed = changes_since_build(out)
    if changed:
        raise SystemExit(f"{out} holds changes this build did not write — refusing to overwrite it (a student's "
                         f"work, or files added there; move it away or pass --force):\n  "
                         + "\n  ".join(changed[:20]) + ("\n  ..." if len(changed) > 20 else ""))
    old = json.loads((out / BUILD_INFO).read_text())
    want = "full" if not names else "chapters"
    folders = sorted({c.folder for c in selected_chapters(names)}) if names else None
    if old.get("edition") != want or (names and sorted(old.get("chapters", [])) != folders):
        what = "the full edition" if old.get("edition") == "full" else f"the edition of {', '.join(old.get('chapters', []))}"
        raise SystemExit(f"{out} holds {what}, not this one: refusing to overwrite it (build into another folder — "
                         f"the default is {default_out(names)} — or pass --force)")


def _excluded(rel: str) -> bool:
    parts = pathlib.PurePosixPath(rel).parts
    return parts[0] in EXCLUDE_TOPS or rel.startswith("tests/course/") or rel in REPLACED or rel in INSTRUCTOR_ONLY


def remove_tests(text: str, names: list[str]) -> str:
    """Cut top-level test functions / classes (or methods: 'Class::method') out of a file."""
    tree = R.parse_python(text)
    lines = text.splitlines(keepends=True)
    spans = []
    for name in names:
        parts = name.split("::")
        body, node = tree.body, None
        for part in parts:
            node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                         and n.name == part), None)
            if node is None:
                raise ValueError(f"hidden test {name!r} is not defined in the file")
            body = getattr(node, "body", [])
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        spans.append((first - 1, node.end_lineno))
    for start, end in sorted(spans, reverse=True):
        del lines[start:end]
    return "".join(lines)


def hidden_by_file(manifest: Manifest) -> dict[str, list[str] | None]:
    """{test file: names to cut, or None for the whole file}."""
    out: dict[str, list[str] | None] = {}
    for test in sorted(manifest.hidden_ids()):
        path, _, name = test.partition("::")
        if not name:
            out[path] = None
        elif out.get(path, []) is not None:
            out.setdefault(path, []).append(name)
    return out


def selected_chapters(names: list[str]) -> list[Chapter]:
    if not names:
        return chapters_with_regions()
    chs = chapters()
    return [find_chapter(n, chs) for n in names]


def edition(manifest: Manifest, names: list[str]) -> tuple[list[Task], list[Task], list[Task]]:
    """(assigned, solved, stripped-but-not-assigned) tasks of the edition of `names`."""
    if not names:
        return list(manifest.tasks), [], []
    chosen = {c.folder for c in selected_chapters(names)}
    order = chapter_order()
    first = min(order.get(f, len(order)) for f in chosen)
    assigned = [t for t in manifest.tasks if t.chapter in chosen]
    solved = [t for t in manifest.tasks if t.chapter not in chosen and order.get(t.chapter, len(order)) < first]
    later = [t for t in manifest.tasks if t.chapter not in chosen and t not in solved]
    return assigned, solved, later


def build(names: list[str], out: pathlib.Path | None = None, *, minimal: bool = False, restore: set[str] = frozenset(),
          manifest: Manifest | None = None, check: bool = True, share: bool = True, force: bool = False,
          strip_regions: set[str] | None = None, link_big: bool | None = None) -> dict:
    """Write the student edition of `names` (the full edition if empty) to `out`.
    minimal: only what grading needs (chapter folders, benchmarks) — the proof's trees.
    restore: task ids whose reference stays in (the proof puts tasks back one at a time).
    share (minimal trees): link big files to this repository and C++ sources to a shared cache of
    the grader's (their builds are shared); False: a tree the student's sandboxed process reads,
    which sees neither, so everything is copied. link_big: override for big files alone (the
    judge's trees copy them: its process does not see this repository either)."""
    manifest = manifest or load()
    if check:
        errors = problems(manifest)
        if errors:
            raise SystemExit("course/tasks.toml does not match the marked tree:\n  " + "\n  ".join(errors))
    assigned, solved, later = edition(manifest, names)
    stripped = [t for t in assigned + later if t.id not in restore]
    task_of = {key: (t.id, t.title, t.error_stub) for t in stripped for key in t.regions}
    if strip_regions is not None:         # the proof's (4): these regions alone, the rest the reference
        stripped = []
        task_of = {key: (t.id, t.title, t.error_stub) for t in manifest.tasks for key in t.regions
                   if key in strip_regions}
    keys = set(task_of)
    hidden = hidden_by_file(manifest)
    out = pathlib.Path(out) if out is not None else default_out(names)
    if out.exists():
        if force or not any(out.iterdir()):
            pass
        elif minimal:
            if not (out / BUILD_INFO).exists():
                raise SystemExit(f"{out} exists and is not a student edition: refusing to overwrite it")
        else:
            _may_replace(out, names)
        shutil.rmtree(out)

    def transform(rel: str, text: str) -> str | None:
        if rel in hidden and hidden[rel] is not None:
            return remove_tests(text, hidden[rel])
        if "BEGIN SOLUTION" in text and any(k.startswith(rel + "::") for k in keys):
            return R.strip(text, rel, task_of, keys)
        return None

    if minimal:
        files = code_files()              # grading's throw-away trees: the working tree as it is
    else:                                 # an edition: what git tracks, nothing else
        files = [f for f in repo_files(untracked=False) if not _excluded(f) and not (f in hidden and hidden[f] is None)]
    notebooks = [f for f in files if f.endswith(".ipynb")]
    link_big = (minimal and share) if link_big is None else link_big
    write_tree(out, [f for f in files if f not in notebooks], transform, link_big=link_big)
    for nb in notebooks:
        (out / nb).parent.mkdir(parents=True, exist_ok=True)
        (out / nb).write_text(strip_notebook((ROOT / nb).read_text()))
    if minimal and share:
        share_csrc(out)
    folders = sorted({t.chapter for t in assigned})
    info = {"edition": "full" if not names else "chapters", "chapters": folders,
            "assigned": [t.id for t in assigned], "solved": [t.id for t in solved],
            "later": [t.id for t in later], "stripped": [t.id for t in stripped], "minimal": minimal}
    if not minimal:
        from course.assignment import write_assignments
        from course.student_files import write_student_files
        chosen = [c for c in chapters() if c.folder in folders]
        write_assignments(out, chosen, manifest, info)
        write_student_files(out, manifest, info)
        info["files"] = {p.relative_to(out).as_posix(): _digest(p) for p in sorted(out.rglob("*")) if p.is_file()}
    (out / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
    info["out"] = str(out)
    return info
