"""Run the instructor's tests against a student tree, in a separate process that can only
import the student's code.

The grading workspace (a temporary folder):

    ws/01_paged_attention -> STUDENT/01_paged_attention     (every top-level entry of the
    ws/kernels_cuda       -> STUDENT/kernels_cuda             student tree but tests/)
    ws/tests/                copied from THIS repository: public + hidden tests
    ws/_import/kvcache    -> STUDENT/02_kvcache              (import names -> student folders)
    ws/_course_grader_plugin.py, ws/pytest.ini

pytest runs in ws with PYTHONPATH=ws/_import:ws; the plugin removes the editable install's
finder (which would map `kvcache` to this repository's 02_kvcache) and guards every import
(course/grader_plugin.py). So `kernels_cuda` is the student's too, and the CUDA emulator
(kernels_cuda/emulator, which compiles the kernels_cuda/ it is imported from) builds the
student's kernels.

An overlay ({path: text}) replaces some of the student's files in the workspace: the grader
fills in the reference of the tasks a task builds on (course/grade.py). A top-level folder with
an overlaid file is copied rather than linked, so code that finds its sources from its own
resolved path (the emulator, the CPU kernels' builder) sees the overlay too.

A process that crashes (a C++ stub throws, a segfault) or runs out of a task's time is
restarted on the tests it had not run yet; the test it died in is scored as crashed (with the
signal, the last frame of the student's code and the C++ exception, when the output has them)
or timed out, and a timed-out task gets 0.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib

from course.layout import ROOT, Chapter, chapters
from course.testids import function_of, matches

PLUGIN = pathlib.Path(__file__).with_name("grader_plugin.py")
TESTIDS = pathlib.Path(__file__).with_name("testids.py")
ZYGOTE = pathlib.Path(__file__).with_name("zygote.py")
BIG = 512 * 1024          # files above this are linked even in a copied folder


@dataclasses.dataclass
class TestResult:
    nodeid: str
    outcome: str            # passed / failed / error / skipped / not_here / crashed / timeout / not run
    duration: float = 0.0
    message: str = ""       # the end of the failure report
    hits: list[str] | None = None
    summary: str = ""       # one line: the failing assertion / exception (where it was raised)
    marks: list[str] | None = None      # discovery only: its pytest markers


@dataclasses.dataclass
class RunResult:
    results: dict[str, TestResult]
    collected: list[str]
    reference_modules: list[str]
    timed_out_tasks: set[str]
    processes: int
    wall_s: float
    stderr_tail: str = ""


def _ini(extra_markers: list[str]) -> str:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    opts = data["tool"]["pytest"]["ini_options"]
    markers = list(opts.get("markers", [])) + extra_markers
    warnings = list(opts.get("filterwarnings", []))
    lines = ["[pytest]",
             "addopts = --import-mode=importlib -ra --strict-markers -p _course_grader_plugin -p no:cacheprovider "
             "--continue-on-collection-errors",
             "pythonpath = tests",
             "markers ="]
    lines += [f"    {m}" for m in markers]
    if warnings:
        lines.append("filterwarnings =")
        lines += [f"    {w}" for w in warnings]
    return "\n".join(lines) + "\n"


# Not linked from a student tree: what the workspace's own files are called (a student's file of
# that name must not stand in for the grader's), and what Python runs at start-up.
SKIP_ENTRIES = {"tests", ".git", ".venv", "conftest.py", "pytest.ini", "build", "__pycache__", "_import",
                "_course_grader_plugin.py", "_course_testids.py", "_course_judge.py", "_course_judge_peek.py",
                "sitecustomize.py", "usercustomize.py"}


def _copy_with_overlay(src: pathlib.Path, dst: pathlib.Path, overlay: dict[str, str], prefix: str) -> None:
    """src copied to dst (big files linked), the files named in overlay (paths relative to the
    tree, under `prefix`) written from it."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        rel = f"{prefix}/{entry.name}"
        if entry.name == "__pycache__":
            continue
        if entry.is_dir():
            _copy_with_overlay(entry, dst / entry.name, overlay, rel)
        elif rel in overlay:
            (dst / entry.name).write_text(overlay[rel])
            shutil.copymode(entry, dst / entry.name)
        elif entry.stat().st_size > BIG:
            (dst / entry.name).symlink_to(entry.resolve())
        else:
            shutil.copy2(entry, dst / entry.name)


