"""course build / grade: the student editions (what is solved, assigned, stripped; its own
project files; local tests that import the student's code), the isolated grading process, its
report and feedback, time limits, crashes, and that grading never reaches the reference."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from course import regions as R
from course.build import build, edition, remove_tests
from course.grade import fill_overlay, grade_tree, main as grade_main, report_json
from course.layout import ROOT
from course.leaks import leaks, normalise
from course.manifest import load
from course.notebooks import strip_notebook
from course.proof import check_student_edition, write_solution
from course.runner import crash_summary, make_workspace, run_tests
from course.layout import chapters


@pytest.fixture(scope="module")
def student_03(tmp_path_factory):
    out = tmp_path_factory.mktemp("student") / "ed"
    build(["03"], out)
    return out


def test_student_edition_of_a_chapter(student_03):
    manifest = load()
    tasks = manifest.of_chapter("03_scheduler")
    text = (student_03 / "03_scheduler" / "scheduler.py").read_text()
    assert text.count("raise NotImplementedError(") == len([k for t in tasks for k in t.regions if "scheduler.py" in k])
    assert "### BEGIN SOLUTION" in text                                   # markers kept: where to write
    assert "kv_cache_manager.allocate_slots" not in "".join(R.bodies(text, "03_scheduler/scheduler.py")
                                                             ["03_scheduler/scheduler.py::Scheduler._schedule_running"])
    # earlier chapters are handed out solved, later ones stripped too (not assigned)
    assert "raise NotImplementedError(" not in (student_03 / "02_kvcache" / "block_pool.py").read_text()
    later = manifest.of_chapter("05_chunked_prefill")[0]
    path = later.regions[0].split("::")[0]
    assert f"raise NotImplementedError(\"{later.id}" in (student_03 / path).read_text()
    info = json.loads((student_03 / "course_build.json").read_text())
    assert info["assigned"] == [t.id for t in tasks] and "ch02_task1" in info["solved"] and later.id in info["later"]
    assignment = (student_03 / "03_scheduler" / "ASSIGNMENT.md").read_text()
    for t in tasks:
        assert f"### {t.id} — {t.title}" in assignment
    assert "Given solved: 01_paged_attention, 02_kvcache." in assignment and "05_chunked_prefill" in assignment
    assert "every other chapter's code is complete" not in assignment
    assert "What the reference achieves" in assignment and "python -m benchmarks.sim_batching" in assignment
    tables = json.loads((student_03 / "course_tasks.json").read_text())
    assert set(tables["tasks"]) == {t.id for t in tasks} and tables["packages"]["kvcache"] == "02_kvcache"
    assert all(f'"{t.id}:' in (student_03 / "pyproject.toml").read_text() for t in tasks)   # registered markers
    assert '"course"' not in (student_03 / "pyproject.toml").read_text()
    assert not (student_03 / "course").exists() and not (student_03 / "tests" / "course").exists()
    assert not (student_03 / ".git").exists()


def test_the_student_edition_is_its_own_project(student_03):
    """Its own Makefile and README (not the instructor's, whose `make grade` cannot run there)."""
    makefile = (student_03 / "Makefile").read_text()
    for target in ("setup:", "test-task:", "grade:", "test:"):
        assert f"\n{target}" in makefile
    assert "course grade" not in makefile and "assignments:" not in makefile
    assert "hidden tests" in makefile                     # what the instructor's grading adds
    readme = (student_03 / "README.md").read_text()
    assert "student edition" in readme and "make test-task T=ch02_task1" in readme
    assert "How you are graded" in readme and "ch03_task1" in readme
    assert (student_03 / "conftest.py").exists()
    assert not (student_03 / "tests" / "test_repository.py").exists()


def test_editions(tmp_path):
    m = load()
    assigned, solved, later = edition(m, [])
    assert len(assigned) == len(m.tasks) and not solved and not later
    assigned, solved, later = edition(m, ["02"])
    assert {t.chapter for t in assigned} == {"02_kvcache"} and {t.chapter for t in solved} == {"01_paged_attention"}
    assert {"kernels_cuda", "03_scheduler", "07_mini_vllm"} <= {t.chapter for t in later}
    assigned, solved, later = edition(m, ["cuda"])
    assert {t.chapter for t in assigned} == {"kernels_cuda"}
    assert "kernels_cpu" in {t.chapter for t in later} and "07_mini_vllm" in {t.chapter for t in solved}


def test_student_edition_imports_and_is_clean(student_03):
    assert check_student_edition(student_03) == []


def _local_pytest(tree, task):
    """`pytest -m <task>` in the student tree with THIS interpreter, where the repository's
    editable install is active (what a student next to an instructor checkout has)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", task],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_local_tests_test_the_students_code(tmp_path):
    """Stubbed: the task's local tests fail; the reference written in: they pass; a bug in it:
    they fail again — never the instructor's copy, although it is installed (editable) here."""
    import kvcache
    assert pathlib.Path(kvcache.__file__).resolve().is_relative_to(ROOT)      # the trap is set
    tree = tmp_path / "ed"
    build(["02"], tree)
    task = load().by_id("ch02_task1")
    rc, out = _local_pytest(tree, task.id)
    assert rc != 0 and "NotImplementedError: ch02_task1" in out and "tasks: public tests passed" in out
    write_solution(tree, task)
    rc, out = _local_pytest(tree, task.id)
    assert rc == 0, out[-3000:]
    block = tree / "02_kvcache" / "block.py"
    text = block.read_text()
    broken = text.replace("block = self.fake_free_list_head.next_free_block",
                          "block = self.fake_free_list_tail.prev_free_block")        # pops the tail: LIFO
    assert broken != text
    block.write_text(broken)
    rc, out = _local_pytest(tree, task.id)
    assert rc != 0 and "FAIL" in out, out[-3000:]


def test_no_solution_left_in_the_full_edition(tmp_path):
    """Every stripped region's body (normalised) is gone from every file of the edition, and
    every known sibling (a copy of a task's code elsewhere) is stubbed too."""
    tree = tmp_path / "full"
    info = build([], tree)
    assert leaks(tree, load(), info["stripped"]) == []
    # the check itself finds a copy, however it is indented or commented
    key = "02_kvcache/block.py::FreeKVCacheBlockQueue.popleft"
    body = R.bodies((ROOT / "02_kvcache/block.py").read_text(), "02_kvcache/block.py")[key]
    copy = "def my_pop(self):   # a 'helper' left in a later chapter\n" + "\n".join("  " + ln.strip() for ln in body)
    (tree / "07_mini_vllm" / "helper.py").write_text(copy)
    assert any("07_mini_vllm/helper.py holds the solution of ch02_task1" in x for x in leaks(tree, load(), info["stripped"]))
    assert normalise("x = f(a,  b)  # note") == normalise("x=f(a,b)")


def test_a_per_chapter_edition_hands_out_no_later_solution(tmp_path):
    tree = tmp_path / "ed02"
    info = build(["02"], tree)
    assert leaks(tree, load(), info["stripped"]) == []
    assert set(info["stripped"]) >= {t.id for t in load().tasks if t.chapter in ("06_global_prefix_cache", "kernels_cuda")}


def test_grading_fills_in_the_tasks_a_task_builds_on_never_its_own(tmp_path):
    tree = tmp_path / "full"
    build([], tree)
    m = load()
    task = m.by_id("ch02_task1")
    overlay, notes = fill_overlay(tree, m.builds_on(task))
    assert not notes and overlay
    assert {p.split("/")[0] for p in overlay} == {"01_paged_attention"}
    for rel, text in overlay.items():
        assert "NotImplementedError(\"ch01_" not in text
    assert not any(rel.startswith("02_kvcache/") for rel in overlay)


def test_hidden_tests_are_cut_out_of_their_file():
    text = '''import pytest


def helper():
    return 1


@pytest.mark.parametrize("x", [1, 2])
def test_public(x):
    assert helper() == 1


@pytest.mark.slow
@pytest.mark.parametrize("x", [1])
def test_hidden(x):
    assert x


class TestGroup:
    def test_a(self):
        pass

    def test_b(self):
        pass
'''
    out = remove_tests(text, ["test_hidden", "TestGroup::test_b"])
    assert "def test_hidden" not in out and "mark.slow" not in out and "def test_b" not in out
    assert "def test_public" in out and "def test_a" in out and "def helper" in out
    compile(out, "t.py", "exec")


def test_notebooks_lose_outputs_and_solution_cells():
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# intro"),
                nbformat.v4.new_code_cell("x = 1\nx", outputs=[nbformat.v4.new_output("execute_result", {"text/plain": "1"}, execution_count=1)], execution_count=1),
                nbformat.v4.new_code_cell("secret = 42", metadata={"tags": ["solution"]}),
                nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION\n"),
                nbformat.v4.new_markdown_cell("the answer is 42", metadata={"nbgrader": {"solution": True}})]
    out = nbformat.reads(strip_notebook(nbformat.writes(nb)), as_version=4)
    assert out.cells[0].source == "# intro"
    assert out.cells[1].outputs == [] and out.cells[1].execution_count is None and out.cells[1].source == "x = 1\nx"
    assert "42" not in out.cells[2].source and "NotImplementedError" in out.cells[2].source
    assert "return 42" not in out.cells[3].source and "raise NotImplementedError()" in out.cells[3].source
    assert "42" not in out.cells[4].source


