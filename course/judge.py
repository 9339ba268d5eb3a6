"""The judge: a grade the student's code cannot forge.

Grading runs a task's tests twice, in two processes that never share a line of code:

    the student's process   the student's tree (the tasks it builds on filled in with the reference),
                            sandboxed (zygote.py: an unprivileged user, the reference and the judge's
                            files out of reach). It runs each test as usual, but what counts is what the
                            task's code DID: every call into the task's code (its BOUNDARY: the functions
                            holding its regions, the launches of its Triton kernels, the calls into the
                            C++ library built from its sources) is logged with the objects it changed
                            and what it returned or raised (course/judge_runtime.py). Its own pass/fail
                            is never read.

    the judge's process     the reference tree with ONLY this task stubbed (built here, kept in a
                            folder the student's process cannot read) runs the same test: the same
                            seeds, the same examples, every other function the reference's. Each call
                            into the task's code is answered from the log: the judge's own argument
                            objects get the logged changes, the logged result comes back. The test's
                            assertions, its oracle, the reference of every other task run here, and
                            this process's outcomes are the grade.

So a patched pytest, a hookwrapper, a monkeypatched `torch.allclose`, an `os._exit(0)`, a results
file written by hand: all of it happens in the student's process and changes nothing the judge
reads but the log, and a log that does not hold the task's correct outputs fails the judge's
assertions. The judge never runs the student's code (it rebuilds objects only as instances of its
own classes, from JSON and raw bytes), never holds the task's solution (stubbed in its tree: any
path that reaches it fails) and never tells the student's process anything (it runs after it).

`make test-task` in a student tree is plain pytest, as before: the judge is the instructor's grading.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import pathlib
import pwd
import shutil
import sys
import tempfile
import time

from course.judge_peek import PEEK_EXIT
from course.layout import ROOT, Chapter, chapters
from course.manifest import Manifest, Task, load
from course.regions import parse_python
from course.runner import (PLUGIN, RunResult, TestResult, ZygoteClient, _extension_dir, _read_events,
                           _reference_dirs, crash_summary, make_workspace, pytest_args)
from course.testids import matches

RUNTIME_FILE = pathlib.Path(__file__).with_name("judge_runtime.py")
SITECUSTOMIZE_FILE = pathlib.Path(__file__).with_name("judge_sitecustomize.py")
PEEK_FILE = pathlib.Path(__file__).with_name("judge_peek.py")
JUDGE_GRACE_S = 5.0             # the runner kills a test of the student's this long after its plugin should have
JUDGE_FACTOR = 3.0              # the judge's process gets this times a test's limit (+ 60 s) to replay it
NOBODY = "nobody"


# ------------------------------------------------------------------------------------ boundaries


def module_of(path: str, chs: list[Chapter] | None = None) -> str | None:
    """'02_kvcache/block_pool.py' -> 'kvcache.block_pool' (a package's __init__.py -> the package)."""
    chs = chs or chapters()
    folder, _, rest = path.partition("/")
    ch = next((c for c in chs if c.folder == folder), None)
    if ch is None or not rest.endswith(".py"):
        return None
    parts = [ch.package] + rest[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            out[node.name] = node
    return out


def _called_names(node) -> set[str]:
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name):
                names.add(f.id)
            elif isinstance(f, ast.Attribute):
                names.add(f.attr)
    return names


def _launched_names(tree: ast.Module) -> set[str]:
    """Names launched from Python as `name[grid](...)`."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript):
            v = n.func.value
            out.add(v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else "")
    return out


def boundary_spec(task: Task, root: pathlib.Path = ROOT, manifest: Manifest | None = None) -> dict:
    """What the import hook decorates for `task` (course/judge_runtime.py: install):
    {"functions": {module: [qualname]}, "loaders": {module: {qualname: {"calls": [arg], "outcome": [arg]}}}}.

    Python regions: the function holding each. A region inside a Triton jit helper (a device
    function other kernels call): every kernel that reaches it and is launched from Python, in any
    chapter. C++ regions: the task's `boundary` in tasks.toml — the loaders whose library is built
    from its sources (`path::function[first argument]`)."""
    chs = chapters(root)
    functions: dict[str, set[str]] = {}
    helpers: set[str] = set()
    for key in task.regions:
        path, _, func = key.partition("::")
        func = func.split("#")[0]
        if not path.endswith(".py"):
            continue
        mod = module_of(path, chs)
        text = (root / path).read_text()
        tree = parse_python(text)       # (the proof's threads: CPython 3.11's parser is not thread-safe)
        jits = _jit_functions(tree)
        if "." not in func and func in jits:
            helpers.add(func)          # a Triton function: the kernels that reach it are the boundary
        else:
            functions.setdefault(mod, set()).add(func)
    if helpers:
        # every jit function of the chapters, its module, and what it calls; a kernel is a jit
        # function no other calls (launched from Python, however: `kernel = a if x else b`)
        graph: dict[tuple[str, str], set[str]] = {}
        for ch in chs:
            for p in sorted((root / ch.folder).rglob("*.py")):
                rel = p.relative_to(root).as_posix()
                try:
                    text = p.read_text()
                except (OSError, UnicodeDecodeError):
                    continue
                if "jit" not in text:
                    continue
                tree = parse_python(text)
                mod = module_of(rel, chs)
                for name, node in _jit_functions(tree).items():
                    graph[(mod, name)] = _called_names(node)
        reach = set(helpers)
        changed = True
        while changed:
            changed = False
            for (mod, name), calls in graph.items():
                if name not in reach and calls & reach:
                    reach.add(name)
                    changed = True
        called = set().union(*graph.values()) if graph else set()
        for (mod, name) in graph:
            if name in reach and name not in called:
                functions.setdefault(mod, set()).add(name)
    loaders: dict[str, dict[str, dict]] = {}
    # A loader: the calls into the library it returns are the task's ("calls": the first arguments
    # it is called with, None: any). The performance track's kernels (optional, C++) are the
    # student's in every grading, and whether one builds decides paths (a model packs its linears
    # for our GEMM, or not): for another task's, the judge takes from the student's process only
    # whether it loaded ("outcome") — it then runs its own, the reference's, never the student's
    # outputs in place of what a test computes with it.
    others = [e for t in (manifest or load()).tasks if t.optional and t.id != task.id
              for e in t.boundary if e.startswith("loader:")]
    for entry, outcome in [(e, False) for e in task.boundary] + [(e, True) for e in others]:
        kind, path, func, arg = parse_boundary(entry)
        mod = module_of(path, chs)
        if kind == "loader":
            spec = loaders.setdefault(mod, {}).setdefault(func, {"calls": [], "outcome": []})
            if arg not in spec["calls"]:
                (spec["outcome"] if outcome else spec["calls"]).append(arg)
        else:
            functions.setdefault(mod, set()).add(func)
    for funcs in loaders.values():
        for spec in funcs.values():
            spec["outcome"] = [a for a in spec["outcome"] if a not in spec["calls"]]
    return {"functions": {m: sorted(q) for m, q in sorted(functions.items())}, "loaders": loaders}


def parse_boundary(entry: str) -> tuple[str, str, str, str | None]:
    """A task's `boundary` entry (course/tasks.toml) -> (kind, path, qualname, argument):
        "loader:kernels_cuda/emulator/__init__.py::load[paged_attention]"   the calls into the library a
            loader returns (here: only when its first argument is "paged_attention") — a C++ task's
        "02_kvcache/simulate.py::simulate"    a function of a file without regions, judged whole: the
            tests reach the task's code through it so many times that logging each call would not
            fit the time limits (its file is the reference's in the student's process too)."""
    kind, _, rest = entry.rpartition("loader:") if entry.startswith("loader:") else ("", "", entry)
    path, _, qual = rest.partition("::")
    func, _, arg = qual.partition("[")
    return ("loader" if entry.startswith("loader:") else "function", path, func, arg.rstrip("]") or None)


def whole_files(task: Task) -> list[str]:
    """The files of the task's whole-function boundaries: the student's process runs the
    reference's copy of them (they hold no region: nothing of the student's is lost)."""
    return sorted({parse_boundary(e)[1] for e in task.boundary if parse_boundary(e)[0] == "function"})


# ------------------------------------------------------------------------------------ the judge's tree


def judge_tree(task: Task, dest: pathlib.Path, manifest: Manifest) -> pathlib.Path:
    """The reference with only `task` stubbed (chapter folders and benchmarks: what grading needs)."""
    from course.build import build
    if not (dest / "course_build.json").exists():
        everything = {t.id for t in manifest.tasks}
        build([], dest, minimal=True, restore=everything - {task.id}, manifest=manifest, check=False, link_big=False)
    return dest


# ------------------------------------------------------------------------------------ the sandbox


@dataclasses.dataclass
class Sandbox:
    """How the student's process is confined (zygote.py: enter_sandbox); spec None: not at all."""
    spec: dict | None
    uid: int | None
    why_not: str = ""


