"""The judge (course/judge.py): a grade the student's process cannot forge.

Every test here builds chapter 02's student edition, does to it what a student who wants marks
without the work might do, grades it, and asks for a score of 0 on every task touched: the verdict
comes from the judge's process, which runs the tests on the reference with the task stubbed and
takes from the student's process only what the task's code returned and changed. The first two
forgeries are the ones a student trial found (they used to give full marks); the others are the
next ones a student would try. A control grading of the same edition with the tasks solved scores
full marks, so a 0 here is the judge refusing the forgery, not a judge that fails everything.
"""
import json
import os
import pathlib
import shutil
import tempfile
import time

import pytest

from course.build import build
from course.grade import JudgeTrees, grade_tree
from course.layout import ROOT
from course.manifest import load
from course.proof import write_solution
from course.runner import ZygoteClient

ROOT_SANDBOX = os.geteuid() == 0          # the sandbox (another user, the reference hidden) needs root


@pytest.fixture(scope="module")
def judge():
    """(chapter 02's untouched edition, grade(tree, task ids) -> {task: TaskGrade}, a folder).
    Its own temporary folder, not pytest's: the student's process (another user) must reach it,
    and pytest's are removed by other pytest runs of this user."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="course-judge-test-"))
    os.chmod(base, 0o711)
    edition = base / "ed02"
    build(["02"], edition)
    manifest = load()
    try:
        with ZygoteClient() as zygote, JudgeTrees(base, manifest) as trees:
            def grade(tree, ids, fast=False):
                grades, _ = grade_tree(tree, [manifest.by_id(t) for t in ids], zygote=zygote, judge_trees=trees,
                                       manifest=manifest, workspace_parent=base, fast=fast)
                return {g.task.id: g for g in grades}
            yield edition, grade, base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def forged(judge, name: str) -> pathlib.Path:
    edition, _, base = judge
    tree = base / name
    shutil.copytree(edition, tree, symlinks=True)
    return tree


def append(tree: pathlib.Path, rel: str, code: str) -> None:
    path = tree / rel
    path.write_text(path.read_text() + "\n" + code + "\n")


def in_region(tree: pathlib.Path, rel: str, function: str, code: str) -> None:
    """Put `code` at the start of `function`'s region (its stub stays after it)."""
    path = tree / rel
    lines = path.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith(f"def {function}("))
    begin = next(i for i in range(start, len(lines)) if lines[i].strip() == "### BEGIN SOLUTION")
    indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
    lines[begin + 1:begin + 1] = [indent + ln if ln else ln for ln in code.strip("\n").splitlines()]
    path.write_text("\n".join(lines) + "\n")


def assert_all_zero(grades, why: str = ""):
    for tid, g in grades.items():
        assert g.total > 0, tid
        passed = [r.nodeid for r in g.results if r.outcome == "passed"]
        assert g.num_passed == 0, f"{tid} forged: {passed}"
        if why:
            assert any(why in (r.summary + r.message) for r in g.results), [r.summary for r in g.results][:3]


# ------------------------------------------------------------------------- the control

def test_the_same_edition_solved_scores_full_marks(judge):
    """The judge credits real work: the tasks solved (the reference written into their regions),
    every test passes, judged."""
    _, grade, _ = judge
    tree = forged(judge, "solved")
    for tid in ("ch02_task1", "ch02_task3"):
        write_solution(tree, load().by_id(tid))
    grades = grade(tree, ["ch02_task1", "ch02_task3"])
    assert all(g.passed for g in grades.values()), {t: [r.summary for r in g.failures] for t, g in grades.items()}


def test_untouched_stubs_score_zero_with_the_stub_named(judge):
    edition, grade, _ = judge
    assert_all_zero(grade(edition, ["ch02_task1", "ch02_task3"]), why="NotImplementedError: ch02_task")


# ------------------------------------------------------------------------- what the student trial found

def test_patching_pytests_runtest_in_the_package_scores_zero(judge):
    """Four lines appended to 02_kvcache/__init__.py replace every test's body by nothing: every
    test of the student's process 'passes'. Not one does in the judge's."""
    _, grade, _ = judge
    tree = forged(judge, "runtest")
    append(tree, "02_kvcache/__init__.py", "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None")
    assert_all_zero(grade(tree, ["ch02_task1", "ch02_task3", "ch02_task6"]))