def test_grading_the_stripped_chapter_fails_every_task_and_reports_json(student_03, tmp_path, capsys):
    report = tmp_path / "report.json"
    rc = grade_main(str(student_03), chapters=None, task_ids=None, fast=True, json_path=str(report))
    assert rc == 1
    data = json.loads(report.read_text())
    assert set(data) >= {"student", "mode", "passed", "num_tasks", "num_passed", "score", "tasks",
                         "reference_modules_imported", "wall_s", "optional"}
    assert data["mode"] == "fast" and data["passed"] is False and data["num_passed"] == 0
    assert data["reference_modules_imported"] == []
    assert [t["id"] for t in data["tasks"]] == [t.id for t in load().of_chapter("03_scheduler")]
    for t in data["tasks"]:
        assert t["status"] == "FAIL" and t["score"] < 1 and t["tests_total"] >= 1 and t["seconds"] > 0
        assert set(t["tests"][0]) == {"nodeid", "outcome", "duration", "summary", "message"}
        assert any(x["summary"].startswith(f"NotImplementedError: {t['id']}") for x in t["tests"])
    out = capsys.readouterr().out
    assert "tasks passed" in out and "What failed" in out
    first = data["tasks"][0]["tests"][0]
    assert f"{first['nodeid']}: failed — NotImplementedError: {data['tasks'][0]['id']}" in out.replace("\n", "")
    title = load().by_id("ch03_task3").title                   # full titles: nothing cut at 60 characters
    assert title.split()[-1] in out