def sandbox_for(visible: list[pathlib.Path], binds: list[tuple[pathlib.Path, pathlib.Path]]) -> Sandbox:
    """Hide every top-level folder of this repository (the reference, its history) but the
    virtual environment and those holding something the student's process needs (`visible`);
    run it as `nobody`. Needs root; $COURSE_SANDBOX=off turns it off (then the report says so),
    $COURSE_SANDBOX=require makes grading stop where it cannot have one (an official grading: without
    the sandbox the student's code runs as the grader's user, and could reach the judge's files)."""
    mode = os.environ.get("COURSE_SANDBOX", "auto")
    if mode == "off":
        return Sandbox(None, None, "turned off ($COURSE_SANDBOX=off)")
    why = None
    nobody = None
    if os.geteuid() != 0:
        why = "the grader does not run as root, so the student's process runs as the same user as the judge's"
    else:
        try:
            nobody = pwd.getpwnam(NOBODY)
        except KeyError:
            why = "no user 'nobody' on this machine"
    if why is not None:
        if mode == "require":
            raise SystemExit(f"grading needs the sandbox ($COURSE_SANDBOX=require) and cannot have it: {why}")
        return Sandbox(None, None, why)
    keep = {pathlib.Path(sys.prefix).resolve()}
    hide = []
    vis = [p.resolve() for p in visible]
    for entry in sorted(ROOT.iterdir()):
        if not entry.is_dir() or entry.is_symlink():
            continue
        r = entry.resolve()
        if r in keep or any(v == r or r in v.parents or v in r.parents for v in vis) \
                or any(k == r or r in k.parents for k in keep):
            continue
        hide.append(str(r))
    reveal = sorted({str(pathlib.Path(p).resolve()) for p in (sys.base_prefix, sys.prefix)})
    spec = {"uid": nobody.pw_uid, "gid": nobody.pw_gid, "hide": hide, "reveal": reveal,
            "binds": [[str(s), str(d)] for s, d in binds]}
    return Sandbox(spec, nobody.pw_uid)