def test_a_makereport_hookwrapper_registered_from_a_region_scores_zero(judge):
    """Code inside one solution region registers a pytest_runtest_makereport hookwrapper that
    turns every report into a pass."""
    _, grade, _ = judge
    tree = forged(judge, "hookwrapper")
    in_region(tree, "02_kvcache/block_pool_v1.py", "allocate", '''
import gc
import pytest
class _AllPass:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome, report.longrepr = "passed", None
for _config in [o for o in gc.get_objects() if type(o).__name__ == "Config"]:
    if not _config.pluginmanager.has_plugin("all-pass"):
        _config.pluginmanager.register(_AllPass(), "all-pass")
''')
    assert_all_zero(grade(tree, ["ch02_task3"]))


# ------------------------------------------------------------------------- the next tries

def test_exiting_with_status_zero_at_import_scores_zero(judge):
    """os._exit(0) before a single test runs: a clean exit, no failure reported, no output."""
    _, grade, _ = judge
    tree = forged(judge, "exit0")
    append(tree, "02_kvcache/__init__.py", "import os\nos._exit(0)")
    grades = grade(tree, ["ch02_task1", "ch02_task3"])
    assert_all_zero(grades)
    for g in grades.values():
        assert all(r.outcome == "not run" and "your process" in r.summary for r in g.results), g.results[0]


def test_patched_equality_and_a_do_nothing_kernel_score_zero(judge):
    """copy_blocks / swap_blocks / the Triton kernel do nothing, and torch.equal, torch.allclose,
    torch.testing.assert_close and Tensor.__eq__ are patched to agree with anything: in one process
    every byte-for-byte comparison of ch02_task4's tests would pass."""
    _, grade, _ = judge
    tree = forged(judge, "equality")
    append(tree, "02_kvcache/__init__.py", '''
import torch
torch.equal = lambda *a, **k: True
torch.allclose = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
torch.Tensor.__eq__ = lambda self, other: torch.ones_like(self, dtype=torch.bool)
''')
    for fn in ("copy_blocks", "swap_blocks"):
        in_region(tree, "02_kvcache/reference.py", fn, "return None")
    assert_all_zero(grade(tree, ["ch02_task4"], fast=True))


def test_a_fake_pytest_and_disabled_assertions_score_zero(judge):
    """sys.modules['pytest'] replaced by a module whose raises() swallows everything, and
    AssertionError made something nobody raises."""
    _, grade, _ = judge
    tree = forged(judge, "fakepytest")
    append(tree, "02_kvcache/__init__.py", '''
import builtins, contextlib, sys, types
import pytest as _real
_fake = types.ModuleType("pytest")
_fake.__dict__.update(_real.__dict__)
_fake.raises = lambda *a, **k: contextlib.suppress(BaseException)
sys.modules["pytest"] = _fake
class _Never(Exception):
    pass
builtins.AssertionError = _Never
''')
    assert_all_zero(grade(tree, ["ch02_task1", "ch02_task3"]))


def test_writing_the_results_file_by_hand_scores_zero(judge):
    """The student's process writes 'passed' for every test into the results stream the grader
    used to read, and into the judge's log an end marker saying so, then exits."""
    _, grade, _ = judge
    tree = forged(judge, "results")
    append(tree, "02_kvcache/__init__.py", '''
import json, os
_tests = [
    "tests/02_kvcache/test_block_pool_ladder.py::test_v1_allocates_low_ids_first_and_reuses_lifo",
    "tests/02_kvcache/test_block_pool_ladder.py::test_v1_bad_frees_raise_before_changing_anything",
]
if os.environ.get("COURSE_RESULTS"):
    with open(os.environ["COURSE_RESULTS"], "a") as f:
        f.write(json.dumps({"event": "collected", "nodeids": _tests}) + "\\n")
        for t in _tests:
            f.write(json.dumps({"event": "start", "nodeid": t, "limit": 60, "t": 0}) + "\\n")
            f.write(json.dumps({"event": "done", "nodeid": t, "duration": 0.01, "outcome": "passed",
                                "message": "", "summary": ""}) + "\\n")
if os.environ.get("COURSE_JUDGE_LOG"):
    os.makedirs(os.environ["COURSE_JUDGE_LOG"], exist_ok=True)
    with open(os.path.join(os.environ["COURSE_JUDGE_LOG"], "events.jsonl"), "a") as f:
        for t in _tests:
            f.write(json.dumps({"s": t, "e": {"end": "passed", "summary": ""}}) + "\\n")
os._exit(0)
''')
    assert_all_zero(grade(tree, ["ch02_task3"]))