def test_grading_the_reference_itself(capsys, tmp_path):
    """`make grade STUDENT=.`: the instructor checks the reference; every task passes, its full
    test set (ch01_task5's has selectors such as `func[torch]`: each selects its parametrizations)."""
    tasks = ["ch03_task1", "ch02_task1", "ch01_task5"]
    assert any("[" in x for x in load().by_id("ch01_task5").tests)
    rc = grade_main(str(ROOT), chapters=None, task_ids=tasks, fast=False, json_path=str(tmp_path / "r.json"))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "grading the reference solution" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["num_passed"] == 3
    task5 = next(t for t in data["tasks"] if t["id"] == "ch01_task5")
    assert not any(x["outcome"] == "missing" for x in task5["tests"])
    assert task5["tests_total"] > len(load().by_id("ch01_task5").tests)      # parametrizations, each a test


# ---------------------------------------------------------------- the grading process itself

FAKE_TESTS = {
    "test_fake.py": '''import os, time, pathlib

def test_ok():
    assert 1 + 1 == 2

def test_hangs():
    time.sleep(600)

def test_after_the_hang_same_task():
    pass

def test_crashes():
    os.abort()

def test_after_the_crash():
    pass

def test_where_kvcache_comes_from():
    import kvcache
    pathlib.Path(os.environ["WHERE_FILE"]).write_text(str(pathlib.Path(kvcache.__file__).resolve()))

def test_segfault_in_student_code():
    from kvcache.crash_helper import read_address
    read_address(8)
''',
    "test_fake_property.py": '''import os

from hypothesis import given, settings, strategies as st


@settings(max_examples=20, deadline=None, database=None)
@given(st.lists(st.integers(), min_size=5))
def test_a_stub_fails_every_example(xs):
    with open(os.environ["CALLS_FILE"], "a") as f:
        f.write("call\\n")
    raise NotImplementedError("a stub")
''',
}

