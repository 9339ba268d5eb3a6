"""`python -m course proof [CHAPTERS]`: the proof that the assignments work, on the FULL edition
(every task of every chapter stubbed) or on the edition of CHAPTERS (`proof 02`):

  (1) the student edition builds: every stripped region holds its stub, markers well formed,
      every module of every package imports, notebooks without outputs, hidden tests gone, no
      solution left (course/leaks.py: region bodies, known siblings), the grader absent, and
      every assigned task has public tests its marker collects (`pytest -m <task>` in the tree);
  (2) grading the untouched edition scores 0 on every task: not one of its tests passes stubbed
      (a test that passes on stubs credits nothing the student wrote);
  (3) putting ONE task's reference back makes that task pass — every other task still stubbed
      (the grader fills in the reference of the tasks it builds on, course/grade.py) — and, with
      --full, the other tasks of its chapter still fail;
  (4) every region is graded: stubbing it alone (everything else the reference) fails some test of
      its task (a region no test notices could be left unwritten for full marks).

Gradings (2) and (3) are judged (course/judge.py) exactly as a student's are, so the proof also
proves that every test replays under the judge. (4) only asks whether a test fails, on trees that
are all the instructor's: it runs the task's tests directly and stops at the first failure.

Why (3) on its own task is "exactly that task": a test belongs to a task only if every region it
runs belongs to that task or to one the task builds on (course/testgen.py), and grading a task
fills in those, so putting T back can change no other task's grade; `--full` checks that
directly for T's chapter.

Which tests: (2) every task's full test set; (3) the FULL test set (public + hidden) for a
rotating share of the tasks — a different share each day, all of them every ROTATION days —
and `fast` for the rest; (4) a rotating share of the regions; `--full`: every task's full set and
every region (what to run before a release).

    python -m course proof                 # the CI proof (tests/course/test_proof.py)
    python -m course proof --full          # every task's full test set, every region: the complete check
    python -m course proof --walk 02       # a student solving chapter 02 task by task

Grading never shrinks a failing property test (it stops at the first failing example), so a
stubbed task fails in seconds.

Trees differ from the repository only in the stripped regions (course/build.py, minimal=True);
configurations run in parallel (--jobs), each task's grading in processes forked from a zygote
that has imported torch & co. once (course/zygote.py).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
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
from course.build import build, edition
from course.grade import JudgeTrees, grade_tree
from course.layout import ROOT, chapters, repo_files
from course.leaks import leaks
from course.manifest import Manifest, load, problems
from course.runner import Workspace, ZygoteClient, make_workspace, run_tests
from course.testids import matches

ROTATION = 7          # (3) runs every task's full set once in this many days (a week)


@dataclasses.dataclass
class Config:
    label: str                 # "stripped", "only <task>", "region <key>"
    restore: frozenset[str]
    graded: tuple[str, ...]    # the tasks graded
    full: frozenset[str]       # graded on their full test set (the others: fast)
    expect_pass: frozenset[str]
    region: str | None = None  # "region <key>": only this region stubbed; some test of its task must fail


def rotating_share(task_ids: list[str], day: int | None = None, rotation: int = ROTATION) -> set[str]:
    """The tasks whose full set this run grades: every ROTATION-th task, offset by the day (or
    $COURSE_PROOF_DAY), so each task's full set runs at least once in ROTATION days."""
    if day is None:
        day = int(os.environ.get("COURSE_PROOF_DAY", datetime.date.today().toordinal()))
    return {t for i, t in enumerate(task_ids) if i % rotation == day % rotation}


def configs(manifest: Manifest, assigned: list[str], full: set[str], exactly: bool,
            regions: list[str] = ()) -> list[Config]:
    # (2) per chapter, so that the jobs share it: every task stubbed, its full set for the tasks of
    # `full` (every task with --full), its fast set for the others
    chapters_of = {}
    for tid in assigned:
        chapters_of.setdefault(manifest.by_id(tid).chapter, []).append(tid)
    out = [Config(f"stripped {ch}", frozenset(), tuple(ids), frozenset(ids) & full, frozenset())
           for ch, ids in chapters_of.items()]
    for tid in assigned:
        chapter = manifest.by_id(tid).chapter
        graded = [tid] + ([t for t in assigned if t != tid and manifest.by_id(t).chapter == chapter] if exactly else [])
        out.append(Config(f"only {tid}", frozenset({tid}), tuple(graded), frozenset({tid} & full), frozenset({tid})))
    task_of = manifest.task_of_region()
    for key in regions:
        tid = task_of[key].id
        out.append(Config(f"region {key}", frozenset(), (tid,), frozenset({tid}), frozenset(), region=key))
    return out


