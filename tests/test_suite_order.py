"""`make test`'s pytest-xdist flags keep the order tests/conftest.py gives the suite.

conftest.py moves the longest test files to the front (LONGEST_FILES): the course proof alone
runs ~12 minutes, and started last it is the one file a process runs while the other cores sit
idle. pytest-xdist's --dist loadfile re-sorts the files by their number of tests unless told not
to (--no-loadscope-reorder), which sent the proof's three tests to the end of the queue. This
runs a small suite of its own with the Makefile's flags and checks that a one-test file the
conftest puts first is the first file its worker runs.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFTEST = '''
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith("test_z_first"))   # stable
'''
IMPORTS = "import os\nfrom pathlib import Path\n"
TEST = '''
def test_{i}():
    with open(Path(__file__).parent / "order.log", "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + " " + __name__ + "\\n")
'''


def makefile_xdist_flags() -> list[str]:
    """The flags `make test` hands pytest-xdist with two jobs (its XDIST variable)."""
    line = next(l for l in (REPO / "Makefile").read_text().splitlines() if l.startswith("XDIST"))
    flags = re.search(r",(-n \$\(TEST_JOBS\).*)\)$", line).group(1)
    return flags.replace("$(TEST_JOBS)", "2").split()


def test_the_file_the_conftest_puts_first_runs_first(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_z_first.py").write_text(IMPORTS + TEST.format(i=0))     # one test: xdist would put it last
    for name in ("test_a", "test_b", "test_c"):
        (tmp_path / f"{name}.py").write_text(IMPORTS + "".join(TEST.format(i=i) for i in range(5)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), *makefile_xdist_flags(), str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [l.split() for l in (tmp_path / "order.log").read_text().splitlines()]
    worker = next(w for w, module in lines if module.endswith("test_z_first"))
    first_on_that_worker = next(module for w, module in lines if w == worker)
    assert first_on_that_worker.endswith("test_z_first"), lines
