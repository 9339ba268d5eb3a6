"""pytest plugin loaded INSIDE a grading process (copied into the grading workspace and
loaded with `-p _course_grader_plugin`); it imports nothing from the course package.

Jobs:
  * the reference solution is never imported: the editable install's finder (which maps
    `kvcache` etc. to the reference folders) is removed from sys.meta_path before any test
    module is imported, a guard refuses any module whose file lies in a reference chapter
    folder, and at the end every loaded module is audited (COURSE_REF_DIRS);
  * results stream to a JSON-lines file (COURSE_RESULTS) as tests run, so a process that
    hangs or crashes loses only the test it was in;
  * per-task time limits (COURSE_LIMITS: {test id: [task, seconds left for the task]}): a
    watchdog thread (faulthandler) ends the process when a task's time runs out inside a
    test; the parent sees which test was running and scores that task 0;
  * stand-ins (COURSE_STANDINS: [stand-in files]): while a task is graded, the pieces other
    tasks implement can be replaced by the instructor's simple stand-ins (each file defines
    apply(monkeypatch)), so that no task's grade depends on another's solution; the grader
    runs such tasks in a process of their own;
  * probes (discovery only): `_course_probe.HITS`, the regions a test ran, are recorded —
    with those its module ran while being imported and those its wider-scoped fixtures ran
    while being set up (a test that only reads a module fixture's cache still depends on the
    code that wrote it);
  * selectors (COURSE_SELECT): a manifest id `file::func[torch]` reaches pytest as `file::func`;
    collection keeps only the parametrizations it selects;
  * tests marked `gpu` are deselected on a machine without CUDA (as `make test` does): a test
    that cannot run here is no part of a grade here, rather than a skip that counts as a miss;
    likewise a test the tests' own conftest skips at collection for this machine (an instruction
    set this CPU cannot run): it reports "not_here" with the reason, and the grade leaves it out.
    Only a skip marker set at collection counts: a test that calls pytest.skip() while it runs
    (what a student's code could provoke) is still a skip, and a miss;
  * each failure's one-line summary: the exception line and where it was raised;
  * COURSE_HYPOTHESIS_SHRINK=0 (the proof, course/proof.py): a property test that fails reports
    the first example it failed on instead of shrinking it to a minimal one. Pass or fail is the
    same either way; only the failure's example differs. The proof needs only pass or fail, and
    shrinking a test that fails on every example (a stub's NotImplementedError) can take longer
    than the task's time limit.
"""
import faulthandler
import functools
import json
import os
import pathlib
import sys
import time

import pytest

try:
    from _course_testids import matches as _matches      # course/testids.py, copied beside this file
except ImportError:                                      # pragma: no cover — an old workspace
    def _matches(nodeid, test_id):
        return nodeid == test_id or nodeid.startswith(test_id + "[") or nodeid.startswith(test_id + "::")

_RESULTS = os.environ.get("COURSE_RESULTS")
_REF_DIRS = [os.path.realpath(p) for p in json.loads(os.environ.get("COURSE_REF_DIRS", "[]"))]
_LIMITS = json.loads(os.environ.get("COURSE_LIMITS", "{}"))
_STANDINS = json.loads(os.environ.get("COURSE_STANDINS", "[]"))   # stand-in files for this whole process
_standin_patch = pytest.MonkeyPatch()
_TEST_LIMIT = float(os.environ.get("COURSE_TEST_LIMIT", "0"))   # tests of no task (discovery), or the judge's default
_TEST_LIMITS = json.loads(os.environ.get("COURSE_TEST_LIMITS", "{}"))   # {test id: seconds}: per-test limits (the judge)
_UNIVERSE = json.loads(os.environ.get("COURSE_UNIVERSE", "null"))    # the judge: every test of the task, reported once
_SELECT = json.loads(os.environ.get("COURSE_SELECT", "null"))   # manifest test ids to narrow collection to
_stream = open(_RESULTS, "a", buffering=1) if _RESULTS else None
_outcomes: dict = {}
_spent: dict = {}
_started: dict = {}
_module_hits: dict = {}          # module node id -> regions run while it was imported
_fixture_hits: dict = {}         # fixture name -> regions run while it was set up (scope wider than a test)
_fixtures_of: dict = {}          # test node id -> its fixture names