def judge_sandbox(visible: list[pathlib.Path]) -> dict | None:
    """The judge's process hides this repository's folders too (it stays root): whatever a test
    starts there — a subprocess, a server — can import only the judge's tree, never the task's
    reference through the editable install. None when the grader is not root."""
    if os.environ.get("COURSE_SANDBOX", "auto") == "off" or os.geteuid() != 0:
        return None
    keep = {pathlib.Path(sys.prefix).resolve()}
    vis = [p.resolve() for p in visible]
    hide = []
    for entry in sorted(ROOT.iterdir()):
        if not entry.is_dir() or entry.is_symlink():
            continue
        r = entry.resolve()
        if r in keep or any(v == r or r in v.parents or v in r.parents for v in vis):
            continue
        hide.append(str(r))
    return {"uid": None, "gid": None, "hide": hide, "reveal": [], "binds": []}


def _own(path: pathlib.Path, uid: int | None, mode: int = 0o700) -> pathlib.Path:
    """A NEW folder (never one the student's process made: a symlink it planted must not make the
    grader, root, chown or write somewhere else), given to `uid` if set."""
    path.mkdir(parents=True, exist_ok=False)
    if uid is not None:
        os.chown(path, uid, -1, follow_symlinks=False)
    os.chmod(path, mode)
    return path


