"""`python -m course tests`: generate each task's test lists in course/tasks.toml from a
discovery run, so that no test id is kept by hand.

1. Discovery (course/discover.py): every chapter test runs on a probed copy of the repository,
   C++ regions stubbed; each test records the Python regions it ran. Then, per C++ task, its
   `candidates` run again with that task put back: those that now pass are its tests.
2. A test belongs to task T when T is the one task among those whose regions it runs such that
   all the others are tasks T builds on (`Manifest.builds_on`: earlier chapters, `needs`). So a
   chapter-02 test that also runs chapter 03's scheduler is chapter 03's, a test that runs two
   tasks of one chapter belongs to the one that `needs` the other, and a test that runs no
   region, fails on the reference, or fits no task alone (an integration test) is no task's; a test
   under a numbered chapter's folder grades only that chapter's tasks (or a kernel package's); nor
   is a test marked `slow` or `model`, or under tests/integration/ (grading stays minutes per task;
   `make test` runs them all), or one a task's `exclude` names.
3. The ids are function-level: `file::func` when every parametrization of func belongs to T,
   `file::func[torch]` (the smallest selector, course/testids.py) when they split between tasks.
   Tests under tests/course/ are hidden, the others public; `fast` is a cheap subset that runs
   every region of the task (the CI proof's); `uses` lists the other tasks T's tests run.
4. tasks.toml is rewritten in place: only each task's public / hidden / fast / uses arrays.

    python -m course tests                      # discover, then rewrite course/tasks.toml
    python -m course tests --from build/d.json  # reuse a discovery (its JSON, written each run)
    python -m course tests --from build/d.json --again tests/x/test_new.py   # ...with these files run again
    python -m course tests --dry-run            # print what would change
"""
from __future__ import annotations

import collections
import itertools
import json
import pathlib
import re
import time

from course.discover import run_probed, test_files
from course.layout import ROOT
from course.manifest import MANIFEST, Manifest, Task, load
from course.testids import function_of, matches

FAST_MAX_TESTS = 4
FAST_MAX_SECONDS = 20.0
# Tests that stay out of every grade (they still run in `make test`): `slow` ones (a task grades in
# minutes) and `model` ones (they need the real SmolLM2 weights, converted once per machine).
LEFT_OUT_MARKS = {"slow", "model"}
LEFT_OUT_PATHS = ("tests/integration/",)      # the chapters composed: integration tests, no task's


def _excluded(nodeid: str, patterns: list[str]) -> bool:
    """A manifest `exclude` entry: a test id (course/testids.py) or a folder ('tests/integration/')."""
    return any(matches(nodeid, x) or (not x.endswith(".py") and "::" not in x and nodeid.startswith(x.rstrip("/") + "/"))
               for x in patterns)


def discovery(manifest: Manifest, jobs: int = 2, verbose: bool = True) -> dict:
    """{"python": {nodeid: result}, "cpp": {task id: {nodeid: result}}} (run_probed's results)."""
    t0 = time.monotonic()
    data = {"python": run_probed(test_files(), manifest=manifest, jobs=jobs)}
    if verbose:
        print(f"discovery: {len(data['python'])} tests on the probed tree ({time.monotonic() - t0:.0f} s)", flush=True)
    data["cpp"] = {}
    for task in manifest.tasks:
        if task.candidates and "c" in task.languages:
            t1 = time.monotonic()
            data["cpp"][task.id] = run_probed(list(task.candidates), manifest=manifest, restore_cpp={task.id},
                                              jobs=jobs)
            if verbose:
                print(f"discovery: {task.id}'s candidates with it put back: {len(data['cpp'][task.id])} tests "
                      f"({time.monotonic() - t1:.0f} s)", flush=True)
    return data


def _tasks_hit(hits: list[str], task_of_key: dict[str, str]) -> set[str]:
    return {task_of_key[k] for k in hits if k in task_of_key}


def _folder_allows(nodeid: str, task: Task, numbered: set[str]) -> bool:
    """A test under a numbered chapter's folder (tests/03_scheduler/...) grades only that chapter's
    tasks or a kernel package's: a chapter-03 test that happens to run nothing but chapter 02's
    free queue (a validation error raised before any scheduling) checks a chapter-03 rule, not the
    queue, and would be noise in the queue's grade."""
    folder = nodeid.split("/")[1] if nodeid.count("/") >= 2 else ""
    return folder not in numbered or task.chapter == folder or task.chapter not in numbered


