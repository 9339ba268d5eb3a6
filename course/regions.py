"""Solution regions: find them, check them, strip them, put them back.

A region is the code between two marker lines, nbgrader-style:

    Python                          C++ / CUDA
        ### BEGIN SOLUTION              // ### BEGIN SOLUTION
        ...the core...                  ...the core...
        ### END SOLUTION                // ### END SOLUTION

Stripping keeps both marker lines and replaces only what is between them with a stub that
names the task, so that (1) the student sees exactly where to write, (2) the stripped file is
itself a well-formed marked file, and (3) putting a region back is the inverse operation:
`fill(strip(text), bodies(text)) == text`, byte for byte. The proof (course/proof.py) relies
on (3) to restore one task at a time.

Stubs fail loudly but keep everything else importable/compilable:
  * Python: `raise NotImplementedError("<task>: <title>")` (a Triton kernel under the
    interpreter raises it too; compiled for a GPU it is a compile error naming the task);
  * C++/CUDA: `__trap()` in device code, and on the host a throw of a local type named after
    the task: the CPU emulator (kernels_cuda/emulator, g++) fails the launch with an error
    string naming that type; in a torch extension (the CPU kernel) std::terminate prints it
    and the grader turns the crash into a failed test.
    Code after a C++ region must not use names declared inside it (checked by compiling).
  * a C++ region of an OPTIONAL task in kernels_cpu/ (the performance track; `Task.error_stub`) is an `#error`
    instead: until it is written the kernel does not build, its `is_available()` says why, and
    the engine runs on torch ops as with cpu_kernels="off" — an optional task left undone
    never crashes the rest of the course.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import re
import threading

PY_BEGIN, PY_END = "### BEGIN SOLUTION", "### END SOLUTION"
C_BEGIN, C_END = "// ### BEGIN SOLUTION", "// ### END SOLUTION"
C_SUFFIXES = {".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"}
SUFFIXES = {".py"} | C_SUFFIXES

# CPython 3.11's ast.parse is not thread-safe: two threads parsing at once can fail with
# "SystemError: AST constructor recursion depth mismatch" (the proof grades configurations in
# threads; seen in CI). Every parse of the course goes through here.
_AST_LOCK = threading.Lock()


def parse_python(text: str) -> ast.Module:
    with _AST_LOCK:
        return ast.parse(text)


class MarkerError(ValueError):
    """Markers that are unbalanced, nested, empty or outside a function."""


@dataclasses.dataclass(frozen=True)
class Region:
    path: str          # posix path relative to the repository root
    begin: int         # 0-based line index of the BEGIN marker
    end: int           # 0-based line index of the END marker
    indent: str        # the BEGIN marker's indentation (the stub gets it too)
    lang: str          # "py" or "c"
    function: str      # enclosing function (qualified name for Python)
    key: str           # stable id: "path::function" (+ "#2", "#3" for later regions of one function)

    @property
    def num_lines(self) -> int:
        return self.end - self.begin - 1


def language(path: str | pathlib.Path) -> str | None:
    suffix = pathlib.PurePath(path).suffix
    if suffix == ".py":
        return "py"
    if suffix in C_SUFFIXES:
        return "c"
    return None


def _markers(lang: str) -> tuple[str, str]:
    return (PY_BEGIN, PY_END) if lang == "py" else (C_BEGIN, C_END)


def _is_marker(line: str, marker: str) -> bool:
    return line.strip() == marker


def _py_functions(text: str, path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function, 1-based lines."""
    try:
        tree = parse_python(text)
    except SyntaxError as e:
        raise MarkerError(f"{path}: does not parse: {e}") from e
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((child.lineno, child.end_lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


_C_CALL = re.compile(r"([A-Za-z_]\w*)\s*\(")


def _c_function(lines: list[str], begin: int) -> str:
    """Name of the C/C++ function a region sits in: the nearest unindented line above it that
    declares `name(` (macros such as __launch_bounds__ are skipped)."""
    for i in range(begin - 1, -1, -1):
        line = lines[i]
        if not line or line[0].isspace() or line.startswith(("//", "#", "}", "template")):
            continue
        names = [n for n in _C_CALL.findall(line) if not n.startswith("__")]
        if names:
            return names[-1]
    return "?"


def find_regions(text: str, path: str) -> list[Region]:
    """Every region of one file, in order. Raises MarkerError on malformed markers."""
    lang = language(path)
    if lang is None:
        return []
    begin_marker, end_marker = _markers(lang)
    lines = text.splitlines()
    spans, start = [], None
    for i, line in enumerate(lines):
        if _is_marker(line, begin_marker):
            if start is not None:
                raise MarkerError(f"{path}:{i + 1}: BEGIN SOLUTION inside the region opened at line {start + 1} (nested)")
            start = i
        elif _is_marker(line, end_marker):
            if start is None:
                raise MarkerError(f"{path}:{i + 1}: END SOLUTION without a BEGIN SOLUTION")
            if i == start + 1:
                raise MarkerError(f"{path}:{i + 1}: empty region")
            spans.append((start, i))
            start = None
        elif (lang == "py" and "BEGIN SOLUTION" in line and line.strip().startswith("#")
              and line.strip() != begin_marker and line.strip().lstrip("#").strip() == "BEGIN SOLUTION"):
            raise MarkerError(f"{path}:{i + 1}: malformed marker {line.strip()!r} (write {begin_marker!r})")
    if start is not None:
        raise MarkerError(f"{path}:{start + 1}: BEGIN SOLUTION never closed")
    functions = _py_functions(text, path) if lang == "py" and spans else []
    regions, seen = [], {}
    for b, e in spans:
        indent = lines[b][: len(lines[b]) - len(lines[b].lstrip())]
        if lines[e][: len(lines[e]) - len(lines[e].lstrip())] != indent:
            raise MarkerError(f"{path}:{e + 1}: END SOLUTION is not indented like its BEGIN (line {b + 1})")
        if lang == "py":
            inside = [f for f in functions if f[0] < b + 1 and b + 2 <= f[1]]   # END may follow the last statement
            if not inside:
                raise MarkerError(f"{path}:{b + 1}: a region must be inside a function body")
            function = max(inside, key=lambda f: f[0])[2]
        else:
            if not indent:
                raise MarkerError(f"{path}:{b + 1}: a C++ region must be inside a function body (indented)")
            function = _c_function(lines, b)
        n = seen[function] = seen.get(function, 0) + 1
        key = f"{path}::{function}" + (f"#{n}" if n > 1 else "")
        regions.append(Region(path, b, e, indent, lang, function, key))
    return regions


def stub_lines(region: Region, task_id: str, title: str, optional: bool = False) -> list[str]:
    """What a stripped region holds: a stub that fails loudly and names the task."""
    message = f"{task_id}: {title}"
    ind = region.indent
    if region.lang == "py":
        return [f"{ind}raise NotImplementedError({json.dumps(message, ensure_ascii=False)})"]
    tag = re.sub(r"\W", "_", task_id)
    comment = message.replace("*/", "* /").replace("\n", " ")
    if optional:
        text = comment.replace("\\", "/").replace('"', "'")
        return [f'{ind}#error "{text} -- not implemented yet (performance track: until it is, this kernel does not '
                f'build and the engine runs on torch ops)"']
    return [
        f"{ind}{{  // NotImplementedError — {comment}",
        "#if defined(__CUDA_ARCH__)",
        f"{ind}  __trap();",
        "#else",
        f"{ind}  struct {tag}_NotImplementedError {{}};   // std::terminate prints this name",
        f"{ind}  throw {tag}_NotImplementedError{{}};",
        "#endif",
        f"{ind}}}",
    ]


def _split_keep_end(text: str) -> tuple[list[str], bool]:
    return text.splitlines(), text.endswith("\n")


def render(text: str, path: str, stubs: dict[str, list[str]]) -> str:
    """`text` with the body of every region whose key is in `stubs` replaced by its stub lines
    (markers kept). Regions not named are left as they are."""
    regions = find_regions(text, path)
    lines, trailing = _split_keep_end(text)
    for region in reversed(regions):
        if region.key in stubs:
            lines[region.begin + 1: region.end] = stubs[region.key]
    return "\n".join(lines) + ("\n" if trailing else "")


def bodies(text: str, path: str) -> dict[str, list[str]]:
    """The lines between the markers of every region, by key."""
    lines = text.splitlines()
    return {r.key: lines[r.begin + 1: r.end] for r in find_regions(text, path)}


def fill(text: str, path: str, solution_bodies: dict[str, list[str]]) -> str:
    """The inverse of stripping: put `solution_bodies` back into the regions they name."""
    return render(text, path, solution_bodies)


def strip(text: str, path: str, task_of: dict[str, tuple], keys: set[str] | None = None) -> str:
    """Replace regions (all, or those in `keys`) by stubs; task_of[key] = (task id, title) or
    (task id, title, optional)."""
    stubs = {}
    for region in find_regions(text, path):
        if keys is not None and region.key not in keys:
            continue
        task_id, title, *rest = task_of.get(region.key, ("unassigned", region.function))
        stubs[region.key] = stub_lines(region, task_id, title, bool(rest and rest[0]))
    return render(text, path, stubs)


def scan(root: pathlib.Path, paths: list[str]) -> dict[str, list[Region]]:
    """Regions of every listed file that has any (paths relative to root)."""
    out = {}
    for rel in paths:
        if language(rel) is None:
            continue
        p = root / rel
        try:
            text = p.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        if "BEGIN SOLUTION" not in text:
            continue
        regions = find_regions(text, rel)
        if regions:
            out[rel] = regions
    return out
