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


def share_csrc(out: pathlib.Path) -> None:
    """Throw-away trees (the proof's) get their C++ extension sources from a content-addressed
    folder: torch.utils.cpp_extension rebuilds whenever the source PATHS change, so trees
    with the same sources must resolve to the same paths to share one build."""
    import hashlib
    import os
    import tempfile
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "vllm_from_scratch" / "course_csrc"
    for csrc in sorted(out.glob("*/csrc")):
        if csrc.is_symlink() or not csrc.is_dir():
            continue
        digest = hashlib.sha256()
        for f in sorted(csrc.rglob("*")):
            if f.is_file():
                digest.update(f.relative_to(csrc).as_posix().encode() + b"\0" + f.read_bytes())
        shared = base / digest.hexdigest()[:16]
        if not shared.exists():
            base.mkdir(parents=True, exist_ok=True)
            tmp = pathlib.Path(tempfile.mkdtemp(dir=base))
            shutil.copytree(csrc, tmp / "csrc")
            try:
                os.rename(tmp / "csrc", shared)
            except OSError:
                pass                       # another process made it first: same contents
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(csrc)
        csrc.symlink_to(shared, target_is_directory=True)


def code_files(chs: list[Chapter] | None = None, root: pathlib.Path = ROOT) -> list[str]:
    """The files a grading run needs besides tests: the chapter folders and benchmarks/."""
    chs = chs or chapters(root)
    tops = {c.folder for c in chs} | {"benchmarks", "pyproject.toml"}
    return [f for f in repo_files(root, untracked=True) if pathlib.PurePosixPath(f).parts[0] in tops]


PROBE_MODULE = '''"""Discovery probes: which solution regions a test runs. A process the test started
(an engine in a subprocess) appends what it runs to $COURSE_PROBE_FILE for the test to read."""
import os

HITS = set()


def hit(key):
    if key in HITS:
        return
    HITS.add(key)
    path = os.environ.get("COURSE_PROBE_FILE")
    if path and str(os.getpid()) != os.environ.get("COURSE_PROBE_PID"):
        with open(path, "a") as f:
            f.write(key + "\\n")
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


def write_probe_tree(dest: pathlib.Path, strip_keys: dict[str, tuple] | None = None) -> None:
    """The repository's code with every Python region probed, and the C++ regions named in
    strip_keys ({key: (task id, title, optional)}) stubbed: probes cannot see C++, so discovery
    learns what a C++ task's tests are by putting it back (course/testgen.py)."""
    strip_keys = strip_keys or {}

    def transform(rel: str, text: str) -> str | None:
        if "BEGIN SOLUTION" not in text:
            return None
        if R.language(rel) == "c":
            keys = {k for k in strip_keys if k.startswith(rel + "::")}
            return R.strip(text, rel, strip_keys, keys) if keys else None
        return probe_transform(rel, text)

    write_tree(dest, code_files(), transform, link_big=True)
    share_csrc(dest)
    (dest / "_course_probe.py").write_text(PROBE_MODULE)
