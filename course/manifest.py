"""The course manifest (course/tasks.toml): every solution region belongs to one task; each
task lists the tests that grade it.

    [[task]]
    id = "ch02_task3"                       # ch<NN>_task<k>, cuda_task<k> for kernels_cuda
    title = "BlockPool: prefix-cache lookup, registration, LRU eviction"
    regions = ["02_kvcache/block_pool.py::BlockPool.get_cached_block", ...]   # regions.Region.key
    public = ["tests/02_kvcache/test_block_pool.py::test_x", ...]   # shipped to students
    hidden = ["tests/02_kvcache/test_properties.py::test_y", ...]   # left out of the student edition
    fast = ["tests/02_kvcache/test_block_pool.py::test_x"]          # the CI proof's subset
    timeout_s = 120                          # optional: the task's time limit (full grading)

A test id is a pytest node id relative to the repository root; `file::func` covers every
parametrization of func. Hidden ids name whole test functions or classes (the student
edition deletes them from its copy of the file) or whole files.
"""
from __future__ import annotations

import dataclasses
import pathlib
import tomllib

from course import regions as R
from course.layout import ROOT, Chapter, chapter_of, chapters, repo_files

MANIFEST = pathlib.Path(__file__).with_name("tasks.toml")
DEFAULT_TIMEOUT_S = 120.0
FAST_TIMEOUT_S = 60.0


@dataclasses.dataclass
class Task:
    id: str
    title: str
    chapter: str                 # chapter folder
    regions: list[str]
    public: list[str]
    hidden: list[str]
    fast: list[str]
    timeout_s: float = DEFAULT_TIMEOUT_S
    fast_timeout_s: float = FAST_TIMEOUT_S
    notes: str = ""
    standins: list[str] = dataclasses.field(default_factory=list)   # files under tests/course/ (apply(monkeypatch))

    @property
    def tests(self) -> list[str]:
        return self.public + self.hidden

    @property
    def marker(self) -> str:
        return self.id


@dataclasses.dataclass
class Manifest:
    tasks: list[Task]

    def by_id(self, task_id: str) -> Task:
        for t in self.tasks:
            if t.id == task_id:
                return t
        raise KeyError(task_id)

    def of_chapter(self, folder: str) -> list[Task]:
        return [t for t in self.tasks if t.chapter == folder]

    def task_of_region(self) -> dict[str, Task]:
        return {key: t for t in self.tasks for key in t.regions}

    def hidden_ids(self) -> set[str]:
        return {h for t in self.tasks for h in t.hidden}


def load(path: pathlib.Path = MANIFEST) -> Manifest:
    data = tomllib.loads(path.read_text())
    chs = chapters()
    tasks = []
    for raw in data.get("task", []):
        regions = list(raw["regions"])
        ch = chapter_of(regions[0], chs) if regions else None
        tasks.append(Task(
            id=raw["id"], title=raw["title"], chapter=ch.folder if ch else "?", regions=regions,
            public=list(raw.get("public", [])), hidden=list(raw.get("hidden", [])), fast=list(raw.get("fast", [])),
            timeout_s=float(raw.get("timeout_s", DEFAULT_TIMEOUT_S)),
            fast_timeout_s=float(raw.get("fast_timeout_s", FAST_TIMEOUT_S)), notes=raw.get("notes", ""),
            standins=list(raw.get("standins", []))))
    return Manifest(tasks)


NOT_SCANNED = {"tests", "course", "build", ".ci"}


def scanned_files(root: pathlib.Path = ROOT) -> list[str]:
    """Where solution regions live: the chapters' code. Tests and this tool only mention the
    markers (in strings and examples), so they are not scanned."""
    return [f for f in repo_files(root) if f.split("/", 1)[0] not in NOT_SCANNED]


def all_regions(root: pathlib.Path = ROOT) -> dict[str, R.Region]:
    """Every region of the working tree, by key."""
    found = R.scan(root, scanned_files(root))
    return {r.key: r for rs in found.values() for r in rs}


def chapters_with_regions(root: pathlib.Path = ROOT) -> list[Chapter]:
    chs = chapters(root)
    folders = {chapter_of(key.split("::")[0], chs).folder for key in all_regions(root) if chapter_of(key, chs)}
    return [c for c in chs if c.folder in folders]


def problems(manifest: Manifest, root: pathlib.Path = ROOT, folders: list[str] | None = None) -> list[str]:
    """Everything wrong between the manifest and the marked tree (empty list: consistent);
    `folders`: only these chapters."""
    out = []
    regions = all_regions(root)
    if folders is not None:
        regions = {k: r for k, r in regions.items() if k.split("/")[0] in folders}
        manifest = Manifest([t for t in manifest.tasks if t.chapter in folders])
    chs = chapters(root)
    seen: dict[str, str] = {}
    ids = set()
    for t in manifest.tasks:
        if t.id in ids:
            out.append(f"task id {t.id} appears twice")
        ids.add(t.id)
        ch = next((c for c in chs if c.folder == t.chapter), None)
        if ch is None or not t.id.startswith(ch.prefix + "_task"):
            out.append(f"{t.id}: id must be {ch.prefix if ch else '?'}_task<k> for its chapter {t.chapter}")
        if not t.regions:
            out.append(f"{t.id}: no regions")
        for key in t.regions:
            if key not in regions:
                out.append(f"{t.id}: region {key} is not marked in the tree")
            if key in seen:
                out.append(f"{t.id}: region {key} already belongs to {seen[key]}")
            seen[key] = t.id
            c = chapter_of(key, chs)
            if c is None or c.folder != t.chapter:
                out.append(f"{t.id}: region {key} is outside its chapter {t.chapter}")
        if not t.tests:
            out.append(f"{t.id}: no tests")
        if not t.fast:
            out.append(f"{t.id}: no fast tests for the CI proof")
        for test in t.fast:
            if not any(test == x or test.startswith((x + "::", x + "[")) for x in t.tests):
                out.append(f"{t.id}: fast test {test} is not one of its public/hidden tests")
        for test in t.tests:
            if not (root / test.split("::")[0]).is_file():
                out.append(f"{t.id}: test file of {test} does not exist")
        for path in t.standins:
            if not path.startswith("tests/course/") or not (root / path).is_file():
                out.append(f"{t.id}: stand-in {path} must be a file under tests/course/")
        for test in t.hidden:
            if "[" in test:
                out.append(f"{t.id}: hidden test {test} must name a whole function, class or file")
        for test in t.public:
            if test.split("::")[0].startswith("tests/course/"):
                out.append(f"{t.id}: public test {test} lives in tests/course/, which students never get")
    for key in sorted(set(regions) - set(seen)):
        out.append(f"region {key} belongs to no task (add it to course/tasks.toml)")
    return out