CRASH_HELPER = '''import ctypes


def read_address(address):
    return ctypes.c_int.from_address(address).value
'''


def fake_workspace(tmp_path, student):
    tests = tmp_path / "fake_tests"
    tests.mkdir()
    for name, text in FAKE_TESTS.items():
        (tests / name).write_text(text)
    return make_workspace(student, tmp_path / "ws", tests_src=tests)


def minimal_student(tmp_path, chapters=("01_paged_attention", "02_kvcache")):   # 02 imports 01 (cdiv)
    student = tmp_path / "student"
    for ch in chapters:
        (student / ch).mkdir(parents=True)
        for p in (ROOT / ch).glob("*.py"):
            (student / ch / p.name).write_text(p.read_text())
    if "02_kvcache" in chapters:
        (student / "02_kvcache" / "crash_helper.py").write_text(CRASH_HELPER)
    return student


def test_a_hanging_task_is_killed_at_its_limit_and_scores_zero_the_rest_still_runs(tmp_path):
    student = minimal_student(tmp_path)
    ws = fake_workspace(tmp_path, student)
    limits = {"tests/test_fake.py::test_hangs": ("tX", 3.0),
              "tests/test_fake.py::test_after_the_hang_same_task": ("tX", 3.0),
              "tests/test_fake.py::test_ok": ("tY", 30.0),
              "tests/test_fake.py::test_crashes": ("tZ", 30.0),
              "tests/test_fake.py::test_after_the_crash": ("tZ", 30.0)}
    run = run_tests(ws, list(limits), task_limits=limits, student=student, extra_env={"WHERE_FILE": str(tmp_path / "w")})
    r = run.results
    assert r["tests/test_fake.py::test_hangs"].outcome == "timeout"
    assert run.timed_out_tasks == {"tX"}
    assert r["tests/test_fake.py::test_ok"].outcome == "passed"
    assert r["tests/test_fake.py::test_crashes"].outcome == "crashed"
    assert r["tests/test_fake.py::test_after_the_crash"].outcome == "passed"      # restarted after the crash
    assert r["tests/test_fake.py::test_after_the_hang_same_task"].outcome in ("not run", "passed")
    assert run.wall_s < 120 and run.processes >= 3


def test_without_shrinking_a_failing_property_test_still_fails_and_stops_sooner(tmp_path):
    """COURSE_HYPOTHESIS_SHRINK=0 (what the proof grades with): the same outcome, without the
    shrinking that a test failing on every example would otherwise go through."""
    student = minimal_student(tmp_path)
    ws = fake_workspace(tmp_path, student)
    test = "tests/test_fake_property.py::test_a_stub_fails_every_example"
    calls = {}
    for shrink in ("1", "0"):
        calls_file = tmp_path / f"calls-{shrink}"
        run = run_tests(ws, [test], student=student,
                        extra_env={"CALLS_FILE": str(calls_file), "COURSE_HYPOTHESIS_SHRINK": shrink})
        assert run.results[test].outcome == "failed" and "NotImplementedError" in run.results[test].summary
        calls[shrink] = len(calls_file.read_text().split())
    assert calls["0"] <= 3 < calls["1"], calls          # the failing example and its replay; shrinking: many more


def test_grading_imports_the_student_tree_never_the_reference(tmp_path):
    student = minimal_student(tmp_path)
    ws = fake_workspace(tmp_path, student)
    where = tmp_path / "where"
    run = run_tests(ws, ["tests/test_fake.py::test_where_kvcache_comes_from"], student=student,
                    extra_env={"WHERE_FILE": str(where)})
    assert run.results["tests/test_fake.py::test_where_kvcache_comes_from"].outcome == "passed"
    assert pathlib.Path(where.read_text()).is_relative_to(student.resolve())
    assert run.reference_modules == []


