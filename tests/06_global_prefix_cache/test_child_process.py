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