def make_workspace(student: pathlib.Path, ws: pathlib.Path, *, tests_src: pathlib.Path = ROOT / "tests",
                   markers: list[str] = (), chs: list[Chapter] | None = None,
                   overlay: dict[str, str] | None = None) -> pathlib.Path:
    student = student.resolve()
    chs = chs or chapters()
    overlay = overlay or {}
    tops = {rel.split("/", 1)[0] for rel in overlay}
    ws.mkdir(parents=True, exist_ok=True)
    for entry in sorted(student.iterdir()):
        if entry.name in SKIP_ENTRIES or entry.name.startswith(".pytest") or entry.name.endswith(".egg-info"):
            continue
        if entry.name in tops and entry.is_dir():
            _copy_with_overlay(entry, ws / entry.name, overlay, entry.name)
        else:
            (ws / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    shutil.copytree(tests_src, ws / "tests", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc"))
    imports = ws / "_import"
    imports.mkdir()
    for ch in chs:
        if (ws / ch.folder).is_dir():
            target = ws / ch.folder if ch.folder in tops else (student / ch.folder).resolve()
            (imports / ch.package).symlink_to(target, target_is_directory=True)
    shutil.copy(PLUGIN, ws / "_course_grader_plugin.py")
    shutil.copy(TESTIDS, ws / "_course_testids.py")
    (ws / "pytest.ini").write_text(_ini(list(markers)))
    return ws


def _extension_dir(tree: pathlib.Path) -> str:
    """torch.utils.cpp_extension build folder keyed by the tree's C++ sources (and where they
    are: the builder rebuilds when their paths change): trees with the same sources share one
    build, and a student build never evicts the repository's."""
    digest = hashlib.sha256()
    for p in sorted(tree.glob("*/csrc/*")):
        if p.is_file():
            digest.update(str(p.resolve().parent).encode() + p.name.encode() + p.read_bytes())
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return str(base / "vllm_from_scratch" / "course_extensions" / digest.hexdigest()[:16])


def _reference_dirs(chs: list[Chapter]) -> list[str]:
    return [str((ROOT / ch.folder).resolve()) for ch in chs if (ROOT / ch.folder).is_dir()]


_matches = matches


FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def crash_summary(nodeid: str, returncode: int, output: str, ws: pathlib.Path | None,
                  chs: list[Chapter]) -> str:
    """One line a student can act on: the signal, the test, the innermost frame of the
    student's code in the fault handler's dump, and the C++ exception std::terminate names."""
    sig = -returncode if returncode < 0 else None
    if sig is None and "Fatal Python error" in output:
        m = re.search(r"Fatal Python error: (\w+)", output)
        names = {"Segmentation": signal.SIGSEGV, "Aborted": signal.SIGABRT, "Bus": signal.SIGBUS,
                 "Floating": signal.SIGFPE}
        sig = next((int(v) for k, v in names.items() if m and m.group(1).startswith(k)), None)
    try:
        what = f"signal {sig}, {signal.Signals(sig).name}" if sig else f"exit code {returncode}"
    except ValueError:
        what = f"signal {sig}"
    line = f"your code crashed the test process ({what}) in test {nodeid}"
    dump = output[output.find("Fatal Python error"):] if "Fatal Python error" in output else output
    by_package = {c.package: c.folder for c in chs}
    folders = {c.folder for c in chs}
    for path, lineno, func in FRAME.findall(dump):        # innermost frame first
        rel = _student_relpath(path, ws, by_package, folders)
        if rel is not None:
            line += f", at {rel}:{lineno} in {func}"
            break
    m = re.search(r"terminate called after throwing an instance of '([^']+)'", output)
    if m:
        line += f"; C++ threw {m.group(1)}"
        w = re.search(r"what\(\):\s*(.+)", output[m.end():])
        if w:
            line += f": {w.group(1).strip()[:200]}"
    return line


def _student_relpath(path: str, ws: pathlib.Path | None, by_package: dict[str, str], folders: set[str]) -> str | None:
    """'<ws>/_import/kvcache/block.py' or '<ws>/02_kvcache/block.py' -> '02_kvcache/block.py'."""
    parts = pathlib.PurePosixPath(path).parts
    for i, part in enumerate(parts):
        if part == "_import" and i + 1 < len(parts) and parts[i + 1] in by_package:
            return "/".join((by_package[parts[i + 1]],) + parts[i + 2:])
    if ws is not None:
        try:
            rel = pathlib.PurePosixPath(path).relative_to(ws)
        except ValueError:
            return None
        if rel.parts and rel.parts[0] in folders:
            return rel.as_posix()
    return None


def pytest_args(test_ids: list[str]) -> tuple[list[str], list[str] | None]:
    """(what to pass pytest, the ids its collection must be narrowed to, or None). A manifest
    selector (`file::func[torch]`, course/testids.py) is no pytest node id: pytest is given the
    function (`file::func`) and the grader plugin deselects what the selector does not match.
    Exact node ids and other arguments (`-m`, files) pass unchanged."""
    args, reduced = [], False
    for a in test_ids:
        if "::" in a and "[" in a:
            a, reduced = function_of(a), True
        if a not in args:
            args.append(a)
    return args, (list(test_ids) if reduced else None)


def _read_events(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass            # a line cut by a kill
    return events


def run_tests(ws: pathlib.Path, test_args: list[str], *, task_limits: dict[str, tuple[str, float]] | None = None,
              extra_env: dict[str, str] | None = None, student: pathlib.Path | None = None,
              startup_s: float = 180.0, quiet: bool = True, chs: list[Chapter] | None = None,
              standins: list[str] | None = None, zygote: "ZygoteClient | None" = None,
              guard: bool = True, extra_args: list[str] = (), once: bool = False) -> RunResult:
    """Run pytest in `ws` on `test_args` (node ids or paths) until every collected test has a
    result. task_limits: {test id: (task, seconds for the whole task)}. zygote: fork each pytest
    process from it instead of starting a new interpreter (the same process, seconds sooner).
    guard=False: the tree graded IS the reference (an instructor checking it), nothing to refuse."""
    chs = chs or chapters()
    task_limits = dict(task_limits or {})
    results: dict[str, TestResult] = {}
    collected: list[str] | None = None
    spent: dict[str, float] = {}
    timed_out: set[str] = set()
    leaked: list[str] = []
    processes, t0, stderr_tail = 0, time.monotonic(), ""
    pending = list(test_args)
    token = os.urandom(4).hex()              # one workspace may serve several runs
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(ws / "_import"), str(ws)]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "COURSE_REF_DIRS": json.dumps(_reference_dirs(chs) if guard else []),
        "TORCH_EXTENSIONS_DIR": _extension_dir(ws),
    })
    env["COURSE_STANDINS"] = json.dumps(list(standins or []))
    env.pop("PYTEST_ADDOPTS", None)
    env.update(extra_env or {})
    task_of_test = {t: task for t, (task, _) in task_limits.items()}
    limit_of_task = {task: s for _, (task, s) in task_limits.items()}

    def task_for(nodeid):
        for test_id, task in task_of_test.items():
            if _matches(nodeid, test_id):
                return task
        return None

    while pending:
        processes += 1
        results_file = ws / f".results.{token}.{processes}.jsonl"
        left = {t: [task, max(0.5, limit_of_task[task] - spent.get(task, 0.0))] for t, task in task_of_test.items()
                if task not in timed_out}
        env["COURSE_RESULTS"] = str(results_file)
        env["COURSE_LIMITS"] = json.dumps(left)
        budget = startup_s + sum({task: s for task, s in left.values()}.values()) if left else None
        args_file = ws / f".args.{token}.{processes}"
        args, select = pytest_args(pending)
        env["COURSE_SELECT"] = json.dumps(select)
        args_file.write_text("\n".join(args))
        cmd = [sys.executable, "-m", "pytest", "-c", str(ws / "pytest.ini"), "--rootdir", str(ws), "-q",
               "-p", "no:randomly", *extra_args, f"@{args_file}"]
        if zygote is not None:
            returncode, out = zygote.run(cmd[3:], cwd=ws, env=env, timeout=budget)
        else:
            proc = subprocess.Popen(cmd, cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, text=True, errors="replace")
            try:
                out, _ = proc.communicate(timeout=budget)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            returncode = proc.returncode
        stderr_tail = (out or "")[-4000:]
        if not quiet:
            print(out)
        events = _read_events(results_file)
        started = None
        for ev in events:
            kind = ev.get("event")
            if kind == "collected" and collected is None:
                collected = ev["nodeids"]
            elif kind == "start":
                started = ev
            elif kind == "done":
                results[ev["nodeid"]] = TestResult(ev["nodeid"], ev["outcome"], ev["duration"], ev["message"],
                                                   ev.get("hits"), ev.get("summary", ""), ev.get("marks"))
                task = task_for(ev["nodeid"])
                if task:
                    spent[task] = spent.get(task, 0.0) + ev["duration"]
                started = None
            elif kind == "finished":
                leaked = sorted(set(leaked) | set(ev.get("reference_modules", [])))
        if collected is None:
            # Died (or hung) before collecting: nothing more can be learnt by retrying.
            for arg in pending:
                results.setdefault(arg, TestResult(arg, "error", 0.0, "pytest did not collect:\n" + stderr_tail[-1500:]))
            break
        if started is not None and started["nodeid"] not in results:
            nodeid = started["nodeid"]
            elapsed = time.time() - started["t"]
            task = task_for(nodeid)
            if started.get("limit") is not None and elapsed >= started["limit"] - 0.5:
                results[nodeid] = TestResult(nodeid, "timeout", elapsed, f"task {task} ran out of time in this test")
                if task:
                    timed_out.add(task)
            else:
                summary = crash_summary(nodeid, returncode, out or "", ws, chs)
                results[nodeid] = TestResult(nodeid, "crashed", elapsed, f"{summary}\n{stderr_tail[-1500:]}",
                                             summary=summary)
        remaining = [n for n in collected if n not in results and task_for(n) not in timed_out]
        if once:
            break
        if remaining and remaining == pending:
            for n in remaining:     # no progress: give up on these
                results[n] = TestResult(n, "error", 0.0, f"pytest made no progress (exit {returncode})")
            break
        pending = remaining
    for n in collected or []:
        if n not in results:
            results[n] = TestResult(n, "not run", 0.0, "its task ran out of time")
    return RunResult(results, collected or [], leaked, timed_out, processes, time.monotonic() - t0, stderr_tail)