def read_untrusted(path: pathlib.Path, offset: int = 0, limit: int = 1 << 24) -> bytes:
    """Bytes of a file the student's process wrote: only a regular file (not a symlink to one of the
    grader's files, not a FIFO that would block the grader), at most `limit` from `offset`."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _open_up(path: pathlib.Path, stop: pathlib.Path | None = None) -> None:
    """Let other users traverse `path` and its parents up to `stop` (temporary folders are 0700)."""
    path = path.resolve()
    for p in [path, *path.parents]:
        if stop is not None and p == stop.resolve().parent:
            break
        try:
            st = p.stat()
            if st.st_uid == os.geteuid() and not st.st_mode & 0o001:
                os.chmod(p, st.st_mode | 0o011)
        except OSError:
            pass
        if p == pathlib.Path(tempfile.gettempdir()).resolve() or p == pathlib.Path("/"):
            break


def student_cache(student: pathlib.Path, uid: int | None, key: str | None = None) -> pathlib.Path:
    """The student's process's build caches (C++ extensions, the CUDA emulator's libraries, Triton),
    one per student tree (or per `key`: the proof's trees, all the instructor's, share one), writable
    by that user alone and never read by the judge's process."""
    base = pathlib.Path(os.environ.get("COURSE_STUDENT_CACHE", pathlib.Path(tempfile.gettempdir()) / "course-student-cache"))
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o711)
    key = key or hashlib.sha256(str(student.resolve()).encode()).hexdigest()[:16]
    cache = base / key
    if cache.is_symlink() or (cache.exists() and (uid is not None and cache.stat().st_uid != uid)):
        shutil.rmtree(cache, ignore_errors=True) if not cache.is_symlink() else cache.unlink()
    if not cache.exists():
        _own(cache, uid)
    return cache


def _model_cache() -> pathlib.Path | None:
    env = os.environ.get("VLLM_FROM_SCRATCH_CACHE")
    p = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "vllm-from-scratch"
    return p if p.is_dir() else None


# ------------------------------------------------------------------------------------ runs


@dataclasses.dataclass
class Segment:
    """One process of the student's: the tests it started, in order, and its log."""
    tests: list[str]
    log: pathlib.Path
    died_in: str | None = None          # the test it was in when it crashed or was killed
    why: str = ""                       # "timeout" | "crashed"
    summary: str = ""
    durations: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StudentRun:
    segments: list[Segment]
    collected: list[str] | None
    output_tail: str
    wall_s: float
    processes: int
    sandbox: str


def _limit_for(nodeid: str, limits: dict[str, float], default: float) -> float:
    for test_id, s in limits.items():
        if matches(nodeid, test_id):
            return s
    return default


def _base_env(ws: pathlib.Path, chs: list[Chapter], guard: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "COURSE_TESTS_DIR": str((ws / "tests").resolve()),
        "COURSE_JUDGE_WORKSPACE": str(ws.resolve()),
        "PYTHONPATH": os.pathsep.join([str(ws / "_import"), str(ws)]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "COURSE_REF_DIRS": json.dumps(_reference_dirs(chs) if guard else []),
    })
    for k in ("PYTEST_ADDOPTS", "COURSE_PROBE", "COURSE_HYPOTHESIS_SHRINK", "COURSE_TEST_LIMIT"):
        env.pop(k, None)
    return env


def _pytest_argv(ws: pathlib.Path, args_file: pathlib.Path, seed: int) -> list[str]:
    return ["-c", str(ws / "pytest.ini"), "--rootdir", str(ws), "-q", "-p", "no:randomly",
            f"--hypothesis-seed={seed}", f"@{args_file}"]


