"""Discovery (instructor tool): which tests exercise which regions, to choose each task's
tests. Runs the chapters' tests once against a probed copy of the repository (every Python
region records that it ran) and writes, per test: outcome, duration, regions hit.

    python -m course discover [CHAPTERS] --out build/discover.json
"""
from __future__ import annotations

import json
import pathlib
import shutil
import tempfile

from course.layout import ROOT, chapters, find_chapter
from course.runner import make_workspace, run_tests
from course.trees import write_probe_tree


def discover(names: list[str], out: pathlib.Path, marker_expr: str = "not gpu and not notebook") -> dict:
    chs = chapters()
    selected = [find_chapter(n, chs) for n in names] if names else chs
    test_dirs = [f"tests/{c.folder}" for c in selected if (ROOT / "tests" / c.folder).is_dir()]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="course-discover-"))
    try:
        tree = tmp / "tree"
        write_probe_tree(tree)
        ws = make_workspace(tree, tmp / "ws")
        run = run_tests(ws, ["-m", marker_expr, *test_dirs], student=tree, startup_s=7200,
                        extra_env={"COURSE_TEST_LIMIT": "180"})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    data = {n: {"outcome": r.outcome, "duration": r.duration, "hits": r.hits or [], "message": r.message[-300:]}
            for n, r in sorted(run.results.items())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    return data
