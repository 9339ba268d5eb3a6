"""`python -m course grade DIR`: run every task's public and hidden tests against a student
tree, print a score table and what failed, write a JSON report, exit non-zero when a task of
the core track fails (performance-track tasks are optional: scored, never failing the run).

Every test is JUDGED (course/judge.py): the student's code runs in a sandboxed process of its own
that logs what the task's code did (its calls, the objects they changed, what they returned); the
same test then runs in the judge's process on the reference with only this task stubbed, every
call into the task's code answered from that log. The judge's assertions decide; nothing the
student's process reports about itself is read. A patched pytest, a rewritten assertion or an
early exit in the student's process can only make a test fail.

The tests come from this repository (the student's own copy of tests/ is ignored), the code from
DIR. Each task runs in processes of its own (forked from a zygote that has imported torch & co.
once), each test with its own time limit (`test_timeout_s`, a stub fails at once: no shrinking) and
the task with a budget (`timeout_s`); a test that runs out of time, crashes its process or was
never run fails, and the report says which and why. A task passes when all its tests pass; its
score is the share that passed.

A task's grade never depends on the student's other tasks: the grading copy of the tree has
the reference filled into the regions of every task it builds on (course/manifest.py:
`Manifest.builds_on` — the earlier chapters' tasks and its `needs`), never into its own.

`grade .` (this repository itself) grades the reference solution: an instructor's check that
every task passes as written, judged like a student's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import threading
import time

from course import regions as R
from course.build import BUILD_INFO
from course.layout import ROOT
from course.manifest import Manifest, Task, chapters_with_regions, load
from course.runner import RunResult, TestResult, Workspace, ZygoteClient, make_workspace
from course.testids import matches


@dataclasses.dataclass
class TaskGrade:
    task: Task
    results: list[TestResult]
    timed_out: bool = False           # a test ran out of its time (that test fails; the others count)
    wall_s: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def num_passed(self) -> int:
        return sum(r.outcome == "passed" for r in self.results)

    @property
    def passed(self) -> bool:
        return self.total > 0 and self.num_passed == self.total

    @property
    def score(self) -> float:
        return 0.0 if not self.total else self.num_passed / self.total

    @property
    def status(self) -> str:
        return "PASS" if self.passed else "FAIL"

    @property
    def not_run(self) -> list[TestResult]:
        return [r for r in self.results if r.outcome in ("not run", "timeout", "crashed")]

    @property
    def seconds(self) -> float:
        """Wall time of the task's grading process(es), start to end."""
        return self.wall_s

    @property
    def failures(self) -> list[TestResult]:
        return [r for r in self.results if r.outcome != "passed"]


def tasks_for(student: pathlib.Path, manifest: Manifest, task_ids: list[str] | None = None,
              chapter_folders: list[str] | None = None) -> list[Task]:
    """The tasks to grade: those named, else those of the chapters named, else the tasks the
    student edition assigned (its course_build.json), else every task."""
    if task_ids:
        return [manifest.by_id(t) for t in task_ids]
    info = student / BUILD_INFO
    if chapter_folders is None and info.exists():
        data = json.loads(info.read_text())
        assigned = set(data.get("assigned", data.get("tasks", [])))
        return [t for t in manifest.tasks if t.id in assigned]
    if chapter_folders is None:
        chapter_folders = [c.folder for c in chapters_with_regions()]
    return [t for t in manifest.tasks if t.chapter in chapter_folders]


def test_ids(task: Task, fast: bool) -> list[str]:
    return list(task.fast if fast else task.tests)


