"""ChildProcess: a child sees its parent's environment as it is when the child starts.

The forkserver that forks every child keeps the environment of the FIRST child's start; before the
fix a later child inherited that one (a test that monkeypatched VLLM_ENABLE_V1_MULTIPROCESSING
made every later engine in the process refuse its KV connector)."""
from processes import ChildProcess
from process_targets import report_environ

NAME = "VFS_TEST_CHILD_ENVIRON"


def _child_sees() -> str | None:
    with ChildProcess(report_environ, {"names": [NAME]}, start_timeout=60) as child:
        return child.info[NAME]


def test_a_child_sees_a_variable_set_after_the_forkserver_started(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert _child_sees() is None                 # the forkserver runs now, without the variable
    monkeypatch.setenv(NAME, "set later")
    assert _child_sees() == "set later"


def test_a_child_does_not_see_a_variable_removed_after_the_forkserver_started(monkeypatch):
    monkeypatch.setenv(NAME, "there at the start")
    assert _child_sees() == "there at the start"
    monkeypatch.delenv(NAME)
    assert _child_sees() is None


def test_a_paused_child_stays_paused_when_its_parents_group_is_orphaned():
    """CI failed once on a SIGSTOPped prefill node that served a load: another test worker had
    called ray.init (which moves that worker to a process group of its own), a child it started
    before exited, the run's group became orphaned, and the kernel continued every stopped
    process in it. A child in a process group of its own stays paused until its parent resumes it."""
    import os
    import pathlib
    import subprocess
    import sys

    tests = pathlib.Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    script = "import process_targets; print(process_targets.stopped_child_outlives_an_orphaned_group())"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         start_new_session=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "T", run.stdout      # T: stopped; S: continued by the kernel
