"""The student's process must not read the test's answers: an audit hook that stops it if it tries.

The judge (course/judge.py) takes from the student's process only what the task's code returned and
changed. But that process runs each test whole, its oracle included, so an expected value the test
computed BEFORE calling the task's code sits in the test's frame: code of the student's that reads it
(`sys._getframe(1).f_locals["expected"]`, `inspect.stack()`, a traceback's frames, `gc.get_referrers`)
and returns it would hand the judge correct outputs it never computed.

Copied into the student's grading workspace as `_course_judge_peek.py`; `install()` runs once, before
any of the student's code is imported. It adds a `sys.addaudithook` hook (PEP 578), which Python calls
on every frame-reaching operation — `sys._getframe`, `sys._current_frames`, a traceback's `tb_frame`,
a generator's `gi_frame` / `cr_frame` / `ag_frame`, `sys.settrace` / `setprofile`, `gc.get_objects` /
`get_referrers` / `get_referents` — and on every way to forge where code seems to come from (`compile`
under a library's file name, `code.__new__`, `function.__new__` on another's code, `marshal.loads`).
When the code that asked is the student's — directly, or through a library call whose job is to hand
out frames (`inspect.currentframe`, `traceback.walk_stack`, `logging.currentframe`) — the hook writes
one line saying so beside the process's log and ends the process with PEEK_EXIT: the judge reports
the test as failed for that reason (course/judge.py: record_student).

Why it cannot be switched off from inside: an audit hook cannot be removed, and this one holds
everything it uses in its closure (the functions it calls, the prefixes it compares, the report file
descriptor), bound before the student's code runs; no module global of it is read after install().
Reaching the closure needs `gc` or frames, which the hook stops first.

What stays out of its reach, and why it is acceptable: C++ code calling the C API (a kernel task's
code could call PyEval_GetFrame), and a Python signal handler installed at import (its frame argument
is not audited). Both are code a reviewer reads in seconds; the hook covers what a script could do.
"""
from __future__ import annotations

import os
import sys

PEEK_EXIT = 86                          # the exit status that means "stopped by this hook"

_FRAME_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile",
                           "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_FORGE_EVENTS = frozenset({"compile", "code.__new__", "function.__new__", "marshal.loads"})

# A library may look at frames for its own work when the student's code calls it (a namedtuple names
# its module, a logger finds its caller, matplotlib and torch find who warned): that hands the student
# nothing. These hand frames out — their whole purpose is to give the caller frames or their locals:
_FRAME_TOOLS = frozenset({"inspect", "pdb", "bdb", "cgitb", "trace", "_pytest", "pytest", "pluggy", "IPython",
                          "stack_data", "executing", "pydevd", "debugpy"})
_HANDS_OUT_FRAMES = frozenset({("logging", "currentframe"), ("logging", "<lambda>"),
                               ("traceback", "walk_stack"), ("traceback", "walk_tb"),
                               ("traceback", "__init__"), ("traceback", "extract")})


def install(trusted: list[str], library: list[str], report_path: str) -> None:
    """trusted: path prefixes of the grader's code (the tests, the grader's files in the workspace);
    library: prefixes of the interpreter's and the virtual environment's files. Everything else —
    the chapters, code compiled at run time, files the process wrote — is the student's.
    report_path: where the one line saying why goes (stderr is pytest's, captured and lost)."""
    getframe, write, exit_ = sys._getframe, os.write, os._exit
    try:
        report = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        report = 2
    modules = sys.modules
    trusted_prefixes = tuple(trusted)
    library_prefixes = tuple(p.rstrip("/") + "/" for p in library) + ("<frozen ",)
    TOOLS, HANDS_OUT, FRAME_EVENTS, FRAME_ATTRS, FORGE = (_FRAME_TOOLS, _HANDS_OUT_FRAMES, _FRAME_EVENTS,
                                                         _FRAME_ATTRS, _FORGE_EVENTS)
    busy = [False]                      # the hook's own getframe raises the event again

    def kind(filename: str) -> str:
        if filename.startswith(trusted_prefixes):
            return "grader"
        if filename.startswith(library_prefixes):
            return "library"
        return "student"

    def genuine_library(frame) -> str | None:
        """The top package of a library frame, if the frame really runs that module's code."""
        name = frame.f_globals.get("__name__")
        module = modules.get(name) if type(name) is str else None
        if module is None or frame.f_globals is not getattr(module, "__dict__", None):
            return None
        return name.partition(".")[0]

    def stop(why: str, frame) -> None:
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
        try:
            write(report, f"your code {why} at {where}\n".encode()[:1000])
        finally:
            exit_(PEEK_EXIT)

    def asked_by_student(caller) -> object | None:
        """The student's frame behind this operation, if the student asked for a frame: directly,
        through a library entry point that hands frames out, or through code that only passes for a
        library's (its frame does not run that module's own code)."""
        entry, frame = None, caller
        while frame is not None:
            k = kind(frame.f_code.co_filename)
            if k == "grader":
                return None             # the tests or the grader asked
            if k == "student":
                break
            entry, frame = frame, frame.f_back
        if frame is None:
            return None
        if entry is None:
            return frame                # the student's own code asked
        top = genuine_library(entry)
        if top is None or top in TOOLS or (entry.f_globals.get("__name__"), entry.f_code.co_name) in HANDS_OUT:
            return frame
        return None

    def hook(event, args):
        if event in FRAME_EVENTS:
            pass
        elif event == "object.__getattr__":
            if len(args) < 2 or args[1] not in FRAME_ATTRS:
                return
        elif event in FORGE:
            pass
        else:
            return
        if busy[0]:
            return
        busy[0] = True
        try:
            caller = getframe(1)
            if event in FORGE:
                # Code that claims to be a library's (or another's code under new globals): only the
                # student's own direct call matters; libraries (Triton, dataclasses) compile freely.
                if kind(caller.f_code.co_filename) != "student":
                    return
                filename = ""
                if event == "compile" and len(args) > 1:
                    filename = args[1] if type(args[1]) is str else ""
                elif event in ("code.__new__", "function.__new__") and args:
                    code = args[0]
                    filename = getattr(code, "co_filename", "") if event == "function.__new__" else \
                        (args[1] if len(args) > 1 and type(args[1]) is str else "")
                if event == "marshal.loads" or (filename and kind(filename) != "student"):
                    stop(f"made code that passes for another file's ({event})", caller)
                return
            student = asked_by_student(caller)
            if student is not None:
                what = args[1] if event == "object.__getattr__" else event
                stop(f"reached the running frames or objects of the process ({what})", student)
        finally:
            busy[0] = False

    sys.addaudithook(hook)


def library_prefixes() -> list[str]:
    """The interpreter's and the environment's files (never writable by the student's process)."""
    import site
    import sysconfig
    out = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            out.add(path)
    out.update(site.getsitepackages())
    return sorted({p for q in out for p in (q, os.path.realpath(q))})
