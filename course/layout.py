"""Where things are: the repository, its chapters (folder <-> import name) and its files."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints", "build",
             "node_modules", ".venv-vllm"}


@dataclasses.dataclass(frozen=True)
class Chapter:
    folder: str        # "02_kvcache"
    package: str       # "kvcache"

    @property
    def short(self) -> str:
        """"02" for numbered chapters, "cuda" for kernels_cuda: task ids are ch02_task3, cuda_task1."""
        head = self.folder.split("_", 1)[0]
        return head if head.isdigit() else self.folder.split("_")[-1]

    @property
    def prefix(self) -> str:
        return f"ch{self.short}" if self.short.isdigit() else self.short


def chapters(root: pathlib.Path = ROOT) -> list[Chapter]:
    """The packages of pyproject's package-dir, in folder order."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    package_dir = data["tool"]["setuptools"]["package-dir"]
    out = [Chapter(folder, package) for package, folder in package_dir.items() if package != "course"]
    return sorted(out, key=lambda c: (not c.folder[0].isdigit(), c.folder))


def chapter_of(path: str, chs: list[Chapter]) -> Chapter | None:
    top = pathlib.PurePosixPath(path).parts[0]
    return next((c for c in chs if c.folder == top), None)


def find_chapter(name: str, chs: list[Chapter]) -> Chapter:
    """'02', 'ch02', '02_kvcache', 'kvcache', 'cuda', 'kernels_cuda' -> the chapter."""
    name = name.strip().removeprefix("ch")
    for c in chs:
        if name in (c.folder, c.package, c.short):
            return c
    raise SystemExit(f"unknown chapter {name!r}; chapters: {', '.join(c.short for c in chs)}")


def repo_files(root: pathlib.Path = ROOT, untracked: bool = False) -> list[str]:
    """Files git tracks (what a clone and CI see: the regions the manifest must cover), plus
    with untracked=True the new files git would add (trees are built from the working tree as
    it is, so that it imports while others' new files are not committed yet); without git
    (a student tree), every file outside the usual caches."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "ls-files", "--cached", "-z"] + (["--others", "--exclude-standard"] if untracked else []),
                             cwd=root, capture_output=True, check=True).stdout.decode()
        return sorted(p for p in out.split("\0") if p and (root / p).is_file())
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for f in filenames:
            if not f.endswith((".pyc", ".so")):
                files.append(pathlib.Path(dirpath, f).relative_to(root).as_posix())
    return sorted(files)