def region_share(manifest: Manifest, assigned: list[str], every: bool, day: int | None = None) -> list[str]:
    """The regions (4) checks: all of them (--full), else a rotating share, like (3)'s full sets."""
    keys = [k for t in manifest.tasks if t.id in set(assigned) for k in t.regions]
    return keys if every else sorted(rotating_share(keys, day))


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


def collected_by_marker(tree: pathlib.Path, task_ids: list[str]) -> dict[str, int]:
    """{task: how many tests `pytest -m <task>` collects in the student tree} — one
    collect-only run with the tree's own conftest (its markers, its import rule)."""
    info = json.loads((tree / "course_tasks.json").read_text())["tasks"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.setdefault("TRITON_INTERPRET", "1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", " or ".join(task_ids)], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=1800)
    nodeids = [ln.strip() for ln in proc.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    return {t: sum(any(matches(n, x) for x in info[t]["tests"]) for n in nodeids) for t in task_ids}


def check_student_edition(tree: pathlib.Path, folders: list[str] | None = None, *,
                          collect: bool = True) -> list[str]:
    """Step (1): everything that must hold of a freshly built student edition."""
    errors = []
    manifest = load()
    info = json.loads((tree / "course_build.json").read_text())
    stripped = set(info["stripped"])
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
            if region.key in task_of and task_of[region.key].id in stripped:
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
        if p.exists() and (not name or f"def {name.split('::')[-1].partition('[')[0]}(" in p.read_text()
                           or f"class {name.split('::')[-1]}" in p.read_text()):
            errors.append(f"hidden test {test} is in the student edition")
    if (tree / "course").exists() or (tree / "tests" / "course").exists():
        errors.append("the grader (course/, tests/course/) is in the student edition")
    errors += leaks(tree, manifest, sorted(stripped))
    student_tasks = json.loads((tree / "course_tasks.json").read_text())["tasks"]
    for tid in info["assigned"]:
        if not student_tasks.get(tid, {}).get("tests"):
            errors.append(f"{tid}: no public test in the student edition")
    with Workspace(tree) as ws:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ws / "_import"), str(ws)]),
                   PYTHONDONTWRITEBYTECODE="1", TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
        ref = [str(ROOT / c.folder) for c in chapters()]
        proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK, json.dumps(_modules(tree, chapters())),
                               json.dumps(ref)], cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        errors.append(f"import check crashed: {proc.stderr[-1500:]}")
    else:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        errors += [f"student edition: `import {n}` fails: {e}" for n, e in result["failed"].items()]
        errors += [f"student edition import reached the reference: {n}" for n in result["leaked"]]
    if collect and info["assigned"]:
        counts = collected_by_marker(tree, info["assigned"])
        errors += [f"{t}: `pytest -m {t}` collects no test in the student edition" for t, n in counts.items() if not n]
    return errors


# One tree build at a time (builds write shared caches; every parse of the course is also
# serialised by regions.parse_python: CPython 3.11's ast.parse is not thread-safe).
_BUILD_LOCK = threading.Lock()


def run_config(cfg: Config, names: list[str], manifest: Manifest, tmp: pathlib.Path,
               zygote: ZygoteClient | None = None, trees: JudgeTrees | None = None) -> dict:
    if cfg.region is not None:
        return run_region(cfg, names, manifest, tmp, zygote)
    t0 = time.monotonic()
    tree = pathlib.Path(tempfile.mkdtemp(prefix="tree-", dir=tmp))
    shutil.rmtree(tree)
    with _BUILD_LOCK:
        build(names, tree, minimal=True, restore=set(cfg.restore), manifest=manifest, check=False, share=False)
    grades = []
    for full in (True, False):                  # full sets and fast sets: two passes of grade_tree
        tasks = [manifest.by_id(t) for t in cfg.graded if (t in cfg.full) == full]
        if tasks:
            g, _ = grade_tree(tree, tasks, fast=not full, workspace_parent=tmp, zygote=zygote, manifest=manifest,
                              judge_trees=trees, cache_key="proof")
            grades += g
    shutil.rmtree(tree, ignore_errors=True)
    passed = {g.task.id for g in grades if g.passed}
    stubbed = cfg.label.startswith("stripped")
    # Stubbed, a task must score 0 (not one test passing); alone, its own task must pass.
    scored = {g.task.id for g in grades if g.num_passed} if stubbed else passed
    wrong_pass = sorted(scored - cfg.expect_pass)
    wrong_fail = sorted(cfg.expect_pass - passed)
    details = {}
    for g in grades:
        if g.task.id in wrong_pass + wrong_fail:
            details[g.task.id] = [f"{r.nodeid}: {r.outcome} {(r.summary or r.message)[-400:]}" for r in g.results
                                  if (r.outcome == "passed") == (g.task.id in wrong_pass)][:6]
    out = {"config": cfg.label, "ok": not wrong_pass and not wrong_fail, "passed": sorted(passed),
           "unexpected_pass": wrong_pass, "unexpected_fail": wrong_fail, "details": details,
           "full": sorted(cfg.full), "graded": list(cfg.graded),
           "task_seconds": {g.task.id: round(g.seconds, 1) for g in grades},
           "seconds": round(time.monotonic() - t0, 1)}
    if stubbed:
        out["stubbed_scores"] = {g.task.id: round(g.score, 3) for g in grades}
    return out