def record_student(ws: pathlib.Path, tests: list[str], *, out: pathlib.Path, boundary: dict, seed: int,
                   limits: dict[str, float], default_limit: float, budget_s: float, zygote: ZygoteClient,
                   sandbox: Sandbox, cache: pathlib.Path, extra_env: dict | None = None,
                   standins: list[str] | None = None, chs: list[Chapter] | None = None,
                   guard: bool = True) -> StudentRun:
    """Run `tests` in the student's process(es), logging the task's boundary calls. A process that
    crashes or runs past a test's limit is killed and a new one runs the tests it had not started."""
    chs = chs or chapters()
    t0 = time.monotonic()
    env = _base_env(ws, chs, guard)
    # `out` is the grader's (root's); inside it, only what the student's process writes is its own.
    home = _own(out / "home", sandbox.uid)
    tmp = _own(out / "tmp", sandbox.uid)
    env.update({
        "COURSE_JUDGE_MODE": "record", "COURSE_JUDGE_BOUNDARY": json.dumps(boundary), "COURSE_JUDGE_SEED": str(seed),
        "COURSE_STANDINS": json.dumps(list(standins or [])), "HOME": str(home), "TMPDIR": str(tmp),
        "XDG_CACHE_HOME": str(cache), "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"),
        "TRITON_CACHE_DIR": str(cache / "triton"), "MPLCONFIGDIR": str(cache / "matplotlib"),
        "HF_HOME": str(cache / "huggingface"),
        "COURSE_TEST_LIMITS": json.dumps(limits), "COURSE_TEST_LIMIT": str(default_limit),
    })
    if sandbox.uid is not None:
        env.update({"USER": NOBODY, "LOGNAME": NOBODY})
    spec = None
    if sandbox.spec is not None:
        spec = dict(sandbox.spec)
        spec["staging"] = str(_own(out / "staging", None, 0o700))
        model = _model_cache()
        if model is not None:
            mount = _own(out / "model-cache", None, 0o755)
            spec["binds"] = list(spec.get("binds", [])) + [[str(model), str(mount)]]
            env["VLLM_FROM_SCRATCH_CACHE"] = str(mount)
    env.update(extra_env or {})
    segments: list[Segment] = []
    collected: list[str] | None = None
    pending = list(tests)
    tail = ""
    n = 0
    while pending and time.monotonic() - t0 < budget_s:
        n += 1
        seg_dir = _own(out / f"segment{n}", sandbox.uid, 0o755)
        progress = seg_dir / "progress.jsonl"
        log = seg_dir / "log"
        args, select = pytest_args(pending)
        args_file = out / f"args{n}"
        args_file.write_text("\n".join(args))
        os.chmod(args_file, 0o644)
        env.update({"COURSE_RESULTS": str(progress), "COURSE_JUDGE_LOG": str(log),
                    "COURSE_SELECT": json.dumps(select if select is not None else None)})
        proc = zygote.start(_pytest_argv(ws, args_file, seed), cwd=ws, env=env, sandbox=spec)
        current, started_at, killed = None, None, None
        read = 0
        started: list[str] = []
        durations: dict[str, float] = {}
        while True:
            code = proc.poll()
            events, read = _read_new(progress, read)
            for ev in events:
                kind = ev.get("event")
                if kind == "collected" and collected is None and isinstance(ev.get("nodeids"), list):
                    collected = [x for x in ev["nodeids"] if isinstance(x, str)]
                elif kind == "start" and isinstance(ev.get("nodeid"), str):
                    current, started_at = ev["nodeid"], time.monotonic()
                    if current not in started:
                        started.append(current)
                elif kind == "done" and ev.get("nodeid") == current:
                    durations[current] = time.monotonic() - started_at
                    current = None
            if code is not None:
                break
            if current is not None and time.monotonic() - started_at > _limit_for(current, limits, default_limit) + JUDGE_GRACE_S:
                proc.kill()
                killed = "timeout"
            elif time.monotonic() - t0 > budget_s:
                proc.kill()
                killed = "budget"
            time.sleep(0.05)
        code, text = proc.wait()
        events, read = _read_new(progress, read)
        for ev in events:
            if ev.get("event") == "done" and ev.get("nodeid") == current:
                durations[current] = time.monotonic() - started_at
                current = None
        tail = text[-4000:]
        (out / f"output{n}.txt").write_text(text[-200000:])        # beside, not inside, the student's folder
        seg = Segment(started, log, durations=durations)
        if current is not None:
            seg.died_in = current
            limit = _limit_for(current, limits, default_limit)
            if killed is None and time.monotonic() - started_at >= limit - 0.5:
                killed = "timeout"                # its own watchdog stopped it at the limit
            if killed == "timeout":
                seg.why = "timeout"
                seg.summary = f"ran past its limit of {_limit_for(current, limits, default_limit):.0f} s"
            elif killed == "budget":
                seg.why = "timeout"
                seg.summary = f"the task's {budget_s:.0f} s ran out in this test"
            else:
                seg.why = "crashed"
                seg.summary = (peek_summary(log) if code == PEEK_EXIT
                               else crash_summary(current, code, text, ws, chs))
            durations.setdefault(current, time.monotonic() - started_at)
        if started:
            segments.append(seg)
        if collected is None or not started:
            break
        remaining = [t for t in collected if t not in {s for g in segments for s in g.tests}]
        if remaining == pending:
            break
        pending = remaining
    return StudentRun(segments, collected, tail, time.monotonic() - t0, n,
                      "on" if sandbox.spec is not None else f"off: {sandbox.why_not}")


def peek_summary(log: pathlib.Path) -> str:
    """The line judge_peek left when it stopped the student's process (the student's process wrote
    it: shown, never believed — the exit status alone decides)."""
    said = read_untrusted(log / "peek.txt", 0, 600).decode(errors="replace").strip().splitlines()
    what = said[-1] if said else "your code reached the running frames or objects of the process"
    return f"stopped: {what} — a graded test's own values (its expected results) are not your code's to read"