def score_task(task: Task, run: RunResult, fast: bool, notes: list[str]) -> TaskGrade:
    notes = list(notes)                 # this task's own: notes of one task never show under another
    results = []
    for test_id in test_ids(task, fast):
        matched = [r for n, r in run.results.items() if matches(n, test_id)]
        if not matched:
            results.append(TestResult(test_id, "missing", 0.0, "not collected (import error, or renamed?)",
                                      summary="not collected: an import error in the test file, or the test was renamed"))
        results += matched
    # What this machine cannot run (an instruction set the CPU lacks) is no part of the grade here,
    # as a gpu test is not on a CPU machine (grader_plugin.py: "not_here").
    not_here = [r for r in results if r.outcome == "not_here"]
    if not_here:
        results = [r for r in results if r.outcome != "not_here"]
        notes.append(f"{task.id}: {len(not_here)} test(s) cannot run on this machine and are not graded here: "
                     + "; ".join(f"{r.nodeid} ({r.message.removeprefix('Skipped: ')})" for r in not_here))
    if run.reference_modules:         # never trust a run that reached the reference
        results.append(TestResult("<reference guard>", "error", 0.0,
                                  f"reference modules imported: {run.reference_modules}",
                                  summary=f"the grading process imported the reference: {run.reference_modules}"))
    if task.unjudged and not fast:
        notes.append(f"{task.id}: not graded, run them yourself (make test-task T={task.id}): "
                     f"{', '.join(task.unjudged)} — {task.unjudged_why}")
    timed_out = any(r.outcome == "timeout" for r in results)
    return TaskGrade(task, results, timed_out, run.wall_s, notes)


def is_reference(student: pathlib.Path) -> bool:
    return student.resolve() == ROOT.resolve()


def fill_overlay(student: pathlib.Path, tasks: list[Task]) -> tuple[dict[str, str], list[str]]:
    """{path: the student's file with these tasks' regions holding the reference}, and what
    could not be filled (a file the student removed, or whose markers no longer parse)."""
    keys = {key for t in tasks for key in t.regions}
    overlay, notes = {}, []
    for rel in sorted({k.split("::")[0] for k in keys}):
        mine, ref = student / rel, ROOT / rel
        if not mine.is_file() or not ref.is_file():
            notes.append(f"{rel}: missing, its reference could not be filled in")
            continue
        text = mine.read_text()
        try:
            bodies = {k: b for k, b in R.bodies(ref.read_text(), rel).items() if k in keys}
            new = R.fill(text, rel, bodies)
        except (R.MarkerError, SyntaxError) as e:
            notes.append(f"{rel}: the reference of the tasks this one builds on could not be filled in ({e})")
            continue
        if new != text:
            overlay[rel] = new
    return overlay, notes


