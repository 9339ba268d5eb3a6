"""Write a copy of the repository with some regions transformed (stripped, probed)."""
from __future__ import annotations

import os
import pathlib
import shutil

from course import regions as R
from course.layout import ROOT, Chapter, chapters, repo_files

BIG = 512 * 1024     # data files above this are symlinked into throw-away trees, not copied


def write_tree(dest: pathlib.Path, files: list[str], transform=None, *, src: pathlib.Path = ROOT,
               link_big: bool = False) -> None:
    """Copy `files` (relative to src) to dest; transform(rel, text) -> new text or None."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel in files:
        source, target = src / rel, dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if transform is not None and R.language(rel) is not None:
            try:
                text = source.read_text()
            except UnicodeDecodeError:
                text = None
            if text is not None:
                new = transform(rel, text)
                if new is not None:
                    target.write_text(new)
                    shutil.copymode(source, target)
                    continue
        if link_big and source.stat().st_size > BIG:
            os.symlink(source.resolve(), target)
        else:
            shutil.copy2(source, target)


def code_files(chs: list[Chapter] | None = None, root: pathlib.Path = ROOT) -> list[str]:
    """The files a grading run needs besides tests: the chapter folders and benchmarks/."""
    chs = chs or chapters(root)
    tops = {c.folder for c in chs} | {"benchmarks", "pyproject.toml"}
    return [f for f in repo_files(root, untracked=True) if pathlib.PurePosixPath(f).parts[0] in tops]


PROBE_MODULE = '''"""Discovery probes: which solution regions a test runs."""
HITS = set()


def hit(key):
    HITS.add(key)
'''


def probe_transform(rel: str, text: str) -> str | None:
    """Insert `hit(key)` as the first line of every Python region."""
    if "BEGIN SOLUTION" not in text or R.language(rel) != "py":
        return None
    found = R.find_regions(text, rel)
    if not found:
        return None
    lines = text.splitlines()
    for region in reversed(found):
        lines.insert(region.begin + 1, f'{region.indent}__import__("_course_probe").hit({region.key!r})')
    return "\n".join(lines) + "\n"


def write_probe_tree(dest: pathlib.Path) -> None:
    write_tree(dest, code_files(), probe_transform, link_big=True)
    (dest / "_course_probe.py").write_text(PROBE_MODULE)