def _emit(**event):
    if _stream is not None:
        _stream.write(json.dumps(event) + "\n")
        _stream.flush()
        os.fsync(_stream.fileno())


def _in_reference(path) -> bool:
    """Is `path` inside a reference folder? Called for every import and, at the end, for every
    loaded module (~1,700): string prefixes of real paths, each folder resolved once, not pathlib's
    `parents` (which made the end-of-session audit alone cost ~1 s a grading process)."""
    if not path or not _REF_DIRS:
        return False
    path = str(path)
    p = os.path.realpath(path) if os.path.islink(path) else os.path.join(_real_dir(os.path.dirname(path)),
                                                                           os.path.basename(path))
    return any(p == d or p.startswith(d + os.sep) for d in _REF_DIRS)


@functools.lru_cache(maxsize=None)
def _real_dir(folder: str) -> str:
    return os.path.realpath(folder)


def _refuse_reference(fullname, spec):
    if _in_reference(spec.origin):
        raise ImportError(f"grading must not import the reference solution: {fullname} -> {spec.origin}")


class _ReferenceGuard:
    """A meta-path finder placed first: asks the other finders, refuses reference files."""
    _course_delegating = True

    def find_spec(self, fullname, path=None, target=None):
        for finder in sys.meta_path:
            if getattr(finder, "_course_delegating", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                _refuse_reference(fullname, spec)
                return spec
        return None


def _install_guard():
    sys.meta_path[:] = [f for f in sys.meta_path
                        if "__editable__" not in (getattr(f, "__module__", "") or "")
                        and "__editable__" not in getattr(f, "__name__", "")]
    if _REF_DIRS:
        sys.meta_path.insert(0, _ReferenceGuard())


_install_guard()


def _no_shrinking():
    """Hypothesis without its shrink phase (and explain, which follows it), for every test of this
    process: loaded before any test module is imported, so each `@settings(...)` inherits it."""
    try:
        from hypothesis import Phase, settings
    except ImportError:             # pragma: no cover — no property test can run then either
        return
    settings.register_profile("course-no-shrink",
                              phases=[p for p in Phase if p not in (Phase.shrink, Phase.explain)])
    settings.load_profile("course-no-shrink")


if os.environ.get("COURSE_HYPOTHESIS_SHRINK") == "0":
    _no_shrinking()


# ------------------------------------------------------------------ the judge (course/judge.py)
def _peek_guard():
    """The student's process: stop it if its code reads the test's frames (course/judge_peek.py).
    The grader's code is the tests, the grader's files in the workspace (its root is sticky: the
    student's process cannot replace them) and the zygote that forked this process."""
    import _course_judge_peek as peek
    ws = os.environ.get("COURSE_JUDGE_WORKSPACE", os.getcwd())
    files = [os.path.join(ws, n) for n in ("_course_grader_plugin.py", "_course_judge.py", "_course_judge_peek.py",
                                            "_course_testids.py", "sitecustomize.py")]
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main and os.path.basename(main) == "zygote.py":
        files.append(main)
    trusted = [_judge.TESTS_DIR] + files
    trusted = sorted({p for t in trusted for p in (t, os.path.realpath(t) + (os.sep if t.endswith(os.sep) else ""))})
    peek.install(trusted, peek.library_prefixes(), os.path.join(os.environ["COURSE_JUDGE_LOG"], "peek.txt"))



# COURSE_JUDGE_MODE=record: this is the student's process, its boundary calls are logged and
# nothing it reports is believed; =replay: this is the judge's process (the reference, the task
# stubbed), its boundary calls are answered from that log and its outcomes are the grade.
_JUDGE_MODE = os.environ.get("COURSE_JUDGE_MODE", "")
_judge = None
if _JUDGE_MODE:
    import _course_judge as _judge
    _judge.SPEC_CHECK = _refuse_reference if _REF_DIRS else None
    _judge.early()
    if _JUDGE_MODE == "record":
        _judge.RUNTIME.start_record(os.environ["COURSE_JUDGE_LOG"])
        _peek_guard()
    else:
        _judge.RUNTIME.start_replay(os.environ["COURSE_JUDGE_LOG"],
                                    set(json.loads(os.environ.get("COURSE_JUDGE_PACKAGES", "[]"))))
_JUDGE_SEED = int(os.environ.get("COURSE_JUDGE_SEED", "0") or 0)


def _judge_profile():
    """Both processes generate the same examples in the same order (the seed is passed on the
    command line, --hypothesis-seed), stop at the first failing one (no shrinking, which would
    follow the student's process's own verdicts) and never fail on timing or health checks."""
    try:
        from hypothesis import HealthCheck, Phase, settings
    except ImportError:             # pragma: no cover
        return
    settings.register_profile("course-judge", database=None, deadline=None, print_blob=False,
                              suppress_health_check=list(HealthCheck),
                              phases=[p for p in Phase if p not in (Phase.shrink, Phase.explain)])
    settings.load_profile("course-judge")
    # Hypothesis also draws constants it finds in the source of the modules loaded ("local
    # constants"): the two processes load different code (the student's, the stubbed reference),
    # so that pool would make them generate different examples. None in either.
    try:
        from hypothesis.internal.conjecture import providers
        empty = providers.Constants()
        providers._get_local_constants = lambda: empty
    except (ImportError, AttributeError):      # pragma: no cover — another Hypothesis
        pass


if _JUDGE_MODE:
    _judge_profile()


def _seed_for(nodeid: str) -> int:
    import zlib
    return zlib.crc32(f"{_JUDGE_SEED}:{nodeid}".encode()) & 0x7FFFFFFF


def _judge_test_start(nodeid: str) -> None:
    """The same start in both processes: the same seeds, uuids from a seeded generator, and no
    object known yet (each side forgets the last test's)."""
    import random
    import uuid
    seed = _seed_for(nodeid)
    _judge.RUNTIME.set_phase(nodeid)
    _judge.RUNTIME.reset()
    _judge.seed_everything(seed)
    rng = random.Random(seed)
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if _judge is None:
        yield
        return
    _judge_test_start(item.nodeid)
    yield
    if _JUDGE_MODE == "record":
        state = _judge_outcomes.pop(item.nodeid, ("passed", ""))
        _judge.RUNTIME.end(item.nodeid, *state)
    _judge.RUNTIME.set_phase("between")


_judge_outcomes: dict = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if _JUDGE_MODE == "replay" and call.excinfo is not None:
        where = getattr(call.excinfo.value, "_course_where", None)
        if where:
            outcome.get_result().user_properties.append(("course_where", where))


def _task_of(nodeid):
    for test_id, value in _LIMITS.items():
        if _matches(nodeid, test_id):
            return value
    return None


def _probe():
    return sys.modules.get("_course_probe")


_PROBE_FILE = None
if os.environ.get("COURSE_PROBE"):          # discovery: record from the first import on
    import _course_probe  # noqa: F401
    _PROBE_FILE = pathlib.Path.cwd() / f".probe.{os.getpid()}"
    os.environ["COURSE_PROBE_FILE"] = str(_PROBE_FILE)      # what the test's subprocesses run
    os.environ["COURSE_PROBE_PID"] = str(os.getpid())


def _subprocess_hits():
    if _PROBE_FILE is None or not _PROBE_FILE.exists():
        return set()
    found = set(_PROBE_FILE.read_text().split())
    _PROBE_FILE.unlink()
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    if _judge is not None and isinstance(collector, pytest.Module):
        _judge.RUNTIME.set_phase("collect:" + collector.nodeid)
        yield
        _judge.RUNTIME.set_phase("between")
        return
    probe = _probe()
    if probe is None or not isinstance(collector, pytest.Module):
        yield
        return
    saved = set(probe.HITS)
    probe.HITS.clear()
    yield
    _module_hits[collector.nodeid] = sorted(probe.HITS)
    probe.HITS |= saved


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    probe = _probe()
    if probe is None or fixturedef.scope == "function":
        yield
        return
    saved = set(probe.HITS)
    probe.HITS.clear()
    yield
    _fixture_hits[fixturedef.argname] = sorted(set(_fixture_hits.get(fixturedef.argname, [])) | probe.HITS)
    probe.HITS |= saved


_marks_of: dict = {}             # test node id -> its marker names (discovery: `slow`, `model` stay out of grades)


def pytest_runtest_setup(item):
    if _probe() is not None:
        _fixtures_of[item.nodeid] = list(getattr(item, "fixturenames", []))
        _marks_of[item.nodeid] = sorted({m.name for m in item.iter_markers()})


def _runnable_here(item) -> bool:
    """False for a `gpu` test on a machine without CUDA."""
    if item.get_closest_marker("gpu") is None:
        return True
    import torch
    return torch.cuda.is_available()


_not_here: dict = {}             # test node id -> why this machine cannot run it (a collection-time skip marker)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Selectors (`file::func[torch]`) reached pytest as their function: keep only the
    parametrizations they select (course/runner.py: pytest_args), and only what can run here.
    Last of the hooks, so the tests' conftests have marked what this machine cannot run."""
    for item in items:
        marker = item.get_closest_marker("skip")
        if marker is not None:
            _not_here[item.nodeid] = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
    if _UNIVERSE is not None:
        _emit(event="universe", nodeids=[item.nodeid for item in items
                                         if any(_matches(item.nodeid, s) for s in _UNIVERSE) and _runnable_here(item)],
              not_here={k: v for k, v in _not_here.items()})
    keep, drop = [], []
    for item in items:
        selected = _SELECT is None or any(_matches(item.nodeid, s) for s in _SELECT)
        (keep if selected and _runnable_here(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    _emit(event="collected", nodeids=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid, location):
    entry = _task_of(nodeid)
    limit = None
    per_test = next((s for t, s in _TEST_LIMITS.items() if _matches(nodeid, t)), None)
    if per_test is not None:
        limit = float(per_test)
        faulthandler.dump_traceback_later(limit, exit=True)
    elif entry is not None:
        task, seconds = entry
        limit = max(0.5, seconds - _spent.get(task, 0.0))
        faulthandler.dump_traceback_later(limit, exit=True)
    elif _TEST_LIMIT > 0:
        limit = _TEST_LIMIT
        faulthandler.dump_traceback_later(limit, exit=True)
    _started[nodeid] = time.monotonic()
    probe = sys.modules.get("_course_probe")
    if probe is not None:
        probe.HITS.clear()
        _subprocess_hits()
    _emit(event="start", nodeid=nodeid, limit=limit, t=time.time())


def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    state = _outcomes.setdefault(nodeid, {"outcome": "passed", "message": "", "summary": ""})
    if _JUDGE_MODE == "replay" and report.when == "teardown" and state["outcome"] == "passed":
        left = _judge.RUNTIME.pending(nodeid)
        if left:
            end = _judge.RUNTIME.ends.get(nodeid, {})
            state["outcome"] = "failed"
            state["summary"] = (f"JudgeError: your process made {left} more call(s) of the task's code in this test "
                                "than the judge's test did: the test ran differently in your process"
                                + (f" (it reported: {end.get('end')}: {end.get('summary', '')})" if end else ""))[:400]
            state["message"] = state["summary"]
    if _JUDGE_MODE == "record" and report.failed:
        _judge_outcomes[nodeid] = ("failed", str(getattr(report.longrepr, "reprcrash", "") or "")[:300])
    if report.failed:
        if state["outcome"] != "failed":
            state["outcome"] = "failed" if report.when == "call" else "error"
            text = str(report.longrepr) if report.longrepr is not None else ""
            lines = [ln for ln in text.splitlines() if ln.strip()]
            state["message"] = "\n".join(lines[-6:])[-1500:]
            state["summary"] = _summary(report, lines)
    elif report.skipped and state["outcome"] == "passed":
        state["outcome"] = "not_here" if nodeid in _not_here else "skipped"
        state["message"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""


def _shown_path(path):
    """A path as the student knows it: '02_kvcache/block.py', 'tests/02_kvcache/test_x.py'."""
    p = pathlib.Path(path)
    try:
        parts = p.relative_to(pathlib.Path.cwd()).parts
    except ValueError:
        return p.name
    if len(parts) > 1 and parts[0] == "_import":
        parts = (pathlib.Path(os.path.realpath(pathlib.Path("_import", parts[1]))).name,) + parts[2:]
    return "/".join(parts)


def _summary(report, lines):
    """'AssertionError: assert 3 == 4 (tests/x.py:12)': the exception's first line, where raised."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        first = (crash.message or "").strip().splitlines()
        where = f" ({_shown_path(crash.path)}:{crash.lineno})" if crash.path else ""
        if crash.path and os.path.basename(str(crash.path)) == "_course_judge.py":
            # Raised by the judge's replay: the student's code raised it (the log says where), or
            # the replay itself stopped (its message says why: no place in the judge's code to show).
            raised = dict(getattr(report, "user_properties", []) or []).get("course_where")
            where = f" (raised in your code: {raised})" if raised else ""
            if first and first[0].startswith("_course_judge.JudgeError: "):
                first[0] = "JudgeError: " + first[0].removeprefix("_course_judge.JudgeError: ")
        if first:
            return (first[0][:300] + where)[:400]
    e_lines = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    return (e_lines[0] if e_lines else (lines[-1] if lines else ""))[:400]


def pytest_runtest_logfinish(nodeid, location):
    faulthandler.cancel_dump_traceback_later()
    elapsed = time.monotonic() - _started.pop(nodeid, time.monotonic())
    entry = _task_of(nodeid)
    if entry is not None:
        _spent[entry[0]] = _spent.get(entry[0], 0.0) + elapsed
    state = _outcomes.pop(nodeid, {"outcome": "error", "message": "no report", "summary": "no report"})
    probe = _probe()
    hits = None
    if probe is not None:
        found = set(probe.HITS) | _subprocess_hits()
        found.update(_module_hits.get(nodeid.split("::")[0], []))
        for name in _fixtures_of.pop(nodeid, []):
            found.update(_fixture_hits.get(name, []))
        hits = sorted(found)
    extra = {"marks": _marks_of.pop(nodeid, [])} if probe is not None else {}
    _emit(event="done", nodeid=nodeid, duration=round(elapsed, 3), hits=hits, **state, **extra)


def pytest_sessionfinish(session, exitstatus):
    leaked = sorted(name for name, module in list(sys.modules.items())
                    if _in_reference(getattr(module, "__file__", None)))
    _emit(event="finished", exitstatus=int(exitstatus), reference_modules=leaked)



def pytest_sessionstart(session):
    """Stand-ins apply to the whole process (the grader runs the tasks that use them in a
    process of their own), before any test module is imported or fixture is built."""
    import importlib.util
    for i, path in enumerate(_STANDINS):
        spec = importlib.util.spec_from_file_location(f"_course_standin_{i}", pathlib.Path(session.config.rootpath) / path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.apply(_standin_patch)