class JudgeTrees:
    """The judge's trees (the reference with one task stubbed) and their workspaces, built once per
    task and shared by every grading that uses this object (the proof grades a task many times).
    They live in a folder only the grader can read."""

    def __init__(self, parent: pathlib.Path | None = None, manifest: Manifest | None = None):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="course-judge-", dir=parent))
        os.chmod(self.dir, 0o700)
        self.manifest = manifest or load()
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._ws: dict[str, pathlib.Path] = {}

    def workspace(self, task: Task) -> pathlib.Path:
        from course.judge import judge_tree, prepare_judge_workspace
        with self._lock:
            lock = self._locks.setdefault(task.id, threading.Lock())
        with lock:
            if task.id not in self._ws:
                tree = judge_tree(task, self.dir / task.id / "tree", self.manifest)
                ws = make_workspace(tree, self.dir / task.id / "ws")
                prepare_judge_workspace(ws)
                self._ws[task.id] = ws
            return self._ws[task.id]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "JudgeTrees":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def grade_tree(student: pathlib.Path, tasks: list[Task], *, fast: bool = False,
               workspace_parent: pathlib.Path | None = None, zygote: ZygoteClient | None = None,
               manifest: Manifest | None = None, verbose: bool = False, shrink: bool = False,
               judge_trees: JudgeTrees | None = None, seed: int | None = None,
               cache_key: str | None = None) -> tuple[list[TaskGrade], RunResult]:
    """Grade `tasks` on `student`, judged (course/judge.py); tasks that build on the same tasks (and
    use the same stand-ins) share the student's workspace. shrink: unused (grading never shrinks:
    the judge stops a property test at its first failing example)."""
    from course.judge import _open_up, judge_task, prepare_student_workspace, sandbox_for, student_cache, whole_files
    manifest = manifest or load()
    student = pathlib.Path(student).resolve()
    reference = is_reference(student)
    own_zygote = zygote is None
    zygote = zygote or ZygoteClient()
    trees = judge_trees or JudgeTrees(workspace_parent, manifest)
    work = pathlib.Path(tempfile.mkdtemp(prefix="course-grade-", dir=workspace_parent))
    os.chmod(work, 0o711)
    try:
        sandbox = sandbox_for([student, work], [])
        if sandbox.uid is not None:
            _open_up(student)
            _open_up(work)
        cache = student_cache(student, sandbox.uid, cache_key)
        groups: dict[tuple, list[Task]] = {}
        for task in tasks:
            fill = () if reference else tuple(t.id for t in manifest.builds_on(task))
            groups.setdefault((fill, tuple(task.standins), tuple(whole_files(task))), []).append(task)
        grades: dict[str, TaskGrade] = {}
        runs = []
        for (fill, standins, _), group in groups.items():
            overlay, notes = fill_overlay(student, [manifest.by_id(i) for i in fill])
            for task in group:                   # whole-function boundaries: the reference's files
                for rel in whole_files(task):
                    overlay[rel] = (ROOT / rel).read_text()
            with Workspace(student, parent=work, overlay=overlay) as ws:
                prepare_student_workspace(ws, sandbox.uid)
                for task in group:
                    tests = test_ids(task, fast)
                    budget = task.fast_timeout_s if fast else task.timeout_s
                    jr = judge_task(ws, trees.workspace(task), task, tests, work=work, zygote=zygote,
                                    sandbox=sandbox, cache=cache, seed=seed, budget_s=budget, guard=not reference)
                    run = RunResult(jr.results, jr.collected, [], set(), jr.processes, jr.wall_s, "")
                    runs.append(run)
                    task_notes = list(notes)
                    if jr.sandbox != "on":
                        task_notes.append(f"sandbox {jr.sandbox}")
                    grades[task.id] = score_task(task, run, fast, task_notes)
                    if verbose:
                        g = grades[task.id]
                        print(f"  {task.id}: {g.num_passed}/{g.total} {g.status} ({g.seconds:.1f} s)", flush=True)
        return [grades[t.id] for t in tasks], _merge(runs)
    finally:
        if os.environ.get("COURSE_KEEP"):            # debugging: keep the logs and the workspaces
            print(f"kept: {work} {trees.dir}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            if judge_trees is None:
                trees.close()
        if own_zygote:
            zygote.close()


def _merge(runs: list[RunResult]) -> RunResult:
    if len(runs) == 1:
        return runs[0]
    if not runs:
        return RunResult({}, [], [], set(), 0, 0.0, "")
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


def core_passed(grades: list[TaskGrade]) -> bool:
    return all(g.passed for g in grades if not g.task.optional)


def report_json(student: pathlib.Path, grades: list[TaskGrade], run: RunResult, fast: bool,
                wall_s: float | None = None) -> dict:
    core = [g for g in grades if not g.task.optional]
    return {
        "student": str(student),
        "mode": "fast" if fast else "full",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "passed": core_passed(grades),
        "num_tasks": len(core),
        "num_passed": sum(g.passed for g in core),
        "score": round(sum(g.score for g in core), 3),
        "optional": {"num_tasks": len(grades) - len(core),
                     "num_passed": sum(g.passed for g in grades if g.task.optional),
                     "score": round(sum(g.score for g in grades if g.task.optional), 3)},
        "wall_s": round(run.wall_s if wall_s is None else wall_s, 1),
        "processes": run.processes,
        "reference_modules_imported": run.reference_modules,
        "tasks": [{
            "id": g.task.id, "title": g.task.title, "chapter": g.task.chapter, "track": g.task.track,
            "status": g.status, "passed": g.passed, "score": round(g.score, 3), "tests_passed": g.num_passed,
            "tests_total": g.total, "seconds": round(g.seconds, 2), "notes": g.notes,
            "not_run": [{"nodeid": r.nodeid, "outcome": r.outcome, "why": r.summary or r.message[-300:]}
                        for r in g.not_run],
            "tests": [{"nodeid": r.nodeid, "outcome": r.outcome, "duration": round(r.duration, 3),
                       "summary": r.summary, "message": r.message} for r in g.results],
        } for g in grades],
    }


MAX_FAILURES_SHOWN = 6


def failure_lines(grades: list[TaskGrade]) -> list[str]:
    """What to fix, under the table: each failing test and its first line."""
    out = []
    for g in grades:
        if g.passed:
            continue
        head = f"{g.task.id} ({'optional, ' if g.task.optional else ''}{g.status}, {g.num_passed}/{g.total})"
        out.append(head)
        failing = [r for r in g.failures if r.outcome not in ("not run",)]
        for r in failing[:MAX_FAILURES_SHOWN]:
            first = r.summary or (r.message.strip().splitlines() or [""])[-1]
            out.append(f"  {r.nodeid}: {r.outcome}" + (f" — {first}" if first else ""))
        if len(failing) > MAX_FAILURES_SHOWN:
            out.append(f"  ... and {len(failing) - MAX_FAILURES_SHOWN} more (the JSON report has every one)")
        not_run = [r for r in g.failures if r.outcome == "not run"]
        if not_run:
            whys: dict[str, list[str]] = {}
            for r in not_run:
                whys.setdefault(r.summary or r.message or "not run", []).append(r.nodeid)
            for why, ids in whys.items():
                out.append(f"  {len(ids)} test(s) not run — {why}: " + ", ".join(i.split("::", 1)[-1] for i in ids))
        out += [f"  note: {n}" for n in g.notes]
    return out


def print_table(grades: list[TaskGrade], run: RunResult, title: str, wall_s: float | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for col in ("task", "title", "tests", "score", "status", "wall s"):
        table.add_column(col, justify="right" if col in ("tests", "score", "wall s") else "left",
                         overflow="fold")
    for g in grades:
        style = {"PASS": "green", "FAIL": "red"}[g.status]
        name = g.task.id + (" (optional)" if g.task.optional else "")
        title_cell = escape(g.task.title) + (" [dim]— performance track[/dim]" if g.task.optional else "")
        table.add_row(name, title_cell, f"{g.num_passed}/{g.total}", f"{g.score:.2f}",
                      f"[{style}]{g.status}[/{style}]", f"{g.seconds:.1f}")
    console = Console()
    console.print(table)
    core = [g for g in grades if not g.task.optional]
    optional = [g for g in grades if g.task.optional]
    line = (f"{sum(g.passed for g in core)}/{len(core)} tasks passed, score {sum(g.score for g in core):.2f}/{len(core)}")
    if optional:
        line += (f"; performance track (optional): {sum(g.passed for g in optional)}/{len(optional)} passed, "
                 f"score {sum(g.score for g in optional):.2f}/{len(optional)}")
    wall = run.wall_s if wall_s is None else wall_s
    console.print(f"{line} ({wall:.0f} s, {run.processes} test process{'es' if run.processes != 1 else ''})")
    lines = failure_lines(grades)
    if lines:
        console.print("\nWhat failed (first line of each failure):")
        for ln in lines:
            console.print(escape(ln), soft_wrap=True)
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
    if is_reference(root):
        print(f"{root}: this repository itself — grading the reference solution (every task should pass; "
              "a student's tree is graded with `make grade STUDENT=build/student`)")
    t0 = time.monotonic()
    with ZygoteClient() as zygote:
        grades, run = grade_tree(root, tasks, fast=fast, zygote=zygote, manifest=manifest)
    wall = time.monotonic() - t0
    print_table(grades, run, f"{root} — {'fast' if fast else 'full'} grading", wall_s=wall)
    # The reference's report goes under build/ (ignored by git): a file left in the repository
    # would be in the next student edition if builds took what is on disk (they take what git tracks).
    default = (ROOT / "build" / "grade_report.json") if is_reference(root) else root / "grade_report.json"
    out = pathlib.Path(json_path) if json_path else default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report_json(root, grades, run, fast, wall_s=wall), indent=1) + "\n")
    print(f"report: {out}")
    return 0 if core_passed(grades) and not run.reference_modules else 1

