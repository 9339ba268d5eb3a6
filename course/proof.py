"""`python -m course proof [CHAPTERS]`: the proof that the assignments work, per chapter:

  (1) the student edition builds: every region stripped, markers still well formed, every
      module of every package imports, notebooks without outputs, hidden tests gone;
  (2) grading the untouched student edition fails every task;
  (3) putting ONE task's reference back makes exactly that task pass (so no task's grade
      depends on another task's solution);
  (4) grading the reference passes every task.

Steps (2)-(4) grade trees that differ from the repository only in the stripped regions
(course/build.py, minimal=True), on each task's `fast` tests by default (`--full`: all of
them). Chapters not under test stay solved, as in `course build CH`. Configurations run in
parallel, one pytest process each (--jobs), forked from a zygote that has imported torch & co.
once (course/zygote.py; --no-zygote: a fresh interpreter each).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from course import regions as R
from course.build import build, selected_chapters
from course.grade import grade_tree
from course.layout import chapters, repo_files
from course.manifest import Manifest, load, problems
from course.runner import Workspace, ZygoteClient


@dataclasses.dataclass
class Config:
    chapter: str
    label: str                 # "stripped", "only <task>", "reference"
    restore: frozenset[str]
    expect_pass: frozenset[str]


def configs(manifest: Manifest, folders: list[str]) -> list[Config]:
    out = []
    for folder in folders:
        ids = [t.id for t in manifest.of_chapter(folder)]
        if not ids:
            continue
        out.append(Config(folder, "stripped", frozenset(), frozenset()))
        out += [Config(folder, f"only {t}", frozenset({t}), frozenset({t})) for t in ids]
        out.append(Config(folder, "reference", frozenset(ids), frozenset(ids)))
    return out


def _modules(tree: pathlib.Path, chs) -> list[str]:
    mods = []
    for ch in chs:
        base = tree / ch.folder
        for p in sorted(base.rglob("*.py")):
            rel = p.relative_to(base).with_suffix("")
            if rel.name == "__main__" or any(part.startswith(".") for part in rel.parts):
                continue
            parts = [ch.package, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods.append(".".join(parts))
    return mods


IMPORT_CHECK = r'''
import importlib, json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in (getattr(f, "__module__", "") or "")]
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
ref = json.loads(sys.argv[2])
leaked = [n for n, m in sys.modules.items() if any(str(getattr(m, "__file__", "") or "").startswith(d) for d in ref)]
print(json.dumps({"failed": failed, "leaked": leaked}))
'''


def check_student_edition(tree: pathlib.Path, folders: list[str]) -> list[str]:
    """Step (1): everything that must hold of a freshly built student edition."""
    errors = []
    chs = [c for c in chapters() if c.folder in folders]
    manifest = load()
    task_of = manifest.task_of_region()
    for rel in repo_files(tree):
        if R.language(rel) is None:
            continue
        try:
            text = (tree / rel).read_text()
        except UnicodeDecodeError:
            continue
        try:
            found = R.find_regions(text, rel)
        except R.MarkerError as e:
            errors.append(f"markers broken in the student edition: {e}")
            continue
        lines = text.splitlines()
        for region in found:
            if region.key in task_of and task_of[region.key].chapter in folders:
                body = "\n".join(lines[region.begin + 1: region.end])
                if task_of[region.key].id not in body:
                    errors.append(f"{region.key}: not stripped in the student edition")
    for nb in sorted((tree / "notebooks").glob("*.ipynb")):
        data = json.loads(nb.read_text())
        if any(c.get("outputs") for c in data["cells"] if c["cell_type"] == "code"):
            errors.append(f"{nb.name}: outputs left in the student edition")
    for test in manifest.hidden_ids():
        path, _, name = test.partition("::")
        p = tree / path
        if p.exists() and (not name or f"def {name.split('::')[-1]}(" in p.read_text()
                           or f"class {name.split('::')[-1]}" in p.read_text()):
            errors.append(f"hidden test {test} is in the student edition")
    if (tree / "course").exists() or (tree / "tests" / "course").exists():
        errors.append("the grader (course/, tests/course/) is in the student edition")
    with Workspace(tree) as ws:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ws / "_import"), str(ws)]),
                   PYTHONDONTWRITEBYTECODE="1", TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
        ref = [str((pathlib.Path(__file__).resolve().parents[1] / c.folder)) for c in chapters()]
        proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK, json.dumps(_modules(tree, chapters())),
                               json.dumps(ref)], cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        errors.append(f"import check crashed: {proc.stderr[-1500:]}")
    else:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        errors += [f"student edition: `import {n}` fails: {e}" for n, e in result["failed"].items()]
        errors += [f"student edition import reached the reference: {n}" for n in result["leaked"]]
    del chs
    return errors


# One tree build at a time: CPython 3.11's ast.parse is not thread-safe ("SystemError: AST
# constructor recursion depth mismatch" when two worker threads parse at once, seen in CI).
_BUILD_LOCK = threading.Lock()


def run_config(cfg: Config, manifest: Manifest, fast: bool, tmp: pathlib.Path,
               zygote: ZygoteClient | None = None) -> dict:
    t0 = time.monotonic()
    tree = pathlib.Path(tempfile.mkdtemp(prefix="tree-", dir=tmp))
    shutil.rmtree(tree)
    with _BUILD_LOCK:
        build([cfg.chapter], tree, minimal=True, restore=set(cfg.restore), manifest=manifest, check=False)
    tasks = manifest.of_chapter(cfg.chapter)
    grades, run = grade_tree(tree, tasks, fast=fast, workspace_parent=tmp, zygote=zygote)
    shutil.rmtree(tree, ignore_errors=True)
    passed = {g.task.id for g in grades if g.passed}
    wrong_pass = sorted(passed - cfg.expect_pass)
    wrong_fail = sorted(cfg.expect_pass - passed)
    details = {}
    for g in grades:
        if g.task.id in wrong_pass + wrong_fail:
            details[g.task.id] = [f"{r.nodeid}: {r.outcome} {r.message[-400:]}" for r in g.results
                                  if (r.outcome == "passed") == (g.task.id in wrong_pass)][:4]
    return {"chapter": cfg.chapter, "config": cfg.label, "ok": not wrong_pass and not wrong_fail,
            "passed": sorted(passed), "unexpected_pass": wrong_pass, "unexpected_fail": wrong_fail,
            "details": details, "reference_modules": run.reference_modules, "seconds": round(time.monotonic() - t0, 1)}


def proof(names: list[str], *, fast: bool = True, jobs: int = 2, out_json: pathlib.Path | None = None,
          verbose: bool = True, use_zygote: bool = True) -> dict:
    t0 = time.monotonic()
    manifest = load()
    folders = [c.folder for c in selected_chapters(names)]
    errors = problems(manifest, folders=folders)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="course-proof-"))
    results = []
    try:
        student = tmp / "student"
        if not errors:
            build(names, student, manifest=manifest)
            errors += check_student_edition(student, folders)
            shutil.rmtree(student, ignore_errors=True)
        step1_s = time.monotonic() - t0
        if verbose:
            print(f"(1) student edition of {', '.join(folders)}: {'ok' if not errors else 'FAILED'} ({step1_s:.0f} s)")
            for e in errors:
                print("   ", e)
        cfgs = configs(manifest, folders) if not problems(manifest, folders=folders) else []
        with ZygoteClient() if use_zygote else contextlib.nullcontext() as zygote, \
                concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run_config, c, manifest, fast, tmp, zygote): c for c in cfgs}
            for fut in concurrent.futures.as_completed(futures):
                cfg = futures[fut]
                try:
                    res = fut.result()
                except Exception as e:      # a broken build is a failed proof, not a crash of the proof
                    res = {"chapter": cfg.chapter, "config": cfg.label, "ok": False, "error": repr(e),
                           "passed": [], "unexpected_pass": [], "unexpected_fail": sorted(cfg.expect_pass),
                           "details": {}, "reference_modules": [], "seconds": 0}
                results.append(res)
                if verbose:
                    flag = "ok" if res["ok"] else "FAILED"
                    print(f"   {res['chapter']:24s} {res['config']:22s} {flag:6s} passed={res['passed']} "
                          f"({res['seconds']} s)")
                    if not res["ok"]:
                        print(f"      unexpected pass {res['unexpected_pass']}, unexpected fail "
                              f"{res['unexpected_fail']} {res.get('error', '')}")
                        for task, lines in res["details"].items():
                            for line in lines:
                                print(f"      {task}: {line[:600]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results.sort(key=lambda r: (r["chapter"], r["config"] != "stripped", r["config"] == "reference", r["config"]))
    report = {"chapters": folders, "mode": "fast" if fast else "full", "jobs": jobs,
              "step1_errors": errors, "configs": results,
              "ok": not errors and all(r["ok"] for r in results) and bool(results),
              "wall_s": round(time.monotonic() - t0, 1),
              "num_tasks": sum(len(manifest.of_chapter(f)) for f in folders)}
    if verbose:
        print(f"proof {'PASSED' if report['ok'] else 'FAILED'}: {report['num_tasks']} tasks, {len(results)} gradings, "
              f"{report['wall_s']} s ({jobs} jobs, {'fast' if fast else 'full'} tests)")
    if out_json:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(report, indent=1) + "\n")
    return report
