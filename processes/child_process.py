"""Child processes: something (a KV node, an engine, an engine core) in a process of its own, behind a pipe.

Infrastructure every chapter that starts processes uses and none teaches (chapter 06's KV nodes,
chapter 07's engine core, its tensor-parallel workers): how a child starts fast, sees the
configuration its parent has when it starts, and never outlives the run that started it.

  * forkserver: one clean server process imports torch (and the `preload` modules) once; each child
    is a fast fork of it. Not `fork` of the caller: a process whose torch thread pools already run
    passes them on broken. Not `spawn`: every child would import torch again (seconds).
  * the environment: the forkserver keeps the environment of its own start; a child gets its
    parent's environment as it is when the CHILD starts (a test's monkeypatch, a variable set since).
  * job control: `pause()` returns once every thread of the child is stopped (`stop_process`), and a
    child leads a process group of its own, so a paused one stays paused (`_become_child`).
  * lifetime: a child is not a daemon (it may start processes of its own: an engine core's workers);
    it dies with the forkserver (Linux prctl PDEATHSIG), which dies with the process that started it,
    and `ChildProcess.close()` is bounded (stop -> terminate -> kill) and runs at interpreter exit.
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import signal
import time
import traceback
import weakref

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """The kernel sends this process SIGTERM when the one that started it dies, even by SIGKILL
    (Linux prctl; strictly: when the starting THREAD exits, so start children from a long-lived
    thread, as everything here does). Also a `preexec_fn` for servers started with subprocess."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once EVERY thread of it is stopped (alive, silent: a test's hung node).

    kill() returns before that. The kernel hands a process-directed SIGSTOP to one thread (the main
    one, if it can take it) and wakes it; only when that thread next runs does it start the group
    stop that stops the others. On a busy machine that can take milliseconds, and meanwhile another
    thread — a server woken by the very request the test sends next — runs Python code and answers.
    (CI saw a "paused" prefill node serve a load within one engine step.) So wait for every thread's
    state in /proc to be "T"."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid}: not every thread stopped within {timeout} s of SIGSTOP")
        time.sleep(0.001)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise ProcessLookupError(f"process {pid} is gone") from None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]       # after "(comm)": comm may hold spaces
        except (FileNotFoundError, ProcessLookupError):
            continue                                                  # a thread that just exited
        if state not in ("T", "t", "Z", "X"):                         # stopped (or a thread on its way out)
            return False
    return True


def serve_commands(conn, make, commands: dict, close) -> None:
    """The child's loop: build the object (`make()`), report ("ok", info), then answer
    (cmd, args) messages with commands[cmd](obj, *args) until "stop". Exceptions are sent to
    the parent (raised there); `close(obj)` always runs."""
    obj = None
    try:
        obj, info = make()
        conn.send(("ok", info))
        while True:
            cmd, args = conn.recv()
            try:
                if cmd == "stop":
                    break
                conn.send(("ok", commands[cmd](obj, *args)))
            except Exception as e:       # noqa: BLE001 - sent back to the parent, raised there
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    except Exception as e:               # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if obj is not None:
            close(obj)
        conn.close()



# What the forkserver imports before it forks any child: the `preload` of every ChildProcess
# subclass defined so far (see ChildProcess.preload), and what `preload_in_forkserver` adds.
_PRELOAD: list[str] = []


def _run_with_environ(target, environ: dict[str, str], conn, kwargs: dict) -> None:
    """The child's entry point: the environment its parent has NOW, then the target. The forkserver
    forks every child from its own copy of the environment, taken when the first child started; a
    child of a later parent whose environment changed since (a test's monkeypatch, a config
    variable set after start-up) would otherwise see the stale one. The child is not a daemon (it
    may start processes of its own: an engine core's tensor-parallel workers), so it dies with the
    forkserver instead, which dies with the process that started it."""
    _become_child(environ)
    target(conn, kwargs)


_LIVE: weakref.WeakSet = weakref.WeakSet()       # ChildProcesses not closed yet
_LIVE_PROCS: weakref.WeakSet = weakref.WeakSet()  # processes of start_process