def test_a_package_missing_from_the_student_tree_does_not_fall_back_to_the_reference(tmp_path):
    student = minimal_student(tmp_path, chapters=("01_paged_attention",))      # no 02_kvcache
    ws = fake_workspace(tmp_path, student)
    run = run_tests(ws, ["tests/test_fake.py::test_where_kvcache_comes_from"], student=student,
                    extra_env={"WHERE_FILE": str(tmp_path / "where")})
    result = run.results["tests/test_fake.py::test_where_kvcache_comes_from"]
    assert result.outcome == "failed" and ("ModuleNotFoundError" in result.message or "ImportError" in result.message)
    assert not (tmp_path / "where").exists()


def test_a_crash_names_the_signal_the_test_and_the_students_code(tmp_path):
    student = minimal_student(tmp_path)
    ws = fake_workspace(tmp_path, student)
    test = "tests/test_fake.py::test_segfault_in_student_code"
    run = run_tests(ws, [test], student=student)
    result = run.results[test]
    assert result.outcome == "crashed"
    assert result.summary.startswith(f"your code crashed the test process (signal 11, SIGSEGV) in test {test}"), result.summary
    assert "at 02_kvcache/crash_helper.py:5 in read_address" in result.summary, result.message


def test_a_cpp_terminate_is_reported_with_the_exception():
    output = """terminate called after throwing an instance of 'cuda_task1_NotImplementedError'
Fatal Python error: Aborted

Thread 0x00007f (most recent call first):
  File "/tmp/ws/_import/kvcache/ops.py", line 40 in copy_blocks
  File "/tmp/ws/tests/02_kvcache/test_x.py", line 9 in test_copy
"""
    line = crash_summary("tests/02_kvcache/test_x.py::test_copy", -6, output, pathlib.Path("/tmp/ws"), chapters())
    assert line == ("your code crashed the test process (signal 6, SIGABRT) in test tests/02_kvcache/test_x.py::test_copy, "
                    "at 02_kvcache/ops.py:40 in copy_blocks; C++ threw cuda_task1_NotImplementedError")


# ---------------------------------------------------------------- what a build ships, and where

def test_an_edition_is_built_from_tracked_files_only(tmp_path):
    """An untracked file — a report a grading left, a `.orig` with reference code, a scratch copy
    — is never shipped: the build takes what `git ls-files` lists."""
    scratch = ROOT / "02_kvcache" / f"_course_test_scratch_{os.getpid()}.orig"
    report = ROOT / f"grade_report_course_test_{os.getpid()}.json"
    scratch.write_text("def popleft(self):\n    return self.head   # a solution, copied aside\n")
    report.write_text('{"tests": ["tests/course/tasks/hidden_test_id"]}\n')
    try:
        tree = tmp_path / "ed02"
        info = build(["02"], tree)
    finally:
        scratch.unlink()
        report.unlink()
    assert not (tree / "02_kvcache" / scratch.name).exists() and not (tree / report.name).exists()
    assert (tree / "02_kvcache" / "block_pool.py").exists()
    assert "02_kvcache/block_pool.py" in info["files"] and not any(scratch.name in f for f in info["files"])


def test_editions_have_folders_of_their_own_and_a_build_never_overwrites_changes(tmp_path):
    from course.build import changes_since_build, default_out
    assert default_out([]) == ROOT / "build" / "student"
    assert default_out(["02"]) == ROOT / "build" / "student-ch02"
    assert default_out(["02", "cuda"]) == ROOT / "build" / "student-ch02-cuda"
    tree = tmp_path / "student"
    build(["03"], tree)
    assert changes_since_build(tree) == []
    build(["03"], tree)                                   # the same edition, untouched: rebuilt
    # another edition into the same folder: refused, the folder is left as it was
    with pytest.raises(SystemExit, match="holds the edition of 03_scheduler, not this one"):
        build(["02"], tree)
    assert json.loads((tree / "course_build.json").read_text())["chapters"] == ["03_scheduler"]
    # a student's work in it: refused, however small
    work = tree / "03_scheduler" / "request_queue.py"
    work.write_text(work.read_text() + "\n# my solution\n")
    (tree / "notes.txt").write_text("mine")
    (tree / ".venv").mkdir()                              # a virtual environment is no change
    (tree / ".venv" / "x").write_text("")
    with pytest.raises(SystemExit, match="request_queue.py \\(changed\\)"):
        build(["03"], tree)
    assert "# my solution" in work.read_text() and (tree / "notes.txt").exists()
    assert sorted(changes_since_build(tree)) == ["03_scheduler/request_queue.py (changed)", "notes.txt (added)"]
    build(["03"], tree, force=True)                       # --force: replaced
    assert "# my solution" not in work.read_text()
    # a folder that is no edition at all
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("")
    with pytest.raises(SystemExit, match="thesis.tex"):
        build(["03"], other)


