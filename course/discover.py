"""Discovery (instructor tool): which tests exercise which solution regions.

Runs tests against a probed copy of the repository — every Python region records that it ran
(course/trees.py) — and writes, per test: outcome, duration, regions hit. The C++ regions are
stubbed in that copy as in the full student edition (probes cannot see C++): a test that needs
a C++ task fails there, and `course tests` (course/testgen.py) finds a C++ task's tests by
running its candidates again with that task put back.

    python -m course discover [CHAPTERS] --out build/discover.json    # the raw data
    python -m course tests                                            # discovery + tasks.toml
"""
from __future__ import annotations

import concurrent.futures
import json
import pathlib
import shutil
import tempfile

from course.layout import ROOT, chapters, find_chapter
from course.manifest import Manifest, load
from course.runner import make_workspace, run_tests
from course.trees import write_probe_tree

MARKERS = "not gpu and not notebook"
NOT_CHAPTER_TESTS = ("tests/course/test_", "tests/test_repository.py", "tests/test_self_contained.py")


def test_files(folders: list[str] | None = None) -> list[str]:
    """Every test file of the chapters (all: every folder of tests/, the course's task tests
    included, the course tool's own tests and the repository checks left out)."""
    tests = ROOT / "tests"
    out = []
    for p in sorted(tests.rglob("test_*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith(NOT_CHAPTER_TESTS) or "__pycache__" in rel:
            continue
        if folders is not None and not any(rel.startswith(f"tests/{f}/") for f in folders):
            continue
        out.append(rel)
    return out


def cpp_stubs(manifest: Manifest, restore: set[str] = frozenset()) -> dict[str, tuple]:
    """{C++ region key: (task, title, error_stub)} for every C++ task not in `restore`."""
    return {key: (t.id, t.title, t.error_stub) for t in manifest.tasks if t.id not in restore
            for key in t.regions if key.split("::")[0].endswith(tuple(R_C_SUFFIXES))}


R_C_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")


def run_probed(test_args: list[str], *, manifest: Manifest, restore_cpp: set[str] = frozenset(), jobs: int = 2,
               per_test_limit_s: float = 300.0, quiet: bool = True) -> dict[str, dict]:
    """Run `test_args` (files or ids) on a probed tree; {nodeid: {outcome, duration, hits, summary}}."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="course-discover-"))
    try:
        tree = tmp / "tree"
        write_probe_tree(tree, cpp_stubs(manifest, set(restore_cpp)))
        ws = make_workspace(tree, tmp / "ws")
        groups = [test_args[i::jobs] for i in range(jobs)] if jobs > 1 else [test_args]
        groups = [g for g in groups if g]

        def one(args):
            return run_tests(ws, ["-m", MARKERS, *args], student=tree, startup_s=7200, quiet=quiet,
                             extra_env={"COURSE_TEST_LIMIT": str(per_test_limit_s), "COURSE_PROBE": "1"})

        results = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
            for run in pool.map(one, groups):
                for n, r in run.results.items():
                    results[n] = {"outcome": r.outcome, "duration": r.duration, "hits": r.hits or [],
                                  "marks": r.marks or [], "summary": r.summary or r.message[-300:]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dict(sorted(results.items()))


def discover(names: list[str], out: pathlib.Path, jobs: int = 2) -> dict:
    chs = chapters()
    folders = [find_chapter(n, chs).folder for n in names] if names else None
    data = run_probed(test_files(folders), manifest=load(), jobs=jobs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    return data
