"""No solution left in a student edition: its files must not hold the body of any region it
strips (normalised: comments and layout ignored), nor a known sibling of one — a copy of a
task's code elsewhere (a reference loop, a C++ binding, a later chapter's near-copy) that a
student could call instead of writing the task.

A task's `siblings` (course/tasks.toml) name them:
    "01_paged_attention/reference.py::reshape_and_cache"   this function must be stubbed in the
                                                          edition (a region of the task) or absent
    "re:index_copy_ \\( 0 , dst"                           no file may match this regex (over the
                                                          normalised text: tokens joined by spaces)
"""
from __future__ import annotations

import pathlib
import re

from course import regions as R
from course.layout import ROOT, repo_files
from course.manifest import Manifest

TEXT_SUFFIXES = {".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".md", ".ipynb", ".txt", ".toml"}
MIN_TOKENS = 12            # shorter bodies (`return a + b`) are too common to mean anything
TOKEN = re.compile(r"[A-Za-z_]\w*|\d+(?:\.\d+)?|\S")
STUB_SIGNS = ("NotImplementedError", "#error")


def normalise(text: str, suffix: str = ".py") -> str:
    """Tokens joined by single spaces, comments dropped (# for Python/markdown/notebooks, // and
    /* */ for C++). The same on both sides, so a copy re-indented or re-commented still matches."""
    if suffix in R.C_SUFFIXES:
        text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        text = re.sub(r"//[^\n]*", " ", text)
    else:
        text = re.sub(r"(?m)(^|\s)#(?!error)[^\n]*", " ", text)
    if suffix == ".ipynb":                         # JSON: source lines are quoted strings
        text = text.replace("\\n", "\n").replace('\\"', '"')
    return " ".join(TOKEN.findall(text))


def _function_body(text: str, path: str, name: str) -> str | None:
    """The source of function `name` (Python qualname, or a C++ function) in text, or None."""
    if path.endswith(".py"):
        import ast
        try:
            tree = R.parse_python(text)
        except SyntaxError:
            return None
        lines = text.splitlines()

        def find(body, parts):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == parts[0]:
                    return node if len(parts) == 1 else find(node.body, parts[1:])
            return None

        node = find(tree.body, name.split("."))
        return "\n".join(lines[node.lineno - 1: node.end_lineno]) if node is not None else None
    m = re.search(rf"(?m)^[^\n;{{}}]*\b{re.escape(name)}\s*\([^;{{]*\{{", text)
    if not m:
        return None
    depth, i = 0, m.end() - 1
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[m.start(): i + 1]
        i += 1
    return None


def leaks(tree: pathlib.Path, manifest: Manifest, stripped: list[str]) -> list[str]:
    """Every solution of a stripped task still present in `tree` (empty: none)."""
    tasks = [t for t in manifest.tasks if t.id in set(stripped)]
    needles: list[tuple[str, str]] = []            # (normalised body, what it is)
    for t in tasks:
        for key in t.regions:
            path = key.split("::")[0]
            ref = ROOT / path
            if not ref.is_file():
                continue
            body = R.bodies(ref.read_text(), path).get(key)
            if body is None:
                continue
            norm = normalise("\n".join(body), pathlib.PurePosixPath(path).suffix)
            if len(norm.split()) >= MIN_TOKENS:
                needles.append((norm, f"{t.id}'s region {key}"))
    out = []
    files = {}
    for rel in repo_files(tree):
        suffix = pathlib.PurePosixPath(rel).suffix
        if suffix not in TEXT_SUFFIXES:
            continue
        try:
            files[rel] = normalise((tree / rel).read_text(), suffix)
        except (UnicodeDecodeError, OSError):
            continue
    for norm, what in needles:
        for rel, text in files.items():
            if norm in text:
                out.append(f"{rel} holds the solution of {what}")
    for t in tasks:
        for sib in t.siblings:
            if sib.startswith("re:"):
                pattern = re.compile(sib[3:])
                out += [f"{rel} matches {t.id}'s known sibling /{sib[3:]}/" for rel, text in files.items()
                        if pattern.search(text)]
                continue
            path, _, name = sib.partition("::")
            p = tree / path
            if not p.is_file():
                continue
            body = _function_body(p.read_text(), path, name)
            if body is not None and not any(s in body for s in STUB_SIGNS):
                out.append(f"{sib}: a known sibling of {t.id} is left solved (make it a region of the task)")
    return out
