"""ChildProcess: a child sees its parent's environment as it is when the child starts, and a
paused child is silent from the moment pause() returns until resume().

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
    """A test run can continue a paused child behind the test's back: when a test worker calls
    ray.init (which moves that worker to a process group of its own) and a child it started before
    exits, the run's group is orphaned and the kernel continues every stopped process in it (POSIX
    job control). A child in a process group of its own stays paused until its parent resumes it."""
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


def thread_states(pid: int) -> list[str]:
    import os
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return states


def test_a_paused_child_answers_nothing_once_pause_returns():
    """CI failed on a SIGSTOPped prefill node that served a load within one engine step: kill()
    returns before the child stops — the kernel wakes one thread, which stops the others only when
    it next runs — and meanwhile the node's server thread, woken by the request, answered it.
    pause() returns once every thread is stopped: nothing answers until resume()."""
    import socket

    from process_targets import echo_server

    with ChildProcess(echo_server, {}, start_timeout=60) as child:
        with socket.create_connection(("127.0.0.1", child.info["port"]), timeout=5) as sock:
            for _ in range(20):
                child.pause()
                assert set(thread_states(child.pid)) <= {"T", "t"}, thread_states(child.pid)
                sock.sendall(b"x")
                sock.settimeout(0.05)
                try:
                    early = sock.recv(1)
                except socket.timeout:
                    early = b""
                assert early == b"", "a paused child answered"
                child.resume()
                sock.settimeout(5)
                assert sock.recv(1) == b"x"                    # answered once resumed
