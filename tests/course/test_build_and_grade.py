"""course build / grade: the student edition, the isolated grading process, its report,
time limits, crashes, and that grading never reaches the reference solution."""
import json
import pathlib
import sys

import pytest

from course import regions as R
from course.build import build, remove_tests
from course.grade import grade_tree, main as grade_main, report_json
from course.layout import ROOT
from course.manifest import load
from course.notebooks import strip_notebook
from course.proof import check_student_edition
from course.runner import make_workspace, run_tests


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
    assert "BEGIN SOLUTION" in (student_03 / "02_kvcache" / "block_pool.py").read_text()   # other chapters stay solved
    assert "raise NotImplementedError(" not in (student_03 / "02_kvcache" / "block_pool.py").read_text()
    assignment = (student_03 / "03_scheduler" / "ASSIGNMENT.md").read_text()
    for t in tasks:
        assert f"### {t.id} — {t.title}" in assignment
    assert "What the reference achieves" in assignment and "python -m benchmarks.sim_batching" in assignment
    info = json.loads((student_03 / "course_tasks.json").read_text())
    assert set(info) == {t.id for t in tasks}
    assert all(f'"{t.id}:' in (student_03 / "pyproject.toml").read_text() for t in tasks)   # registered markers
    assert (student_03 / "conftest.py").exists()
    assert not (student_03 / "course").exists() and not (student_03 / "tests" / "course").exists()
    assert not (student_03 / ".git").exists()


def test_student_edition_imports_and_is_clean(student_03):
    assert check_student_edition(student_03, ["03_scheduler"]) == []


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
                         "reference_modules_imported", "wall_s"}
    assert data["mode"] == "fast" and data["passed"] is False and data["num_passed"] == 0
    assert data["reference_modules_imported"] == []
    assert [t["id"] for t in data["tasks"]] == [t.id for t in load().of_chapter("03_scheduler")]
    for t in data["tasks"]:
        assert t["status"] == "FAIL" and t["score"] < 1 and t["tests_total"] >= 1
        assert set(t["tests"][0]) == {"nodeid", "outcome", "duration", "message"}
        assert any("NotImplementedError" in x["message"] for x in t["tests"])
    assert "tasks passed" in capsys.readouterr().out


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
''',
}


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