def _read_new(path: pathlib.Path, offset: int) -> tuple[list[dict], int]:
    data = read_untrusted(path, offset)
    cut = data.rfind(b"\n")
    if cut < 0:
        return [], offset
    events = []
    for line in data[:cut].splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            events.append(ev)
    return events, offset + cut + 1


def replay_judge(ws: pathlib.Path, run: StudentRun, tests: list[str], *, boundary: dict, seed: int,
                 limits: dict[str, float], default_limit: float, zygote: ZygoteClient,
                 standins: list[str] | None = None, chs: list[Chapter] | None = None,
                 extra_env: dict | None = None, sandbox: dict | None = None) -> tuple[dict[str, TestResult], list[str], int]:
    """The judge's verdict on every test of `tests`: each segment of the student's run replayed in a
    judge's process of its own (so module fixtures and collection happen where they did there).
    Returns ({nodeid: result}, the test node ids the judge collected, processes)."""
    chs = chs or chapters()
    env = _base_env(ws, chs)
    env.update({
        "COURSE_JUDGE_MODE": "replay", "COURSE_JUDGE_BOUNDARY": json.dumps(boundary), "COURSE_JUDGE_SEED": str(seed),
        "COURSE_JUDGE_PACKAGES": json.dumps(sorted({c.package for c in chs} | {"benchmarks"})),
        "COURSE_STANDINS": json.dumps(list(standins or [])), "TORCH_EXTENSIONS_DIR": _extension_dir(ws),
        "COURSE_UNIVERSE": json.dumps(list(tests)),
        "COURSE_TEST_LIMITS": json.dumps({k: v * JUDGE_FACTOR + 60 for k, v in limits.items()}),
        "COURSE_TEST_LIMIT": str(default_limit * JUDGE_FACTOR + 60),
    })
    env.update(extra_env or {})
    results: dict[str, TestResult] = {}
    universe: list[str] | None = None
    processes = 0
    # The judge's workspace is shared by every grading of this task (the proof grades a task in
    # several configurations at once): each replay keeps its files in a folder of its own.
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="replay-", dir=ws.parent))
    empty = scratch / "empty-log"
    empty.mkdir()
    jobs = [(seg.tests, seg) for seg in run.segments] or [(list(tests), None)]
    nothing = not run.segments           # the student's process ran no test: every one fails for that reason
    for seg_tests, seg in jobs:
        pending = list(seg_tests)
        exact = seg is not None
        while pending:
            processes += 1
            token = f"{processes}"
            progress = scratch / f"progress-{token}.jsonl"
            args, select = _args_for(pending, exact)
            args_file = scratch / f"args-{token}"
            args_file.write_text("\n".join(args))
            env.update({"COURSE_RESULTS": str(progress), "COURSE_JUDGE_LOG": str(seg.log if seg else empty),
                        "COURSE_SELECT": json.dumps(select)})
            budget = sum(_limit_for(t, limits, default_limit) * JUDGE_FACTOR + 60 for t in pending) + 180
            code, text = zygote.run(_pytest_argv(ws, args_file, seed), cwd=ws, env=env, timeout=budget, sandbox=sandbox)
            events = _read_events(progress)
            current = None
            done_here = []
            for ev in events:
                kind = ev.get("event")
                if kind == "universe" and universe is None:
                    universe = ev.get("nodeids")
                elif kind == "start":
                    current = ev["nodeid"]
                elif kind == "done":
                    results[ev["nodeid"]] = TestResult(ev["nodeid"], ev["outcome"], ev["duration"], ev["message"],
                                                       None, ev.get("summary", ""))
                    done_here.append(ev["nodeid"])
                    current = None
            if not any(ev.get("event") == "collected" for ev in events):
                for t in pending:
                    results.setdefault(t, TestResult(t, "error", 0.0, "the judge's process did not collect:\n"
                                                     + text[-1500:], summary="the judge's process did not collect "
                                                     "(an error in the grader, not in your code)"))
                break
            if current is not None and current not in results:
                results[current] = TestResult(current, "error", 0.0, "the judge's process died replaying this test:\n"
                                              + text[-1500:], summary=f"the judge's process died replaying this test "
                                              f"(exit {code})")
                done_here.append(current)
            rest = [t for t in pending if t not in results]
            if rest == pending or not done_here:
                for t in rest:
                    results[t] = TestResult(t, "error", 0.0, "the judge did not run this test:\n" + text[-1500:],
                                            summary="the judge's process did not run this test")
                break
            pending = rest
    # What the student's process never ran, or died in.
    all_tests = universe if universe is not None else [t for seg in run.segments for t in seg.tests]
    if nothing:
        why = _not_run_reason(run, "")
        results = {t: TestResult(t, "not run", 0.0, why + "\n" + run.output_tail[-1500:], None, why)
                   for t in (universe if universe is not None else tests)}
        return results, list(results), processes
    ran = {t: seg for seg in run.segments for t in seg.tests}
    for t in all_tests:
        seg = ran.get(t)
        if seg is not None and seg.died_in == t:
            outcome = "timeout" if seg.why == "timeout" else "crashed"
            results[t] = TestResult(t, outcome, seg.durations.get(t, 0.0), seg.summary, None, seg.summary)
        elif t not in results or (seg is None and results[t].outcome == "passed"):
            why = _not_run_reason(run, t)
            results[t] = TestResult(t, "not run", 0.0, why, None, why)
        elif seg is not None and t in seg.durations:
            results[t].duration = seg.durations[t]
    return results, list(all_tests), processes


