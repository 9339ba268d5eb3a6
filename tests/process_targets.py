"""Targets for child processes started by tests (importable by name: a forkserver child imports its
target's module, and tests/ is on sys.path)."""
import os


def report_environ(conn, kwargs: dict) -> None:
    """Report the named environment variables as the child sees them, then wait to be stopped."""
    conn.send(("ok", {name: os.environ.get(name) for name in kwargs["names"]}))
    conn.recv()