class ZygoteClient:
    """Starts course/zygote.py and runs pytest processes forked from it (see zygote.py for why).
    Thread-safe: the proof's worker threads share one zygote. Use it as a context manager."""

    def __init__(self):
        self._lock = threading.Lock()
        self._dir = pathlib.Path(tempfile.mkdtemp(prefix="course-zygote-"))
        self._count = 0
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONHASHSEED"] = "0"          # the student's and the judge's processes: one string hash
        self._proc = subprocess.Popen([sys.executable, str(ZYGOTE)], cwd=self._dir, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

    def start(self, argv: list[str], *, cwd: pathlib.Path, env: dict[str, str],
              sandbox: dict | None = None) -> "ZygoteProcess":
        """Start `python -m pytest ARGV` in cwd with env, forked (sandboxed: zygote.py)."""
        with self._lock:
            self._count += 1
            base = self._dir / f"run{self._count}"
            # What `python -m pytest` would start with: the working directory, then PYTHONPATH.
            sys_path = [str(cwd)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            request = dict(argv=argv, cwd=str(cwd), env=env, sys_path=sys_path, out=f"{base}.out",
                           status=f"{base}.status", sandbox=sandbox)
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the grading zygote died (exit {self._proc.poll()})")
        return ZygoteProcess(json.loads(reply)["pid"], pathlib.Path(request["status"]), pathlib.Path(request["out"]))

    def run(self, argv: list[str], *, cwd: pathlib.Path, env: dict[str, str], timeout: float | None,
            sandbox: dict | None = None) -> tuple[int, str]:
        """`python -m pytest ARGV` in cwd with env, forked; its whole session killed at timeout.
        Returns (exit code, its output)."""
        proc = self.start(argv, cwd=cwd, env=env, sandbox=sandbox)
        deadline = None if timeout is None else time.monotonic() + timeout
        while proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                deadline = None                     # the zygote reaps it and writes its status
            time.sleep(0.02)
        return proc.wait()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.stdout.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "ZygoteClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ZygoteProcess:
    """A pytest process forked by the zygote: poll it, kill its whole session, collect its output."""

    def __init__(self, pid: int, status: pathlib.Path, out: pathlib.Path):
        self.pid, self.status, self.out = pid, status, out
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None and self.status.exists():
            self.code = int(self.status.read_text())
        return self.code

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self) -> tuple[int, str]:
        while self.poll() is None:
            time.sleep(0.02)
        text = self.out.read_text(errors="replace") if self.out.exists() else ""
        self.status.unlink(missing_ok=True)
        self.out.unlink(missing_ok=True)
        return self.code, text


class Workspace:
    """A temporary grading workspace for `student` (removed on exit unless keep=True)."""

    def __init__(self, student: pathlib.Path, *, markers: list[str] = (), keep: bool = False,
                 parent: pathlib.Path | None = None, overlay: dict[str, str] | None = None):
        self.student = pathlib.Path(student)
        self.markers = list(markers)
        self.keep = keep
        self.parent = parent
        self.overlay = overlay

    def __enter__(self) -> pathlib.Path:
        self.path = pathlib.Path(tempfile.mkdtemp(prefix="course-grade-", dir=self.parent))
        return make_workspace(self.student, self.path / "ws", markers=self.markers, overlay=self.overlay)

    def __exit__(self, *exc):
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)