def assign(manifest: Manifest, data: dict) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """({nodeid: task}, {nodeid: why it is no task's}, {task: other tasks its tests run})."""
    task_of_key = {k: t.id for t in manifest.tasks for k in t.regions}
    builds_on = {t.id: {d.id for d in manifest.builds_on(t)} for t in manifest.tasks}
    numbered = {t.chapter for t in manifest.tasks if t.chapter[:2].isdigit()}
    by_id = {t.id: t for t in manifest.tasks}
    owner, why, uses = {}, {}, collections.defaultdict(set)
    python = data["python"]
    for nodeid, r in python.items():
        if r["outcome"] != "passed":
            why[nodeid] = f"{r['outcome']} on the probed tree (C++ stubbed)"
            continue
        if set(r.get("marks", [])) & LEFT_OUT_MARKS:
            why[nodeid] = f"marked {sorted(set(r['marks']) & LEFT_OUT_MARKS)}: left out of grades"
            continue
        if nodeid.startswith(LEFT_OUT_PATHS):
            why[nodeid] = "an integration test (tests/integration/): left out of grades"
            continue
        hit = _tasks_hit(r["hits"], task_of_key)
        if not hit:
            why[nodeid] = "runs no solution region"
            continue
        fits = [t for t in hit if hit - {t} <= builds_on[t]]
        if len(fits) == 1 and not _folder_allows(nodeid, by_id[fits[0]], numbered):
            why[nodeid] = f"runs only {fits[0]} and what it builds on, but is a test of another chapter"
            continue
        if len(fits) == 1:
            owner[nodeid] = fits[0]
            uses[fits[0]] |= hit - {fits[0]}
        else:
            why[nodeid] = (f"runs {sorted(hit)}: " + ("no task builds on all the others (an integration test; "
                           "or add a `needs`)" if not fits else f"ambiguous between {sorted(fits)}"))
    for task_id, results in data.get("cpp", {}).items():
        task = manifest.by_id(task_id)
        for nodeid, r in results.items():
            before = python.get(nodeid, {}).get("outcome")
            if (r["outcome"] != "passed" or before == "passed" or set(r.get("marks", [])) & LEFT_OUT_MARKS
                    or nodeid.startswith(LEFT_OUT_PATHS)):
                continue                        # not passing with it, passing without it, or left out
            hit = _tasks_hit(r["hits"], task_of_key) - {task_id}
            if hit <= builds_on[task_id] and nodeid not in owner and _folder_allows(nodeid, task, numbered):
                owner[nodeid] = task_id
                uses[task_id] |= hit
                why.pop(nodeid, None)
    # A case this machine cannot run (an instruction set the CPU lacks: "not_here") is graded where
    # it can run: it goes to the one task that owns the other cases of the same test function.
    for nodeid in sorted({n for results in (python, *data.get("cpp", {}).values()) for n, r in results.items()
                          if r["outcome"] == "not_here"} - set(owner)):
        siblings = {o for n, o in owner.items() if n.partition("[")[0] == nodeid.partition("[")[0]}
        if len(siblings) == 1:
            owner[nodeid] = siblings.pop()
            why.pop(nodeid, None)
    for t in manifest.tasks:                    # hand-made exclusions win
        for nodeid in [n for n, o in owner.items() if o == t.id]:
            if _excluded(nodeid, t.exclude):
                del owner[nodeid]
                why[nodeid] = f"excluded from {t.id} by hand"
    return owner, why, uses


def _parts(nodeid: str) -> list[str]:
    param = nodeid.partition("[")[2]
    return param[:-1].split("-") if param else []


def selectors(nodeids_of_func: list[str], mine: set[str]) -> list[str]:
    """The fewest ids selecting exactly `mine` among one function's parametrizations."""
    func = function_of(nodeids_of_func[0])
    if set(nodeids_of_func) == mine:
        return [func]
    parts = sorted({p for n in mine for p in _parts(n)})
    for size in (1, 2):
        for combo in itertools.combinations(parts, size):
            sel = f"{func}[{'-'.join(combo)}]"
            if {n for n in nodeids_of_func if matches(n, sel)} == mine:
                return [sel]
    return sorted(mine)                          # exact parametrizations (each its own selector)


def fast_subset(task: Task, ids: list[str], results: dict[str, dict]) -> list[str]:
    """Cheap tests that together run every region of the task they can (greedy cover), among
    those the grader runs (not the task's `unjudged`)."""
    cand = sorted((n for n in ids if not task.is_unjudged(n)), key=lambda n: results[n]["duration"])
    regions = set(task.regions)
    chosen, covered, spent = [], set(), 0.0
    while len(chosen) < FAST_MAX_TESTS:
        best = max(cand, key=lambda n: (len((set(results[n]["hits"]) & regions) - covered),
                                        -results[n]["duration"]), default=None)
        if best is None:
            break
        gain = (set(results[best]["hits"]) & regions) - covered
        if chosen and (not gain or spent + results[best]["duration"] > FAST_MAX_SECONDS):
            break
        chosen.append(best)
        cand.remove(best)
        covered |= gain
        spent += results[best]["duration"]
    if not any(n.startswith("tests/course/") for n in chosen):
        hidden = [n for n in cand if n.startswith("tests/course/")]
        if hidden and len(chosen) < FAST_MAX_TESTS + 1:
            chosen.append(hidden[0])             # a hidden one too: the proof must see them run
    return sorted(chosen)