def test_the_student_makefile_grades_one_line_per_failure(student_03):
    makefile = (student_03 / "Makefile").read_text()
    grade = makefile[makefile.index("\ngrade:"):makefile.index("\ntest:")]
    assert "--tb=no -rfE" in grade and "--tb=long" in grade and "V=1" in grade
    rc, out = _local_pytest_args(student_03, ["-q", "--tb=no", "-rfE", "-m", "ch03_task1"])
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED ")]
    assert rc != 0 and failed and len(out.splitlines()) < 20 * len(failed) + 40
    assert "Traceback" not in out


def _local_pytest_args(tree, args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_subprocess_test_runs_the_tree_it_tests(tmp_path):
    """tests/02_kvcache/test_hashing.py's subprocesses import the student's hashing, not the
    instructor's installed copy: on the stubs the test fails."""
    tree = tmp_path / "ed02"
    build(["02"], tree)
    test = "tests/02_kvcache/test_hashing.py::test_sha256_is_stable_across_processes_builtin_str_hash_is_not"
    rc, out = _local_pytest_args(tree, ["-q", test])
    assert rc != 0 and "NotImplementedError: ch02_task2" in out, out[-2000:]
    write_solution(tree, load().by_id("ch02_task2"))
    rc, out = _local_pytest_args(tree, ["-q", test])
    assert rc == 0, out[-2000:]


def test_the_tree_verification_no_longer_shows_the_recovered_token_rule(tmp_path):
    """04_spec_decode/tree.py's random verification emits its recovered token through chapter 04's
    own `recover_token` (ch04_task2); the rule itself written out anywhere in an edition that
    strips that task is a leak (its sibling in tasks.toml)."""
    tree = tmp_path / "ed04"
    info = build(["04"], tree)
    assert leaks(tree, load(), info["stripped"]) == []
    text = (tree / "04_spec_decode" / "tree.py").read_text()
    assert "recover_token(residual" in text
    (tree / "04_spec_decode" / "tree.py").write_text(
        text + "\n\ndef mine(residual, inv_exponential, p):\n    if not bool((residual * inv_exponential).max() > 0):\n"
               "        residual = p\n    return residual\n")
    assert any("ch04_task2's known sibling" in x for x in leaks(tree, load(), info["stripped"]))


def test_notes_of_one_task_stay_with_it():
    """A note (a test this machine cannot run) belongs to its task: it never shows under the other
    tasks graded in the same workspace."""
    from course.grade import score_task
    from course.runner import RunResult, TestResult
    m = load()
    shared = ["01_paged_attention/x.py: a note of the group"]
    a, b = m.by_id("cpu_task3"), m.by_id("cuda_task1")
    results = {t: TestResult(t, "passed") for t in a.tests}
    avx = next(t for t in a.tests if "avx512" in t)
    results[avx] = TestResult(avx, "not_here", message="Skipped: this CPU cannot run avx512")
    ga = score_task(a, RunResult(results, list(results), [], set(), 1, 1.0), False, shared)
    gb = score_task(b, RunResult({t: TestResult(t, "passed") for t in b.tests}, [], [], set(), 1, 1.0), False, shared)
    assert any("avx512" in n for n in ga.notes) and not any("avx512" in n for n in gb.notes)
    assert shared == ["01_paged_attention/x.py: a note of the group"]