def test_conftest_and_sitecustomize_dropped_in_the_tree_score_zero(judge):
    """A conftest.py at the tree's root and in the chapter folder (a hook passing every report),
    and a sitecustomize.py that would patch pytest at interpreter start."""
    _, grade, _ = judge
    tree = forged(judge, "conftest")
    hook = '''
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
'''
    for where in (tree / "conftest.py", tree / "02_kvcache" / "conftest.py", tree / "tests" / "conftest_extra.py"):
        where.write_text(hook)
    (tree / "sitecustomize.py").write_text("import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n")
    (tree / "02_kvcache" / "sitecustomize.py").write_text("import _pytest.python\n"
                                                         "_pytest.python.Function.runtest = lambda self: None\n")
    assert_all_zero(grade(tree, ["ch02_task1", "ch02_task3"]))


def test_an_atexit_handler_rewriting_the_log_scores_zero(judge):
    """At exit, the student's process rewrites its judge log: every event dropped, an end marker
    'passed' for each test written instead."""
    _, grade, _ = judge
    tree = forged(judge, "atexit")
    append(tree, "02_kvcache/__init__.py", '''
import atexit, json, os
def _rewrite():
    log = os.environ.get("COURSE_JUDGE_LOG")
    if log and os.path.isdir(log):
        with open(os.path.join(log, "events.jsonl"), "w") as f:
            for t in ("tests/02_kvcache/test_block_pool_ladder.py::test_v1_allocates_low_ids_first_and_reuses_lifo",
                      "tests/02_kvcache/test_block_pool_ladder.py::test_v1_bad_frees_raise_before_changing_anything"):
                f.write(json.dumps({"s": t, "e": {"end": "passed", "summary": ""}}) + "\\n")
atexit.register(_rewrite)
''')
    assert_all_zero(grade(tree, ["ch02_task3"]))


def test_a_log_naming_the_judges_dangerous_functions_runs_nothing_and_scores_zero(judge):
    """The student's process writes its own log: each call into the task 'returned' os.system,
    builtins.eval or an object of a class that would run code when rebuilt. The judge refuses to
    rebuild any of them: nothing runs (no marker file appears) and nothing passes."""
    _, grade, base = judge
    tree = forged(judge, "evil-log")
    marker = base / "pwned"
    append(tree, "02_kvcache/__init__.py", f'''
import json, os
_log = os.environ.get("COURSE_JUDGE_LOG")
_key = "kvcache.block_pool_v1:BlockPoolV1.allocate"
_evil = [{{"g": "os:system"}}, {{"g": "builtins:eval"}}, {{"g": "subprocess:run"}}, {{"r": 999}}]
_states = {{"999": {{"k": "obj", "c": "os:_wrap_close", "d": {{}}, "s": {{}}}}}}
if _log:
    os.makedirs(_log, exist_ok=True)
    with open(os.path.join(_log, "events.jsonl"), "a") as f:
        for t in ("tests/02_kvcache/test_block_pool_ladder.py::test_v1_allocates_low_ids_first_and_reuses_lifo",
                  "tests/02_kvcache/test_block_pool_ladder.py::test_v1_bad_frees_raise_before_changing_anything"):
            for evil in _evil:
                ret = {{"t": [{{"t": []}}, {{"t": []}}, {{"t": []}}, evil, None, {{"t": []}}]}}
                f.write(json.dumps({{"s": t, "e": {{"key": _key, "pre": {{"roots": {{"t": []}}, "states": {{}}}},
                                                  "post": {{"roots": ret, "states": _states, "data": {{}}}}}}}}) + "\\n")
            _evil.append(_evil.pop(0))
''')
    grades = grade(tree, ["ch02_task3"])
    assert_all_zero(grades)
    assert not marker.exists()


