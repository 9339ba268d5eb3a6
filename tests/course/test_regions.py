"""course/regions.py: finding, checking, stripping and restoring solution regions."""
import ast
import subprocess
import shutil

import pytest

from course import regions as R
from course.layout import ROOT
from course.manifest import all_regions, load, problems, scanned_files

PY = '''import math


def area(r):
    """Area of a circle."""
    if r < 0:
        raise ValueError("negative radius")
    ### BEGIN SOLUTION
    a = math.pi * r * r
    return a
    ### END SOLUTION


class Box:
    def volume(self, w, h, d):
        ### BEGIN SOLUTION
        return w * h * d
        ### END SOLUTION

    def twice(self):
        x = 1
        ### BEGIN SOLUTION
        x = 2
        ### END SOLUTION
        y = 3
        ### BEGIN SOLUTION
        y = 4
        ### END SOLUTION
        return x + y
'''

C = '''#include <cstdint>
namespace vfs {
template <typename T>
__global__ void __launch_bounds__(128) copy_kernel(const T* src, T* dst, int n) {
  const int i = threadIdx.x;
  // ### BEGIN SOLUTION
  if (i < n) dst[i] = src[i];
  // ### END SOLUTION
}

int host_sum(const int* x, int n) {
  int s = 0;
  // ### BEGIN SOLUTION
  for (int i = 0; i < n; ++i) s += x[i];
  // ### END SOLUTION
  return s;
}
}  // namespace vfs
'''


def test_regions_are_found_with_stable_keys():
    found = R.find_regions(PY, "pkg/geo.py")
    assert [r.key for r in found] == ["pkg/geo.py::area", "pkg/geo.py::Box.volume", "pkg/geo.py::Box.twice",
                                      "pkg/geo.py::Box.twice#2"]
    assert [r.num_lines for r in found] == [2, 1, 1, 1]
    assert [r.key for r in R.find_regions(C, "k/copy.cu")] == ["k/copy.cu::copy_kernel", "k/copy.cu::host_sum"]


@pytest.mark.parametrize("text,path", [(PY, "pkg/geo.py"), (C, "k/copy.cu")])
def test_strip_then_fill_is_the_identity(text, path):
    task_of = {r.key: (f"ch09_task{i + 1}", "do it") for i, r in enumerate(R.find_regions(text, path))}
    stripped = R.strip(text, path, task_of)
    assert stripped != text
    # the stripped file is itself well marked, with the same regions, and every body is the stub
    assert [r.key for r in R.find_regions(stripped, path)] == [r.key for r in R.find_regions(text, path)]
    for key, body in R.bodies(stripped, path).items():
        assert task_of[key][0] in "\n".join(body)
    assert R.fill(stripped, path, R.bodies(text, path)) == text
    # restoring one region only changes that region
    first = next(iter(task_of))
    partly = R.fill(stripped, path, {first: R.bodies(text, path)[first]})
    assert R.bodies(partly, path)[first] == R.bodies(text, path)[first]
    assert sum(a != b for a, b in zip(R.bodies(partly, path).values(), R.bodies(text, path).values())) == len(task_of) - 1


def test_stripped_python_raises_not_implemented_naming_the_task():
    task_of = {r.key: (f"ch09_task{i + 1}", f"title {i + 1}") for i, r in enumerate(R.find_regions(PY, "g.py"))}
    namespace = {}
    exec(compile(R.strip(PY, "g.py", task_of), "g.py", "exec"), namespace)      # the rest still imports
    with pytest.raises(ValueError):
        namespace["area"](-1)                   # code before the region still runs
    with pytest.raises(NotImplementedError, match="ch09_task1: title 1"):
        namespace["area"](2)
    with pytest.raises(NotImplementedError, match="ch09_task2"):
        namespace["Box"]().volume(1, 2, 3)


def test_stripping_only_some_keys():
    keys = {"g.py::Box.volume"}
    stripped = R.strip(PY, "g.py", {"g.py::Box.volume": ("t", "x")}, keys)
    namespace = {}
    exec(stripped, namespace)
    assert namespace["area"](1) == pytest.approx(3.14159, rel=1e-4)
    with pytest.raises(NotImplementedError):
        namespace["Box"]().volume(1, 1, 1)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_stripped_cpp_compiles_and_fails_loudly(tmp_path):
    task_of = {r.key: ("ch09_task1", "sum") for r in R.find_regions(C, "k.cpp")}
    host = R.strip(C, "k.cpp", task_of).replace("template <typename T>\n__global__ void __launch_bounds__(128) "
                                                  "copy_kernel", "template <typename T>\nvoid copy_kernel")
    src = tmp_path / "k.cpp"
    src.write_text("struct { int x; } threadIdx;\n" + host + "\nint main() { int a[2] = {1, 2}; "
                   "return vfs::host_sum(a, 2); }\n")
    subprocess.run(["g++", "-std=c++17", "-w", str(src), "-o", str(tmp_path / "k")], check=True)
    proc = subprocess.run([str(tmp_path / "k")], capture_output=True, text=True)
    assert proc.returncode != 0 and "ch09_task1_NotImplementedError" in proc.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_an_optional_tasks_cpp_stub_does_not_build_and_says_why(tmp_path):
    """Performance track: the stub is an #error naming the task, so the kernel is unavailable
    (the engine falls back to torch ops) instead of crashing whoever calls it; the CPU kernels'
    builder reports it without running the compiler."""
    from kernels_cpu.build import unwritten
    task_of = {r.key: ("cpu_task9", "a fast sum", True) for r in R.find_regions(C, "k.cpp")}
    stripped = R.strip(C, "k.cpp", task_of)
    assert R.fill(stripped, "k.cpp", R.bodies(C, "k.cpp")) == C
    src = tmp_path / "k.cpp"
    src.write_text(stripped)
    proc = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-x", "c++", str(src)], capture_output=True, text=True)
    assert proc.returncode != 0 and "cpu_task9: a fast sum -- not implemented yet" in proc.stderr
    assert "cpu_task9: a fast sum" in unwritten([src])
    assert unwritten([tmp_path / "k.cpp"]) and (src.write_text(C) or unwritten([src]) is None)


@pytest.mark.parametrize("bad,error", [
    ("def f():\n    ### BEGIN SOLUTION\n    x = 1\n", "never closed"),
    ("def f():\n    x = 1\n    ### END SOLUTION\n", "without a BEGIN"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION\n", "nested"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### END SOLUTION\n", "empty region"),
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "inside a function"),
    ("def f():\n    ### BEGIN SOLUTION\n    x = 1\n  ### END SOLUTION\n", "indented"),
])
def test_malformed_markers_are_refused(bad, error):
    with pytest.raises(R.MarkerError, match=error):
        R.find_regions(bad, "bad.py")


def test_every_marked_file_in_the_repository_is_well_formed_and_imports_when_stripped():
    """Balanced, non-nested, inside functions (find_regions raises otherwise); each stripped
    Python file still parses (the proof imports them all, tests/course/test_proof.py)."""
    found = R.scan(ROOT, scanned_files())
    assert sum(len(v) for v in found.values()) >= 100
    for path, regions in found.items():
        if path.endswith(".py"):
            ast.parse(R.strip((ROOT / path).read_text(), path, {}))


def test_manifest_covers_every_region_exactly_once():
    """course/tasks.toml: every region belongs to one task, every task has regions and fast
    tests, test files exist. When this fails after you mark a new region, add it to a task."""
    assert problems(load()) == []
    tasks = load().tasks
    assert len({k for t in tasks for k in t.regions}) == len(all_regions())