def run_region(cfg: Config, names: list[str], manifest: Manifest, tmp: pathlib.Path,
               zygote: ZygoteClient | None = None) -> dict:
    """(4): the reference with only `cfg.region` stubbed; its task's tests run (fast ones first)
    until one fails. None failing: the region is graded by no test."""
    t0 = time.monotonic()
    task = manifest.by_id(cfg.graded[0])
    tree = pathlib.Path(tempfile.mkdtemp(prefix="region-", dir=tmp))
    shutil.rmtree(tree)
    with _BUILD_LOCK:
        build(names, tree, minimal=True, manifest=manifest, check=False, strip_regions={cfg.region})
    failing = None
    try:
        ws = make_workspace(tree, pathlib.Path(tempfile.mkdtemp(prefix="ws-", dir=tmp)) / "ws")
        rest = [t for t in task.tests if t not in task.fast]
        for batch in ([t for t in task.tests if t in task.fast] or task.fast, rest):
            if not batch or failing:
                continue
            limits = {t: (task.id, task.timeout_s) for t in batch}
            run = run_tests(ws, batch, task_limits=limits, student=tree, zygote=zygote, guard=False,
                            extra_env={"COURSE_HYPOTHESIS_SHRINK": "0"}, extra_args=["-x"], once=True)
            bad = [r for r in run.results.values() if r.outcome not in ("passed", "not_here", "not run")]
            if bad:
                failing = f"{bad[0].nodeid}: {bad[0].outcome} {(bad[0].summary or bad[0].message)[:200]}"
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return {"config": cfg.label, "ok": failing is not None, "passed": [] if failing else [task.id],
            "unexpected_pass": [] if failing else [task.id], "unexpected_fail": [],
            "details": {} if failing else {task.id: [f"stubbing {cfg.region} alone fails none of {task.id}'s tests"]},
            "region": cfg.region, "caught_by": failing, "full": [task.id], "graded": [task.id], "task_seconds": {},
            "seconds": round(time.monotonic() - t0, 1)}


