"""The proof's grading processes are forked from a zygote (course/zygote.py): each must behave as a
fresh `python -m pytest` would — its own working directory, environment and sys.path, its exit
code and output reported, and a hung one killed at its time limit with everything it started."""
import os
import sys
import time

from course.runner import ZygoteClient

TESTS = '''
import os, sys, time

def test_sees_its_own_world():
    assert os.getcwd() == os.environ["EXPECT_CWD"]
    assert sys.path[0] == os.environ["EXPECT_CWD"] and os.environ["EXPECT_PATH"] in sys.path
    import helper_only_here                      # found through PYTHONPATH
    assert "mini_vllm" not in sys.modules and "paged_attention" not in sys.modules
    assert "triton" not in sys.modules           # each process configures it (TRITON_INTERPRET)

def test_fails():
    assert False, "expected failure"

def test_hangs():
    if os.environ.get("HANG"):
        os.system("sleep 300 &")                 # a grandchild in the same session dies too
        time.sleep(300)
'''


def test_a_forked_pytest_is_a_fresh_pytest(tmp_path):
    (tmp_path / "test_x.py").write_text(TESTS)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helper_only_here.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(lib), EXPECT_CWD=str(tmp_path), EXPECT_PATH=str(lib))
    args = ["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    with ZygoteClient() as zygote:
        code, out = zygote.run(args + ["test_x.py::test_sees_its_own_world"], cwd=tmp_path, env=env, timeout=120)
        assert code == 0 and "1 passed" in out, out
        code, out = zygote.run(args + ["test_x.py"], cwd=tmp_path, env=env, timeout=120)
        assert code == 1 and "1 failed, 2 passed" in out and "expected failure" in out, out
        t0 = time.monotonic()
        code, out = zygote.run(args + ["test_x.py::test_hangs"], cwd=tmp_path, env=dict(env, HANG="1"), timeout=5)
        assert code == -9 and time.monotonic() - t0 < 60
        # The zygote serves on after a kill.
        code, out = zygote.run(args + ["test_x.py::test_sees_its_own_world"], cwd=tmp_path, env=env, timeout=120)
        assert code == 0, out