def _args_for(pending: list[str], exact: bool) -> tuple[list[str], list[str] | None]:
    if not exact:
        return pytest_args(pending)
    args = []
    for t in pending:
        f = t.partition("[")[0]
        if f not in args:
            args.append(f)
    return args, list(pending)


def _not_run_reason(run: StudentRun, nodeid: str) -> str:
    if not run.segments:
        return ("your process ran no test: it stopped before collecting them (exit, crash or import error: "
                + (run.output_tail.strip().splitlines() or ["no output"])[-1][:300] + ")")
    last = run.segments[-1]
    if last.died_in:
        return f"not run: your process stopped in {last.died_in} ({last.why}) and did not reach it"
    return "not run: your process did not run this test (it ran out of the task's time, or skipped it)"


# ------------------------------------------------------------------------------------ one task


@dataclasses.dataclass
class JudgedRun:
    results: dict[str, TestResult]
    collected: list[str]
    processes: int
    wall_s: float
    sandbox: str
    student_wall_s: float


def judge_task(student_ws: pathlib.Path, judge_ws: pathlib.Path, task: Task, tests: list[str], *, work: pathlib.Path,
               zygote: ZygoteClient, sandbox: Sandbox, cache: pathlib.Path, seed: int | None = None,
               limits: dict[str, float] | None = None, default_limit: float | None = None,
               budget_s: float | None = None, extra_env: dict | None = None, guard: bool = True) -> JudgedRun:
    t0 = time.monotonic()
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    boundary = boundary_spec(task)
    default_limit = default_limit if default_limit is not None else task.test_timeout_s
    limits = limits or {}
    budget_s = budget_s if budget_s is not None else task.timeout_s
    out = _own(work / f"student-{task.id}-{os.urandom(3).hex()}", None, 0o755)
    run = record_student(student_ws, tests, out=out, boundary=boundary, seed=seed, limits=limits,
                         default_limit=default_limit, budget_s=budget_s, zygote=zygote, sandbox=sandbox, cache=cache,
                         standins=task.standins, extra_env=extra_env, guard=guard)
    results, collected, jprocs = replay_judge(judge_ws, run, tests, boundary=boundary, seed=seed, limits=limits,
                                              default_limit=default_limit, zygote=zygote, standins=task.standins,
                                              extra_env=extra_env, sandbox=judge_sandbox([judge_ws, work]))
    return JudgedRun(results, collected, run.processes + jprocs, time.monotonic() - t0, run.sandbox, run.wall_s)


def _judge_files(ws: pathlib.Path) -> None:
    shutil.copy(RUNTIME_FILE, ws / "_course_judge.py")
    shutil.copy(PEEK_FILE, ws / "_course_judge_peek.py")
    shutil.copy(SITECUSTOMIZE_FILE, ws / "sitecustomize.py")


def prepare_student_workspace(ws: pathlib.Path, uid: int | None) -> None:
    """The student's process reads its workspace and writes nothing there but new files in its root:
    the root is sticky (like /tmp), so it cannot rename or replace the grader's files beside them —
    judge_peek trusts code by the file it comes from."""
    _judge_files(ws)
    if uid is not None:
        os.chmod(ws, 0o1777)
    _open_up(ws)


def prepare_judge_workspace(ws: pathlib.Path) -> None:
    _judge_files(ws)