@atexit.register
def _close_live_children() -> None:
    """Children are not daemons: close the ones still open before the interpreter waits for them
    (registered after multiprocessing's own exit hook, so it runs first)."""
    for child in list(_LIVE):
        child.close()
    for proc in list(_LIVE_PROCS):
        try:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        except ValueError:                    # closed by its owner already
            pass


def preload_in_forkserver(*modules: str) -> None:
    """Modules every child of this process's forkserver should start with (before its first child)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def mp_context():
    """forkserver: one clean server process imports torch once; each child is then a fast fork of
    it (spawn would re-import torch in every child, ~2-3 s; a plain fork of a process whose torch
    thread pools already run inherits them broken)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_process(target, *args, name: str | None = None):
    """A started multiprocessing.Process of the forkserver running `target(*args)` with this
    process's environment as it is now, dying with the forkserver (ChildProcess's rules). The
    caller stops it; one still running at interpreter exit is terminated."""
    proc = mp_context().Process(target=_run_with_environ_args, args=(target, dict(os.environ), args), name=name,
                                daemon=False)
    proc.start()
    _LIVE_PROCS.add(proc)
    return proc


def _run_with_environ_args(target, environ: dict[str, str], args: tuple) -> None:
    _become_child(environ)
    target(*args)


def _become_child(environ: dict[str, str]) -> None:
    """What every child does first: die with the forkserver, take its parent's environment, and
    lead a process group of its own. The last keeps a paused child (SIGSTOP: a test's silent
    node) paused until its parent resumes it: when the group it would share with the test run
    is orphaned (a test worker called ray.init, which moves that worker to a group of its own,
    and a child it had started exits), the kernel sends SIGHUP + SIGCONT to every process of
    that group, stopped ones included (POSIX job control). A group of its own stays connected
    through its parent, the forkserver, for as long as the child lives."""
    die_with_parent()
    os.setpgrp()
    os.environ.clear()
    os.environ.update(environ)


class ChildProcess:
    """Something (a KVNode, an engine) in a child process behind a pipe. Every call has a
    timeout; `close()` always reaps it (stop -> terminate -> kill), so a test can never leave
    it behind.

    `preload`: modules a subclass's children need, imported once by the forkserver so that each
    child forks with them loaded (chapter 07's engine process saves seconds of torch-model and
    transformers imports per engine). They are registered when the subclass is DEFINED: a
    process has one forkserver, started with the list as it is at the first child.

    The forkserver also keeps the environment of that first start; each child is therefore handed
    its parent's environment as it is when the child starts (`_run_with_environ`)."""

    preload: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _PRELOAD.extend(m for m in cls.preload if m not in _PRELOAD)

    def __init__(self, target, kwargs: dict, start_timeout: float, wait: bool = True) -> None:
        ctx = mp_context()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_run_with_environ, args=(target, dict(os.environ), child, kwargs), daemon=False)
        self.proc.start()
        _LIVE.add(self)
        child.close()
        self.pid = self.proc.pid
        self.info: dict | None = None
        self._start_timeout = start_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> dict:
        """Block until the child has built its object (start it with wait=False to do
        something else meanwhile, e.g. build another engine); returns what it reported."""
        if self.info is None:
            try:
                self.info = self._recv(self._start_timeout, "start")
            except BaseException:
                self.close()
                raise
            self._started()
        return self.info

    def _started(self) -> None:
        """Subclasses read `self.info` here."""

    def _recv(self, timeout: float, what: str):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"child process: no answer to {what!r} within {timeout} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"child process died during {what!r} (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"child process failed {what!r}: {value}")
        return value

    def call(self, cmd: str, *args, timeout: float = 60.0):
        self.wait_ready()
        self._conn.send((cmd, args))
        return self._recv(timeout, cmd)

    def kill(self) -> None:
        """SIGKILL: the process dies the way a crashed machine does (no goodbye)."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(10)

    def pause(self) -> None:
        """SIGSTOP, returning once every thread is stopped (stop_process): alive, silent."""
        stop_process(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def request_stop(self) -> None:
        """Ask the child to shut down (closing its connector) without waiting for it."""
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self._conn.send(("stop", ()))
            except (OSError, BrokenPipeError):
                pass

    def close(self) -> None:
        """Stop -> terminate -> kill, each bounded: the process is gone when this returns."""
        _LIVE.discard(self)
        self.request_stop()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
