"""`python -m course grade DIR`: run every task's public and hidden tests against a student
tree, print a score table, write a JSON report, exit non-zero when a task fails.

The tests come from this repository (the student's own copy of tests/ is ignored), the code
from DIR only (course/runner.py: a separate pytest process whose imports cannot reach the
reference). A task passes when all its tests pass; its score is the share that passed.
A task whose time runs out scores 0.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from course.build import BUILD_INFO
from course.manifest import Manifest, Task, chapters_with_regions, load
from course.runner import RunResult, TestResult, Workspace, ZygoteClient, _matches, run_tests


@dataclasses.dataclass
class TaskGrade:
    task: Task
    results: list[TestResult]
    timed_out: bool

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def num_passed(self) -> int:
        return sum(r.outcome == "passed" for r in self.results)

    @property
    def passed(self) -> bool:
        return self.total > 0 and self.num_passed == self.total and not self.timed_out

    @property
    def score(self) -> float:
        return 0.0 if self.timed_out or not self.total else self.num_passed / self.total

    @property
    def status(self) -> str:
        if self.timed_out:
            return "TIMEOUT"
        return "PASS" if self.passed else "FAIL"

    @property
    def seconds(self) -> float:
        return sum(r.duration for r in self.results)


def tasks_for(student: pathlib.Path, manifest: Manifest, task_ids: list[str] | None = None,
              chapter_folders: list[str] | None = None) -> list[Task]:
    if task_ids:
        return [manifest.by_id(t) for t in task_ids]
    info = student / BUILD_INFO
    if chapter_folders is None and info.exists():
        chapter_folders = json.loads(info.read_text())["chapters"]
    if chapter_folders is None:
        chapter_folders = [c.folder for c in chapters_with_regions()]
    return [t for t in manifest.tasks if t.chapter in chapter_folders]


def test_ids(task: Task, fast: bool) -> list[str]:
    return list(task.fast if fast else task.tests)


def score(tasks: list[Task], run: RunResult, fast: bool) -> list[TaskGrade]:
    grades = []
    for task in tasks:
        results = []
        for test_id in test_ids(task, fast):
            matched = [r for n, r in run.results.items() if _matches(n, test_id)]
            if not matched:
                results.append(TestResult(test_id, "missing", 0.0, "not collected (import error, or renamed?)"))
            results += matched
        grades.append(TaskGrade(task, results, task.id in run.timed_out_tasks))
    if run.reference_modules:         # never trust a run that reached the reference
        for g in grades:
            g.results.append(TestResult("<reference guard>", "error", 0.0,
                                        f"reference modules imported: {run.reference_modules}"))
    return grades


def grade_tree(student: pathlib.Path, tasks: list[Task], *, fast: bool = False,
               workspace_parent: pathlib.Path | None = None,
               zygote: ZygoteClient | None = None) -> tuple[list[TaskGrade], RunResult]:
    groups: dict[tuple, list[Task]] = {}
    for task in tasks:                      # tasks graded with stand-ins get a process of their own
        groups.setdefault(tuple(task.standins), []).append(task)
    runs = []
    with Workspace(student, parent=workspace_parent) as ws:
        for standins, group in groups.items():
            limits = {t: (task.id, task.fast_timeout_s if fast else task.timeout_s)
                      for task in group for t in test_ids(task, fast)}
            runs.append(run_tests(ws, list(limits), task_limits=limits, student=student, standins=list(standins),
                                  zygote=zygote))
    run = _merge(runs)
    return score(tasks, run, fast), run


def _merge(runs: list[RunResult]) -> RunResult:
    if len(runs) == 1:
        return runs[0]
    merged = RunResult({}, [], [], set(), 0, 0.0, "")
    for r in runs:
        merged.results.update(r.results)
        merged.collected += r.collected
        merged.reference_modules = sorted(set(merged.reference_modules) | set(r.reference_modules))
        merged.timed_out_tasks |= r.timed_out_tasks
        merged.processes += r.processes
        merged.wall_s += r.wall_s
        merged.stderr_tail = r.stderr_tail
    return merged


def report_json(student: pathlib.Path, grades: list[TaskGrade], run: RunResult, fast: bool) -> dict:
    return {
        "student": str(student),
        "mode": "fast" if fast else "full",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "passed": all(g.passed for g in grades),
        "num_tasks": len(grades),
        "num_passed": sum(g.passed for g in grades),
        "score": round(sum(g.score for g in grades), 3),
        "wall_s": round(run.wall_s, 1),
        "processes": run.processes,
        "reference_modules_imported": run.reference_modules,
        "tasks": [{
            "id": g.task.id, "title": g.task.title, "chapter": g.task.chapter, "status": g.status,
            "passed": g.passed, "score": round(g.score, 3), "tests_passed": g.num_passed, "tests_total": g.total,
            "seconds": round(g.seconds, 2),
            "tests": [{"nodeid": r.nodeid, "outcome": r.outcome, "duration": round(r.duration, 3),
                       "message": r.message} for r in g.results],
        } for g in grades],
    }


def print_table(grades: list[TaskGrade], run: RunResult, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("task", "title", "tests", "score", "status", "s"):
        table.add_column(col, justify="right" if col in ("tests", "score", "s") else "left")
    for g in grades:
        style = {"PASS": "green", "FAIL": "red", "TIMEOUT": "magenta"}[g.status]
        table.add_row(g.task.id, g.task.title[:60], f"{g.num_passed}/{g.total}", f"{g.score:.2f}",
                      f"[{style}]{g.status}[/{style}]", f"{g.seconds:.1f}")
    console = Console()
    console.print(table)
    passed = sum(g.passed for g in grades)
    console.print(f"{passed}/{len(grades)} tasks passed, score {sum(g.score for g in grades):.2f}/{len(grades)} "
                  f"({run.wall_s:.0f} s, {run.processes} test process{'es' if run.processes > 1 else ''})")
    if run.reference_modules:
        console.print(f"[red]the reference solution was imported: {run.reference_modules}[/red]")


def main(student: str, *, chapters: list[str] | None, task_ids: list[str] | None, fast: bool,
         json_path: str | None) -> int:
    from course.layout import chapters as all_chapters, find_chapter

    root = pathlib.Path(student)
    if not root.is_dir():
        raise SystemExit(f"{student}: no such student tree")
    manifest = load()
    folders = [find_chapter(c, all_chapters()).folder for c in chapters] if chapters else None
    tasks = tasks_for(root, manifest, task_ids, folders)
    grades, run = grade_tree(root, tasks, fast=fast)
    print_table(grades, run, f"{root} — {'fast' if fast else 'full'} grading")
    out = pathlib.Path(json_path) if json_path else root / "grade_report.json"
    out.write_text(json.dumps(report_json(root, grades, run, fast), indent=1) + "\n")
    print(f"report: {out}")
    return 0 if all(g.passed for g in grades) and not run.reference_modules else 1