def test_the_mirror_refuses_whatever_would_run_code():
    """What the judge's process rebuilds from a log: values, and instances of the chapters' (and a
    few libraries') own classes with their attributes set — never a function of os / subprocess /
    builtins' eval, never a class of another module, never an attribute that would shadow a method."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_course_judge_test", ROOT / "course" / "judge_runtime.py")
    jr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jr)
    m = jr.Mirror("/nonexistent", {"kvcache"})
    for evil in ({"g": "os:system"}, {"g": "builtins:eval"}, {"g": "builtins:__import__"}, {"g": "subprocess:run"},
                 {"g": "pickle:loads"}, {"g": "os:"}, {"g": "ctypes:CDLL"}):
        stand_in = m.decode(evil)                   # never the function: a stand-in failing whoever uses it
        assert isinstance(stand_in, jr.Placeholder), evil
        with pytest.raises(jr.JudgeError):
            stand_in("touch /tmp/pwned")
    with pytest.raises(jr.JudgeError):
        m.decode({"e": ["os:SEEK_SET", "x"]})
    m.apply({"1": {"k": "obj", "c": "os:_wrap_close", "d": {"x": 1}, "s": {}},
             "3": {"k": "obj", "c": "kvcache.block_pool:BlockPool.__init__", "d": {}, "s": {}}}, {})
    assert isinstance(m.obj_of[1], jr.Placeholder) and not isinstance(m.obj_of[3], type(lambda: 0))
    # An object of a chapter class: its data is set, a method or a property is never shadowed.
    m.apply({"2": {"k": "obj", "c": "kvcache.block_pool:BlockPool", "d": {
        "num_blocks": 3, "check_invariants": {"g": "builtins:print"}, "get_usage": 1.0, "__class__": {"g": "builtins:int"}},
        "s": {}}}, {})
    pool = m.obj_of[2]
    assert type(pool).__name__ == "BlockPool" and pool.num_blocks == 3
    assert "check_invariants" not in vars(pool) and "get_usage" not in vars(pool) and "__class__" not in vars(pool)


PEEKS = {
    "getframe": "import sys\n_seen = sys._getframe(1).f_back.f_locals",
    "inspect": "import inspect\n_seen = [f.frame.f_locals for f in inspect.stack()]",
    "traceback": "try:\n    raise ValueError\nexcept ValueError as _e:\n    _seen = _e.__traceback__.tb_frame.f_back.f_locals",
    "gc": "import gc\n_seen = gc.get_referrers(self)",
    "compiled": "import inspect\n_code = compile('import sys\\nseen = sys._getframe(2).f_locals', inspect.__file__, 'exec')\n"
                "exec(_code, {})",
}


@pytest.mark.parametrize("how", list(PEEKS))
def test_reading_the_tests_own_frames_stops_the_process_and_scores_zero(judge, how):
    """The student's process runs each test whole, its oracle too: an expected value the test made
    before calling the task's code sits in the test's frame, and code that read it there could return
    it. ch02_task1 solved, plus one look at the caller's frames in its constructor (every test makes a
    queue): directly, through inspect, a traceback, gc, or code compiled under a library's name. The
    process is stopped at the look (course/judge_peek.py) and every test fails, saying why — a solved
    task, so without the guard each would pass."""
    _, grade, _ = judge
    tree = forged(judge, f"peek-{how}")
    write_solution(tree, load().by_id("ch02_task1"))
    in_region(tree, "02_kvcache/block.py", "__init__", PEEKS[how])
    assert_all_zero(grade(tree, ["ch02_task1"], fast=True), why="stopped: your code ")


def test_libraries_that_look_at_frames_for_themselves_are_not_a_peek(judge):
    """The guard stops the student's reading of frames, not a library's: a namedtuple (which names
    its module from the caller's frame), a logger (which finds its caller), an enum, a formatted
    traceback, a warning and a matplotlib figure saved (matplotlib looks for who warned), all from
    inside the task's code, leave a solved task at full marks."""
    _, grade, _ = judge
    tree = forged(judge, "peek-libraries")
    write_solution(tree, load().by_id("ch02_task1"))
    in_region(tree, "02_kvcache/block.py", "__init__", """
import collections, enum, logging, traceback, warnings
_Pair = collections.namedtuple("_Pair", "a b")
logging.getLogger(__name__).warning("a free list of %s", type(self).__name__)
_Colour = enum.Enum("_Colour", "RED GREEN")
try:
    raise ValueError("formatted, not inspected")
except ValueError:
    _text = traceback.format_exc()
warnings.warn("a warning from the task's code")
import io
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
_fig, _ax = plt.subplots()
_ax.plot([1, 2], label="a")
_ax.legend()
_fig.savefig(io.BytesIO(), format="png")
plt.close(_fig)
""")
    grades = grade(tree, ["ch02_task1"], fast=True)
    assert all(g.passed for g in grades.values()), {t: [r.summary for r in g.failures] for t, g in grades.items()}


@pytest.mark.skipif(not ROOT_SANDBOX, reason="the sandbox needs root: without it the student's process can read "
                                            "the machine's files (the report says so)")
def test_reading_the_reference_or_the_judges_files_fails_in_the_sandbox(judge):
    """The region tries to copy the answer: read the reference from this repository, list and read
    the judge's folders, read the judge's process memory, kill the grader. In the sandbox (another
    user; the repository's folders emptied) every attempt fails, so the stub is what runs."""
    _, grade, base = judge
    tree = forged(judge, "steal")
    in_region(tree, "02_kvcache/block_pool_v1.py", "allocate", f'''
import glob, os, signal
_found = []
for _path in [{str(ROOT / "02_kvcache" / "block_pool_v1.py")!r}, *glob.glob({str(base)!r} + "/course-judge-*/*/tree/02_kvcache/*.py")]:
    try:
        _found.append(open(_path).read())
    except OSError:
        pass
for _pid in os.listdir("/proc"):
    try:
        _found.append(open(f"/proc/{{_pid}}/mem", "rb").read(1))
    except (OSError, ValueError):
        pass
try:
    os.kill(os.getppid(), signal.SIGKILL)
except OSError:
    pass
if any(isinstance(x, str) and "BEGIN SOLUTION" in x for x in _found):
    raise RuntimeError("the reference is readable from the student's process")
''')
    grades = grade(tree, ["ch02_task3"])
    assert_all_zero(grades)
    assert not any("readable" in (r.summary + r.message) for g in grades.values() for r in g.results)


# ------------------------------------------------------------------------- time limits and reports

def test_a_stubbed_property_task_fails_in_seconds_and_runs_every_test(judge):
    """ch02_task7 stubbed: its property tests stop at their first failing example (no shrinking),
    so every one of its tests runs, fails, and says why — none is left 'not run'."""
    edition, grade, _ = judge
    t0 = time.monotonic()
    g = grade(edition, ["ch02_task7"])["ch02_task7"]
    assert time.monotonic() - t0 < 120
    assert g.num_passed == 0 and not g.not_run, [(r.nodeid, r.outcome) for r in g.not_run]
    assert all("NotImplementedError: ch02_task7" in r.summary for r in g.results), [r.summary for r in g.results][:3]


def test_the_report_names_every_test_that_did_not_run_and_why(judge):
    """A student's code that hangs in the first test: that test times out (its own limit), the
    process is replaced, and the report lists what did not run with the reason."""
    edition, grade, _ = judge
    from course.grade import report_json
    from course.runner import RunResult
    tree = forged(judge, "hang")
    in_region(tree, "02_kvcache/block_pool_v1.py", "allocate", "import time\ntime.sleep(3600)")
    task = load().by_id("ch02_task3")
    task.test_timeout_s = 3                         # this grading only (the manifest is re-read each time)
    manifest = load()
    manifest.by_id("ch02_task3").test_timeout_s = 3
    grades, run = grade_tree(tree, [manifest.by_id("ch02_task3")], manifest=manifest,
                             workspace_parent=judge[2])
    g = grades[0]
    assert [r.outcome for r in g.results].count("timeout") >= 1 and g.num_passed == 0
    data = report_json(tree, grades, run, fast=False)
    not_run = data["tasks"][0]["not_run"]
    assert not_run and all(x["why"] for x in not_run)
    assert any("limit of 3 s" in x["why"] for x in not_run)
