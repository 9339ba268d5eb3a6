"""Targets for child processes started by tests (importable by name: a forkserver child imports its
target's module, and tests/ is on sys.path)."""
import os


def report_environ(conn, kwargs: dict) -> None:
    """Report the named environment variables as the child sees them, then wait to be stopped."""
    conn.send(("ok", {name: os.environ.get(name) for name in kwargs["names"]}))
    conn.recv()


def stopped_child_outlives_an_orphaned_group() -> str:
    """Run as a session leader with SIGHUP ignored (how CI starts a run): pause a ChildProcess,
    then let its parent's process group become orphaned the way a test run does it — a sibling
    moves to a group of its own (Ray's `ray.init` calls os.setpgrp() in the process that calls
    it) and a child it started before exits. The kernel then sends SIGHUP + SIGCONT to every
    process of the orphaned group that holds a stopped one (POSIX job control). Returns the
    paused child's state afterwards: "T" if it is still stopped."""
    import signal
    import subprocess
    import time

    from processes import ChildProcess

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with ChildProcess(report_environ, {"names": []}, start_timeout=60) as child:
        child.pause()
        sibling = os.fork()
        if sibling == 0:                                      # the other test worker
            helper = subprocess.Popen(["sleep", "0.2"])       # started in the run's group ...
            os.setpgrp()                                      # ... then the worker leaves it (ray.init)
            helper.wait()                                     # the helper exits: the group is orphaned
            os._exit(0)
        os.waitpid(sibling, 0)
        time.sleep(0.3)
        with open(f"/proc/{child.pid}/status") as f:
            state = next(line.split()[1] for line in f if line.startswith("State:"))
        child.resume()
    return state


def echo_server(conn, kwargs: dict) -> None:
    """A child with a second thread that answers on a socket (as a KV node's transfer server does)
    while its main thread waits on the pipe: reports the port, echoes each byte until stopped."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        peer, _ = server.accept()
        while data := peer.recv(1):
            peer.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    conn.send(("ok", {"port": server.getsockname()[1]}))
    conn.recv()
