"""The suite's guard (conftest.py: environ_restored_after_test): a test that leaves os.environ
changed fails, and the next test sees the environment as it was."""
import os
import pathlib
import subprocess
import sys

import pytest

DEMO, LEAK = "VFS_ENVIRON_GUARD_DEMO", "VFS_ENVIRON_GUARD_LEAK"
demo_only = pytest.mark.skipif(os.environ.get(DEMO) != "1", reason="run by the guard's test, in a pytest of its own")


def test_a_test_that_changes_os_environ_fails_and_the_next_one_sees_it_undone():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VFS_ENVIRON_GUARD"))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          f"{__file__}::test_leaks", f"{__file__}::test_sees_no_leak"],
                         env={**env, DEMO: "1"}, capture_output=True, text=True, timeout=300,
                         cwd=pathlib.Path(__file__).resolve().parent.parent)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"this test left os.environ changed: {LEAK}" in run.stdout, run.stdout[-3000:]
    assert "2 passed, 1 error" in run.stdout, run.stdout[-3000:]     # the leak errs at teardown; the next passes


@demo_only
def test_leaks():
    os.environ[LEAK] = "1"


@demo_only
def test_sees_no_leak():
    assert LEAK not in os.environ