def proof(names: list[str], *, fast: bool = True, jobs: int = 2, out_json: pathlib.Path | None = None,
          verbose: bool = True, use_zygote: bool = True, rotate: bool = True, exactly: bool | None = None,
          collect: bool = True, only: list[str] | None = None) -> dict:
    """fast=False (--full): every task's full set, (3) also grades the other tasks of the task's
    chapter, and (4) checks every region. fast=True: full sets and regions for the rotating share
    (rotate=False: none). only: these tasks' configurations alone (the stripped grading included)."""
    t0 = time.monotonic()
    manifest = load()
    errors = problems(manifest)
    assigned, _, _ = edition(manifest, names)
    ids = [t.id for t in assigned if only is None or t.id in only]
    full = set(ids) if not fast else (rotating_share(ids) if rotate else set())
    regions = region_share(manifest, ids, every=not fast) if (not fast or rotate) else []
    exactly = (not fast) if exactly is None else exactly
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="course-proof-"))
    results = []
    try:
        student = tmp / "student"
        if not errors:
            build(names, student, manifest=manifest)
            errors += check_student_edition(student, collect=collect)
            shutil.rmtree(student, ignore_errors=True)
        step1_s = time.monotonic() - t0
        if verbose:
            print(f"(1) student edition ({'full' if not names else ', '.join(names)}): "
                  f"{'ok' if not errors else 'FAILED'} ({step1_s:.0f} s)", flush=True)
            for e in errors:
                print("   ", e)
        cfgs = configs(manifest, ids, full, exactly, regions) if not problems(manifest) else []
        os.chmod(tmp, 0o711)              # the student's process (another user) reaches its tree inside
        with ZygoteClient() as zygote, JudgeTrees(tmp, manifest) as trees, \
                concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run_config, c, names, manifest, tmp, zygote, trees): c for c in cfgs}
            for fut in concurrent.futures.as_completed(futures):
                cfg = futures[fut]
                try:
                    res = fut.result()
                except Exception as e:      # a broken build is a failed proof, not a crash of the proof
                    res = {"config": cfg.label, "ok": False, "error": repr(e), "passed": [], "unexpected_pass": [],
                           "unexpected_fail": sorted(cfg.expect_pass), "details": {}, "full": sorted(cfg.full),
                           "graded": list(cfg.graded), "task_seconds": {}, "seconds": 0}
                results.append(res)
                if verbose:
                    flag = "ok" if res["ok"] else "FAILED"
                    sets = "full" if res["full"] else "fast"
                    what = (f"caught by {str(res.get('caught_by') or '-')[:90]}" if res.get("region") else
                            f"passed={res['passed'] if len(res['passed']) < 4 else len(res['passed'])}")
                    print(f"   {res['config'][:60]:60s} {flag:6s} {sets} {what} ({res['seconds']} s)", flush=True)
                    if not res["ok"]:
                        print(f"      unexpected pass {res['unexpected_pass']}, unexpected fail "
                              f"{res['unexpected_fail']} {res.get('error', '')}")
                        for task, lines in res["details"].items():
                            for line in lines:
                                print(f"      {task}: {line[:600]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    order = {c.label: i for i, c in enumerate(configs(manifest, ids, full, False, regions))}
    results.sort(key=lambda r: order.get(r["config"], 0))
    stubbed = {t: v for r in results if r["config"].startswith("stripped") for t, v in r.get("stubbed_scores", {}).items()}
    report = {"edition": "full" if not names else names, "mode": "full" if not fast else "fast",
              "full_sets": sorted(full), "regions_checked": regions, "jobs": jobs, "step1_errors": errors,
              "configs": results, "stubbed_scores": stubbed,
              "stubbed_above_zero": sorted(t for t, v in stubbed.items() if v > 0),
              "ungraded_regions": sorted(r["region"] for r in results if r.get("region") and not r["ok"]),
              "ok": not errors and all(r["ok"] for r in results) and bool(results),
              "wall_s": round(time.monotonic() - t0, 1), "num_tasks": len(ids)}
    if verbose:
        print(f"proof {'PASSED' if report['ok'] else 'FAILED'}: {len(ids)} tasks, {len(results)} gradings, "
              f"full sets for {len(full)}, {len(regions)} regions checked; stubbed above 0: "
              f"{report['stubbed_above_zero'] or 'none'}; ungraded regions: {report['ungraded_regions'] or 'none'}; "
              f"{report['wall_s']} s ({jobs} jobs)")
    if out_json:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(report, indent=1) + "\n")
    return report


def walk(chapter: str, *, fast: bool = True, verbose: bool = True, tmp_parent: pathlib.Path | None = None,
         use_zygote: bool = True) -> dict:
    """A scripted student: builds the edition of `chapter`, then writes its tasks' solutions in
    order (the reference bodies, into the tree's own files, as a student would) and grades the
    edition after each. Each step must add exactly that task to the passed set and change no
    other task's score."""
    manifest = load()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="course-walk-", dir=tmp_parent))
    os.chmod(tmp, 0o711)
    steps, ok = [], True
    try:
        tree = tmp / "student"
        info = build([chapter], tree, manifest=manifest)
        tasks = [manifest.by_id(t) for t in info["assigned"]]
        with ZygoteClient() as zygote, JudgeTrees(tmp, manifest) as trees:
            def grade() -> dict:
                grades, _ = grade_tree(tree, tasks, fast=fast, workspace_parent=tmp, zygote=zygote, manifest=manifest,
                                       judge_trees=trees)
                return {g.task.id: (g.passed, round(g.score, 4)) for g in grades}

            before = grade()
            steps.append({"solved": None, "passed": sorted(t for t, (p, _) in before.items() if p)})
            ok = not any(p for p, _ in before.values())
            for task in tasks:
                write_solution(tree, task)
                after = grade()
                newly = sorted(t for t in after if after[t][0] and not before[t][0])
                changed = sorted(t for t in after if t != task.id and after[t] != before[t])
                good = newly == [task.id] and not changed
                ok &= good
                steps.append({"solved": task.id, "newly_passed": newly, "others_changed": changed, "ok": good,
                              "score": round(sum(s for _, s in after.values()), 3)})
                if verbose:
                    print(f"   solved {task.id}: newly passed {newly}, others changed {changed}, "
                          f"score {steps[-1]['score']} {'ok' if good else 'FAILED'}", flush=True)
                before = after
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"chapter": chapter, "mode": "fast" if fast else "full", "steps": steps, "ok": ok}


def write_solution(tree: pathlib.Path, task) -> None:
    """Put the reference bodies of `task` into the tree's files (only its regions change)."""
    for rel in sorted({k.split("::")[0] for k in task.regions}):
        bodies = {k: b for k, b in R.bodies((ROOT / rel).read_text(), rel).items() if k in set(task.regions)}
        (tree / rel).write_text(R.fill((tree / rel).read_text(), rel, bodies))