def lists(manifest: Manifest, data: dict) -> tuple[dict[str, dict[str, list[str]]], dict[str, str]]:
    owner, why, uses = assign(manifest, data)
    results = dict(data["python"])
    for res in data.get("cpp", {}).values():
        for n, r in res.items():
            if owner.get(n) and r["outcome"] == "passed":
                results[n] = r
    by_func = collections.defaultdict(list)
    for n in results:
        by_func[function_of(n)].append(n)
    out = {}
    for task in manifest.tasks:
        mine = {n for n, t in owner.items() if t == task.id}
        ids = []
        for func in sorted({function_of(n) for n in mine}):
            ids += selectors(by_func[func], {n for n in mine if function_of(n) == func})
        out[task.id] = {
            "public": [i for i in ids if not i.startswith("tests/course/")],
            "hidden": [i for i in ids if i.startswith("tests/course/")],
            "fast": fast_subset(task, sorted(mine), results) if mine else [],
            "uses": sorted(uses.get(task.id, set()), key=lambda x: [t.id for t in manifest.tasks].index(x)),
            "seconds": round(sum(results[n]["duration"] for n in mine), 1),
        }
    return out, why


# ------------------------------------------------------------------ rewriting tasks.toml in place

def _array_span(text: str, start: int) -> int:
    """Index just past the `]` closing the array whose `[` is at text[start]."""
    i, depth = start, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            i = text.index("\n", i)
            continue
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("unterminated array in tasks.toml")


def _render_array(key: str, values: list[str]) -> str:
    if not values:
        return f"{key} = []"
    return f"{key} = [\n" + "".join(f"    {json.dumps(v)},\n" for v in values) + "]"


def rewrite(text: str, generated: dict[str, dict[str, list[str]]], keys=("public", "hidden", "fast", "uses")) -> str:
    """tasks.toml with each task's generated arrays replaced (or added after `regions`)."""
    blocks = re.split(r"(?m)^(?=\[\[task\]\]\s*$)", text)
    out = []
    for block in blocks:
        m = re.search(r'(?m)^id\s*=\s*"([^"]+)"', block)
        if not block.startswith("[[task]]") or not m or m.group(1) not in generated:
            out.append(block)
            continue
        gen = generated[m.group(1)]
        for key in keys:
            km = re.search(rf"(?m)^{key}\s*=\s*\[", block)
            new = _render_array(key, gen[key])
            if km:
                end = _array_span(block, km.end() - 1)
                block = block[:km.start()] + new + block[end:]
            else:
                rm = re.search(r"(?m)^regions\s*=\s*\[", block)
                at = _array_span(block, rm.end() - 1) if rm else len(block.rstrip("\n"))
                block = block[:at] + "\n" + new + block[at:]
        out.append(block)
    return "".join(out)


def report(manifest: Manifest, generated: dict, why: dict[str, str]) -> list[str]:
    lines = []
    for t in manifest.tasks:
        g = generated[t.id]
        flag = "" if g["public"] else "   <-- NO PUBLIC TEST"
        lines.append(f"{t.id:12s} public {len(g['public']):3d} hidden {len(g['hidden']):2d} fast {len(g['fast'])} "
                     f"~{g['seconds']:6.1f} s  uses {','.join(g['uses']) or '-'}{flag}")
    reasons = collections.Counter(v.split(":")[0] for v in why.values())
    lines.append(f"no task's: {len(why)} tests ({dict(reasons)})")
    return lines


def rerun(manifest: Manifest, data: dict, files: list[str], jobs: int = 2) -> dict:
    """`data` with the tests of `files` (added or changed since) discovered again; the C++
    tasks' candidates among them too."""
    fresh = run_probed(list(files), manifest=manifest, jobs=jobs)
    in_files = (lambda n: n.split("::")[0] in set(files))
    data = {"python": {**{n: r for n, r in data["python"].items() if not in_files(n)}, **fresh},
            "cpp": {t: dict(r) for t, r in data.get("cpp", {}).items()}}
    for task in manifest.tasks:
        again = [f for f in task.candidates if f in set(files)] if "c" in task.languages else []
        if again:
            kept = {n: r for n, r in data["cpp"].get(task.id, {}).items() if not in_files(n)}
            data["cpp"][task.id] = {**kept, **run_probed(again, manifest=manifest, restore_cpp={task.id}, jobs=jobs)}
    return data


def main(from_json: str | None, dry_run: bool, jobs: int, out_json: str = "build/course_discovery.json",
         again: list[str] = ()) -> int:
    manifest = load()
    if again and not from_json:
        raise SystemExit("--again updates a discovery: name it with --from")
    if from_json:
        data = json.loads(pathlib.Path(from_json).read_text())
        if again:
            data = rerun(manifest, data, list(again), jobs=jobs)
            pathlib.Path(from_json).write_text(json.dumps(data, indent=1))
            print(f"discovery data: {from_json} (with {', '.join(again)} discovered again)")
    else:
        data = discovery(manifest, jobs=jobs)
        path = ROOT / out_json
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        print(f"discovery data: {path}")
    generated, why = lists(manifest, data)
    for line in report(manifest, generated, why):
        print(line)
    old = MANIFEST.read_text()
    new = rewrite(old, generated)
    if dry_run:
        print("(dry run: course/tasks.toml unchanged)" if new != old else "(course/tasks.toml is up to date)")
        return 0
    if new != old:
        MANIFEST.write_text(new)
        print("course/tasks.toml: test lists rewritten")
    else:
        print("course/tasks.toml: already up to date")
    return 0
