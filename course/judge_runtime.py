"""The judge's runtime: record a student's process, replay it in the judge's (course/judge.py says why).

Copied into every grading workspace as `_course_judge.py` and loaded by the grader plugin in both
processes; it imports only the standard library (torch and numpy when they are already imported).

A task's BOUNDARY is the code the student writes: the functions that hold its regions (a Triton
kernel: its launches; a C++ kernel: the calls into the library built from it, `loaders`). An import
hook decorates them (an AST rewrite at import: decorators keep line numbers and catch every
reference to the function, even one taken at import time).

record (the student's process): a boundary call runs the student's code, then logs
    * before the call, the state of every object reachable from its arguments that the log has not
      shown yet or that changed since (only to tell the judge which of its objects are which);
    * after the call, the state of every object reachable from its arguments and its result that
      is new or changed (tensors: the bytes that changed), the global random generators' states,
      and the result or the exception.
replay (the judge's process, with the reference and the task's regions stubbed): a boundary call
runs nothing of the student's; it takes the next event of its stream, binds the judge's own
argument objects to the student's (by position: the same test made them), applies the logged
changes to the judge's objects and returns the logged result (or raises the logged exception).
The test's assertions, its oracle and every other function run in the judge's process.

What the student's process can do to the judge's: claim outputs. It cannot make the judge run
anything of its own: the log is JSON and raw bytes; objects are rebuilt only as instances of the
judge's own classes (allowed modules) with their attributes set (never one that shadows a method or
a property); an update reaches only objects that crossed the boundary (or were reachable from an
argument); exceptions are rebuilt from allowed classes, others become RuntimeError.
"""
from __future__ import annotations

import ast
import base64
import builtins
import collections
import enum
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import io
import json
import math
import operator
import os
import pathlib
import random
import re
import sys
import threading
import traceback
import types
import zlib

MODE = os.environ.get("COURSE_JUDGE_MODE", "")           # "record" | "replay" | "" (off)
DEBUG = bool(os.environ.get("COURSE_JUDGE_DEBUG"))
TESTS_DIR = os.path.realpath(os.environ.get("COURSE_TESTS_DIR", os.path.join(os.getcwd(), "tests"))) + os.sep


def from_tests(fn) -> bool:
    """A function (or a bound method) of the tests: a callback the task's code may call."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    return code is not None and os.path.realpath(code.co_filename).startswith(TESTS_DIR)
DECORATOR = "__course_judge_boundary__"
CHUNK = 4096                                              # tensors: the unit of a change sent
MAX_EVENTS_BYTES = 8 << 30                                # the judge reads no more of a log than this


class JudgeError(BaseException):
    """The replay cannot go on: the student's process did not produce what the judge's test needs.
    A BaseException, not an AssertionError: a test that expects an exception (`pytest.raises(...)`,
    `except Exception`) must never take the judge's refusal for the student's exception."""


class _Missing:
    pass


def _open_regular(path):
    """A file of the student's process, opened only if it is a regular file (not a symlink to a
    file of the judge's, not a FIFO that would block the judge); None otherwise."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


MISSING = _Missing()


def qualname_of(obj) -> str | None:
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<" in qual:
        return None
    return f"{mod}:{qual}"


def class_name(t) -> str:
    """'module:Qual.name' of a class, local classes included (the judge matches its own by it)."""
    return f"{getattr(t, '__module__', '?')}:{getattr(t, '__qualname__', getattr(t, '__name__', '?'))}"


def _lookup(path: str):
    mod, _, qual = path.partition(":")
    obj = sys.modules.get(mod)
    if obj is None:
        obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------------------- boundary


def _is_triton_fn(fn) -> bool:
    return type(fn).__name__ in ("JITFunction", "InterpretedFunction", "Autotuner", "Heuristics") \
        or (hasattr(fn, "fn") and hasattr(fn, "__getitem__") and "triton" in type(fn).__module__)


class TritonBoundary:
    """A Triton kernel whose launches are boundary calls: `kernel[grid](*args)`, `kernel.run(...)`."""

    def __init__(self, key: str, fn):
        self._key, self._fn = key, fn

    def __getitem__(self, grid):
        fn = self._fn

        def launch(*args, **kwargs):
            return RUNTIME.call(self._key, lambda *a, **k: fn[grid](*a, **k), args, kwargs, result=False,
                                pointers=POINTER_TABLES)
        return launch

    def run(self, *args, **kwargs):
        return RUNTIME.call(self._key, self._fn.run, args, kwargs, result=False, pointers=POINTER_TABLES)

    def __call__(self, *args, **kwargs):          # a device-function call from another kernel
        return self._fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fn, name)


def boundary(key: str, loader: dict | None = None):
    """The decorator the import hook puts on every boundary function."""
    def deco(fn):
        if not MODE:
            return fn
        if loader is not None:
            @functools.wraps(fn)
            def load(*args, **kwargs):
                return RUNTIME.load(key, loader, fn, args, kwargs)
            return load
        if _is_triton_fn(fn):
            return TritonBoundary(key, fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return RUNTIME.call(key, fn, args, kwargs)
        wrapper.__course_boundary__ = key
        return wrapper
    return deco


_TRITON_DECORATORS = ("jit", "autotune", "heuristics")


def decorate_source(source: str, filename: str, targets: dict[str, dict | None], module: str) -> tuple[ast.Module, set]:
    """The module's AST with `@__course_judge_boundary__(key)` on each target function
    ({qualname: loader spec or None}); a Triton kernel gets it outermost (it wraps the kernel
    object), every other function innermost (it wraps the plain function, under @property,
    @staticmethod, @functools.cache...)."""
    tree = ast.parse(source, filename)
    found = set()

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = prefix + node.name
                if qual in targets and not isinstance(node, ast.ClassDef):
                    spec = targets[qual]
                    args = [ast.Constant(f"{module}:{qual}")]
                    keywords = [] if spec is None else [ast.keyword("loader", ast.Constant(json.dumps(spec)))]
                    call = ast.Call(ast.Name(DECORATOR, ast.Load()), args, keywords)
                    ast.copy_location(call, node)
                    triton = any(any(w in ast.unparse(d) for w in _TRITON_DECORATORS) for d in node.decorator_list)
                    if triton:
                        node.decorator_list.insert(0, call)
                    else:
                        node.decorator_list.append(call)
                    found.add(qual)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, qual + ".")
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body, prefix)
                visit(getattr(node, "orelse", []), prefix)

    visit(tree.body, "")
    if found:
        # The decorator by name, imported where the module runs (also as __main__, `python -m`):
        # after the docstring and the __future__ imports, on line 1 (no line number moves).
        at = 0
        for i, node in enumerate(tree.body):
            if (i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)) or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                at = i + 1
        imp = ast.ImportFrom(module="_course_judge", names=[ast.alias(name="_decorator_for", asname=DECORATOR)], level=0)
        ast.copy_location(imp, tree.body[at] if at < len(tree.body) else tree.body[-1])
        tree.body.insert(at, imp)
    ast.fix_missing_locations(tree)
    return tree, found


class BoundaryLoader(importlib.abc.Loader):
    def __init__(self, inner, fullname: str, targets: dict[str, dict | None]):
        self.inner, self.fullname, self.targets = inner, fullname, targets

    def create_module(self, spec):
        return self.inner.create_module(spec) if hasattr(self.inner, "create_module") else None

    def get_code(self, fullname=None):
        path = self.inner.get_filename(self.fullname) if hasattr(self.inner, "get_filename") else None
        source = pathlib.Path(path).read_text()
        tree, found = decorate_source(source, path, self.targets, self.fullname)
        missing = set(self.targets) - found
        if missing:
            RUNTIME.notes.append(f"{self.fullname}: boundary functions not found: {sorted(missing)}")
        return compile(tree, path, "exec", dont_inherit=True)

    def get_source(self, fullname=None):
        return self.inner.get_source(self.fullname)

    def get_filename(self, fullname=None):
        return self.inner.get_filename(self.fullname)

    def is_package(self, fullname=None):
        return self.inner.is_package(self.fullname)

    def exec_module(self, module):
        exec(self.get_code(), module.__dict__)


def _decorator_for(key: str, loader: str | None = None):
    return boundary(key, json.loads(loader) if loader else None)


SPEC_CHECK = None        # the grader plugin's refusal of the reference (a spec -> raise ImportError)


class BoundaryFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: modules holding boundary functions load through BoundaryLoader."""
    _course_delegating = True

    def __init__(self, modules: dict[str, dict[str, dict | None]]):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "_course_delegating", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if SPEC_CHECK is not None:
                    SPEC_CHECK(fullname, spec)
                if spec.origin and spec.origin.endswith(".py") and spec.loader is not None:
                    spec.loader = BoundaryLoader(spec.loader, fullname, self.modules[fullname])
                return spec
        return None


def install(spec: dict) -> None:
    """spec: {"functions": {module: [qualname, ...]}, "loaders": {module: {qualname: loader spec}}}."""
    modules: dict[str, dict[str, dict | None]] = {}
    for mod, quals in spec.get("functions", {}).items():
        for q in quals:
            modules.setdefault(mod, {})[q] = None
    for mod, quals in spec.get("loaders", {}).items():
        for q, lspec in quals.items():
            modules.setdefault(mod, {})[q] = lspec
    sys.meta_path.insert(0, BoundaryFinder(modules))


# ------------------------------------------------------------------------------------ the encoder


def _torch():
    return sys.modules.get("torch")


def _np():
    return sys.modules.get("numpy")


def storage_bytes(st):
    """A writable uint8 numpy view of a torch UntypedStorage."""
    torch = _torch()
    t = torch.empty(0, dtype=torch.uint8)
    t.set_(st, 0, (st.nbytes(),), (1,))
    return t.numpy()


_LOCK_TYPES = {type(threading.Lock()): "Lock", type(threading.RLock()): "RLock"}


ID_LOW, ID_HIGH = 1 << 20, 1 << 48        # where CPython's id()s (addresses) fall
BIG_STORAGE = 1 << 20                     # bytes: above this, a storage is re-read only when written


def _snapshot(obj):
    """What an object holds, by identity, for the objects whose state is only that (a plain object's
    attributes, a list's, dict's or set's items): the same snapshot means the same state, so an
    unchanged object costs one comparison, not an encoding. None: no snapshot (tensors, storages,
    arrays, generators: their state is read every time)."""
    t = type(obj)
    if t is list or t is collections.deque:
        return ((), tuple(obj))
    if t is dict:
        return (tuple(obj), tuple(obj.values()))
    if t is set:
        return ((), tuple(obj))
    torch = _torch()
    if torch is not None and isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.Generator)):
        return None
    d = getattr(obj, "__dict__", None)
    if type(d) is dict and t.__module__ not in _NO_SNAPSHOT and not isinstance(obj, _SNAPSHOT_EXCLUDED):
        if isinstance(obj, (list, dict, set, collections.deque)):
            return None
        if any(getattr(k, "__slots__", None) for k in t.__mro__[:-1]):
            return None
        return (tuple(d), tuple(d.values()))
    return None


_NO_SNAPSHOT = ("random", "numpy.random", "torch")
_SNAPSHOT_EXCLUDED = (random.Random, BaseException, types.MethodType, functools.partial)


def _same(a, b) -> bool:
    """Snapshots are (keys, items): the same keys, and the same objects in every place."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(map(operator.is_, a[1], b[1]))


class Encoder:
    """The student's side: tags objects and encodes their state, reporting only what is new or
    changed since it was last reported."""

    def __init__(self, blobs):
        self.blobs = blobs                   # BlobWriter
        self.tag_of: dict = {}               # id(obj) or ("st", cdata) -> tag
        self.keep: dict = {}                 # tag -> obj (keeps ids valid)
        self.last: dict = {}                 # tag -> last state reported
        self.last_bytes: dict = {}           # storage / ndarray tag -> numpy copy of its last bytes sent
        self.next_tag = 1
        self.callables: dict = {}            # code object -> a function of the tests met in a walk
        self.methods: dict = {}              # code object -> a method of a class of the tests met so far
        self._from_tests: dict = {}          # code object -> from_tests()
        self.snaps: dict = {}                # tag -> (identity snapshot of its contents, its children)
        self.storage_versions: dict = {}     # storage tag -> the tensors' versions when its bytes were last read
        self.root_storages: set = set()      # storage tags whose bytes are read after every call (arguments)
        self._children = None
        self.grad_tensors: dict = {}         # id -> tensors requiring grad met in a walk (autograd inputs)

    # ---- tags
    def _tag(self, key, obj) -> tuple[int, bool]:
        tag = self.tag_of.get(key)
        if tag is not None:
            return tag, False
        tag = self.next_tag
        self.next_tag += 1
        self.tag_of[key] = tag
        self.keep[tag] = obj
        return tag, True

    # ---- a walk
    def walk(self, roots, phase: str, fresh: set | None = None, also: list | None = None):
        """Encode `roots`; returns (encoded roots, {tag: state} reported, {tag: data}) and the set of
        tags first seen in this walk. phase "pre": state only (no bytes); "post": with bytes.
        also: (tag, object) pairs to visit besides what the roots reach — after a call, everything
        the call could reach before it: an object the call changed and then let go of (a finished
        request dropped from the scheduler's lists) is still the test's."""
        self._stack, self._seen, self._new = [], set(), set()
        if also:
            for tag, obj in also:
                if tag not in self._seen:
                    self._seen.add(tag)
                    self._stack.append((tag, obj))
        self._states, self._data = {}, {}
        self._phase, self._fresh = phase, fresh or set()
        self._ids: list[dict] = []
        self._versions: dict = {}
        encoded = self.enc(roots)
        computed = []
        stack, seen, snaps = self._stack, self._seen, self.snaps
        visited = self.visited = []
        while stack:
            tag, obj = stack.pop()
            visited.append((tag, obj))
            if type(obj) in _FUNCTION_TYPES:           # a callback, also under an object unchanged since
                self._note_callable(obj)                # its last walk (whose state is not computed again)
            snap = _snapshot(obj)
            cached = snaps.get(tag) if snap is not None else None
            if cached is not None and _same(snap, cached[0]):
                for child in cached[1]:                  # unchanged: only its children to visit
                    if child[0] not in seen:
                        seen.add(child[0])
                        stack.append(child)
                continue
            self._children = []
            state = self.state(tag, obj)
            if snap is not None:
                snaps[tag] = (snap, self._children)
            self._children = None
            computed.append((tag, state))
        # An int that is the id() of one of the objects shown (a dict keyed by id(request)) is that
        # object's id in the judge's process too: {"id": tag}. Every other int stays an int.
        for box in self._ids:
            tag = self.tag_of.get(box["i"])
            if tag is not None:
                del box["i"]
                box["id"] = tag
        for tag, state in computed:
            if tag in self._new or self.last.get(tag) != state:
                self._states[str(tag)] = state
                self.last[tag] = state
        return encoded, self._states, self._data, self._new

    def ref(self, key, obj):
        tag, new = self._tag(key, obj)
        if new:
            self._new.add(tag)
        if self._children is not None:
            self._children.append((tag, obj))
        if tag not in self._seen:
            self._seen.add(tag)
            self._stack.append((tag, obj))
        return {"r": tag}

    def enc(self, v):
        t = type(v)
        if t is int and ID_LOW <= v < ID_HIGH:      # perhaps an id(): decided when the walk ends
            box = {"i": v}
            self._ids.append(box)
            return box
        if v is None or t is bool or t is int or t is str:
            return v
        if t is float:
            return v if math.isfinite(v) else {"f": repr(v)}
        if t is tuple:
            return {"t": [self.enc(x) for x in v]}
        if t is bytes:
            return {"b": base64.b64encode(v).decode()}
        if t is complex:
            return {"c": [self.enc(v.real), self.enc(v.imag)]}
        if isinstance(v, enum.Enum):
            q = qualname_of(t)
            if q:
                return {"e": [q, v.name]}
        if isinstance(v, tuple) and hasattr(t, "_fields") and qualname_of(t):
            return {"nt": qualname_of(t), "v": [self.enc(x) for x in v]}
        torch = _torch()
        if torch is not None:
            if t is torch.dtype:
                return {"dt": str(v).removeprefix("torch.")}
            if t is torch.device:
                return {"dev": str(v)}
            if t is torch.Size:
                return {"sz": list(v)}
            if isinstance(v, torch.Tensor):
                if v.requires_grad:
                    self.grad_tensors.setdefault(id(v), v)
                return self.ref(id(v), v)
            if isinstance(v, torch.UntypedStorage):
                return self.ref(("st", v._cdata), v)
        np = _np()
        if np is not None:
            if isinstance(v, np.dtype):
                return {"npdt": v.str}
            if isinstance(v, np.generic):
                return {"nps": [v.dtype.str, self.enc(v.item())]}
        if t is slice:
            return {"sl": [self.enc(v.start), self.enc(v.stop), self.enc(v.step)]}
        if t is range:
            return {"rg": [v.start, v.stop, v.step]}
        if v is Ellipsis:
            return {"ell": 1}
        if t is frozenset:
            return {"fs": [self.enc(x) for x in v]}
        if isinstance(v, pathlib.PurePath):
            return {"path": str(v)}
        if isinstance(v, (types.FunctionType, types.MethodType)) and from_tests(v):
            self._note_callable(v)
            return self.ref(id(v), v)
        if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)):
            g = self._global(v)
            if g is not None:
                return {"g": g}
        if isinstance(v, TritonBoundary):                # a kernel of the task: the judge's is the same name
            return {"g": v._key}
        inner = getattr(v, "fn", None)                   # another Triton kernel, by its module's name for it
        if _is_triton_fn(v) and inner is not None and qualname_of(inner):
            try:
                if _lookup(qualname_of(inner)) is v:
                    return {"g": qualname_of(inner)}
            except Exception:                            # noqa: BLE001
                pass
        owner = getattr(v, "__objclass__", None)          # a method of a C type: Tensor.view
        if owner is not None and isinstance(getattr(v, "__name__", None), str):
            q = qualname_of(owner)
            try:
                if q and getattr(_lookup(q), v.__name__) is v:
                    return {"g": f"{q}.{v.__name__}"}
            except Exception:                      # noqa: BLE001
                pass
        return self.ref(id(v), v)

    @staticmethod
    def _global(v):
        if isinstance(v, types.ModuleType):
            return v.__name__ + ":"
        q = qualname_of(v)
        if q is None:
            return None
        try:
            return q if _lookup(q) is v else None
        except Exception:                # noqa: BLE001 — not reachable by name: not a global
            return None

    def _dict_attrs(self, obj) -> dict:
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict):
            return {}
        return {k: self.enc(v) for k, v in d.items() if isinstance(k, str)}

    def _slots(self, obj) -> dict:
        out = {}
        for klass in type(obj).__mro__:
            for name in getattr(klass, "__slots__", ()) if isinstance(getattr(klass, "__slots__", ()), (tuple, list)) else ():
                if name in ("__dict__", "__weakref__") or name in out:
                    continue
                try:
                    out[name] = self.enc(object.__getattribute__(obj, name))
                except AttributeError:
                    pass
        return out

    def state(self, tag, obj) -> dict:
        torch, np = _torch(), _np()
        t = type(obj)
        cls = class_name(t)
        if torch is not None and isinstance(obj, torch.UntypedStorage):
            if obj.device.type != "cpu":
                return {"k": "opaque", "c": "torch:UntypedStorage"}
            self._storage_data(tag, obj, lambda: storage_bytes(obj))
            return {"k": "storage", "n": obj.nbytes()}
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                return {"k": "meta", "dt": str(obj.dtype).removeprefix("torch."), "sz": list(obj.shape),
                        "str": list(obj.stride())}
            if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized:
                return {"k": "opaque", "c": cls}
            st = obj.untyped_storage()
            sref = self.ref(("st", st._cdata), st)
            try:
                version = obj._version
            except RuntimeError:                 # an inference tensor has no version counter
                version = None
            self._versions.setdefault(sref["r"], []).append(version)
            return {"k": "tensor", "st": sref, "dt": str(obj.dtype).removeprefix("torch."),
                    "sz": list(obj.shape), "str": list(obj.stride()), "off": obj.storage_offset(),
                    "rg": bool(obj.requires_grad), "par": isinstance(obj, torch.nn.Parameter)}
        if np is not None and isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                return {"k": "ndo", "sh": list(obj.shape), "v": [self.enc(x) for x in obj.ravel().tolist()]}
            raw = np.ascontiguousarray(obj).view(np.uint8).reshape(-1)
            self._storage_data(tag, obj, lambda: raw)
            return {"k": "nd", "dt": obj.dtype.str, "sh": list(obj.shape), "crc": zlib.crc32(raw.data)}
        if t in _LOCK_TYPES:
            return {"k": "lock", "c": _LOCK_TYPES[t]}
        if isinstance(obj, BaseException):
            mro = [q for q in (qualname_of(k) for k in t.__mro__) if q]
            return {"k": "exc", "c": cls, "mro": mro, "a": self.enc(obj.args), "d": self._dict_attrs(obj)}
        if isinstance(obj, types.MethodType):
            return {"k": "meth", "self": self.enc(obj.__self__), "n": obj.__func__.__name__}
        if isinstance(obj, functools.partial):
            return {"k": "partial", "f": self.enc(obj.func), "a": self.enc(tuple(obj.args)),
                    "kw": {k: self.enc(v) for k, v in obj.keywords.items()}}
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type)):
            return {"k": "func", "q": getattr(obj, "__qualname__", repr(obj))}
        if isinstance(obj, random.Random):
            return {"k": "pyrng", "s": self.enc(obj.getstate()), "c": cls}
        if torch is not None and isinstance(obj, torch.Generator):
            if obj.device.type != "cpu":
                return {"k": "opaque", "c": cls}
            return {"k": "tgen", "s": self.blobs.put(obj.get_state().numpy().tobytes())}
        if np is not None and isinstance(obj, np.random.Generator):
            return {"k": "npgen", "s": json.loads(json.dumps(obj.bit_generator.state, default=int))}
        if isinstance(obj, collections.deque):
            return {"k": "deque", "v": [self.enc(x) for x in obj], "ml": obj.maxlen, "c": cls,
                    "d": self._dict_attrs(obj)}
        if isinstance(obj, dict):
            out = {"k": "dict", "c": cls, "items": [[self.enc(k), self.enc(v)] for k, v in obj.items()],
                   "d": self._dict_attrs(obj)}
            if isinstance(obj, collections.defaultdict):
                out["df"] = self.enc(obj.default_factory)
            return out
        if isinstance(obj, list):
            return {"k": "list", "c": cls, "v": [self.enc(x) for x in obj], "d": self._dict_attrs(obj)}
        if isinstance(obj, (set, frozenset)):
            return {"k": "set", "c": cls, "v": [self.enc(x) for x in obj], "d": self._dict_attrs(obj)}
        if isinstance(obj, bytearray):
            return {"k": "ba", "b": base64.b64encode(bytes(obj)).decode()}
        if type(obj).__name__ == "count" and type(obj).__module__ == "itertools":
            return {"k": "count", "r": repr(obj)}
        if hasattr(obj, "__dict__") or any(getattr(k, "__slots__", None) for k in t.__mro__[:-1]):
            self._watch_methods(t)
            return {"k": "obj", "c": cls, "d": self._dict_attrs(obj), "s": self._slots(obj)}
        return {"k": "opaque", "c": cls}

    def _note_callable(self, fn) -> None:
        code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
        if code is None:
            return
        ours = self._from_tests.get(code)
        if ours is None:
            ours = self._from_tests[code] = from_tests(fn)
        if ours:
            self.callables.setdefault(code, fn)

    def _watch_methods(self, t) -> None:
        """An object of a class of the tests (a fake connector): its methods are callbacks too."""
        for klass in t.__mro__[:-1]:
            for v in vars(klass).values():
                if isinstance(v, types.FunctionType) and not v.__name__.startswith("__") and from_tests(v):
                    self.methods.setdefault(v.__code__, TestMethod(v.__name__))

    def _storage_data(self, tag, obj, as_bytes):
        """Bytes of a storage / array, after a call: all of them the first time (or when the object
        was first seen in this call: the judge's copy may hold other bytes, torch.empty's), else the
        chunks that changed since they were last sent. A big storage that is no argument of the call
        is read again only when a tensor over it has a new version (torch counts in-place writes)."""
        if self._phase != "post":
            return
        np = _np()
        torch = _torch()
        if torch is not None and isinstance(obj, torch.UntypedStorage) and tag in self.last_bytes \
                and tag not in self._fresh and tag not in self.root_storages and obj.nbytes() > BIG_STORAGE:
            versions = self._versions.get(tag, ())
            versions = sorted(versions) if all(v is not None for v in versions) else None
            if versions and versions == self.storage_versions.get(tag):
                return
            self.storage_versions[tag] = versions
        now = as_bytes()
        last = self.last_bytes.get(tag)
        if last is None or tag in self._fresh or last.shape != now.shape:
            self._data[str(tag)] = {"full": self.blobs.put(now.tobytes()), "n": int(now.size)}
        else:
            n = now.size
            if n:
                whole = (n // CHUNK) * CHUNK
                changed = []
                if whole:
                    diff = (now[:whole].reshape(-1, CHUNK) != last[:whole].reshape(-1, CHUNK)).any(axis=1)
                    changed = [int(i) * CHUNK for i in np.nonzero(diff)[0]]
                if whole < n and not np.array_equal(now[whole:], last[whole:]):
                    changed.append(whole)
                if changed:
                    self._data[str(tag)] = {"chunks": [[off, self.blobs.put(now[off:off + CHUNK].tobytes())]
                                                       for off in changed], "n": int(n)}
        self.last_bytes[tag] = now.copy()


class BlobWriter:
    def __init__(self, path):
        self.f = open(path, "ab")
        self.pos = self.f.tell()

    def put(self, data: bytes) -> list[int]:
        off = self.pos
        self.f.write(data)
        self.pos += len(data)
        return [off, len(data)]

    def flush(self):
        self.f.flush()


# ------------------------------------------------------------------------------------ the mirror

ALLOWED_MODULES = ("torch", "numpy", "collections", "builtins", "math", "itertools", "functools", "enum", "typing",
                   "dataclasses", "transformers", "tokenizers", "safetensors", "queue", "threading", "hashlib",
                   "operator", "pathlib", "decimal", "fractions", "datetime", "heapq", "bisect", "random",
                   "_collections", "_thread", "_functools", "abc")
# Functions named in a log are rebuilt (they may be called) only from the chapters and these.
SAFE_FUNCTION_ROOTS = {"builtins", "math", "operator", "torch", "numpy", "collections", "itertools", "functools",
                       "heapq", "bisect", "hashlib", "enum", "dataclasses", "random", "_operator", "_functools",
                       "_collections", "_heapq", "_bisect", "_hashlib"}
# ... never any of these, in whatever module.
_DANGEROUS = re.compile(r"(?i)(load|save|compile|library|hub|jit|package|serializ|pickle|marshal|exec|eval|system|"
                        r"popen|spawn|fork|subprocess|cpp_extension|from_pretrained|from_file|fromfile|tofile|"
                        r"open|import|ctypes|_ops|ops:|classes|remove|unlink|rmtree|chmod|chown|rename|write)")
DENIED_BUILTINS = {"eval", "exec", "compile", "open", "__import__", "getattr", "setattr", "delattr", "globals",
                   "locals", "vars", "breakpoint", "input", "exit", "quit", "help", "memoryview", "__build_class__",
                   "classmethod", "staticmethod", "property", "super", "type", "object"}


class Placeholder:
    """What the judge's process holds for an object of the student's it cannot rebuild."""

    def __init__(self, what: str):
        object.__setattr__(self, "_what", what)

    def __repr__(self):
        return f"<the student's {self._what}, not rebuilt by the judge>"

    def __getattr__(self, name):
        raise JudgeError(f"the test used {self._what} of the student's process ({name}), which the judge "
                         "cannot rebuild")

    def __call__(self, *a, **k):
        raise JudgeError(f"the test called {self._what} of the student's process, which the judge cannot rebuild")


class Attrs:
    """An object of a class the judge does not have (a class the student added): its attributes only."""

    def __init__(self, cls: str):
        object.__setattr__(self, "_cls", cls)

    def __repr__(self):
        return f"<{self._cls} of the student's process>"


class Mirror:
    """The judge's side: which of its objects are which of the student's, and the student's changes
    applied to them."""

    def __init__(self, blobs_path: str, allowed_packages: set[str]):
        self.chapters = set(allowed_packages)
        self.obj_of: dict = {}                # tag -> the judge's object
        self.tag_of: dict = {}                # id(obj) / ("st", cdata) -> tag
        self.blobs_path = blobs_path
        self._blobs = None
        self.allowed = set(allowed_packages) | set(ALLOWED_MODULES)
        self.notes: list[str] = []
        self.last_state: dict = {}           # tag (str) -> the last state the student's process reported

    # ---- blobs
    def blob(self, ref) -> bytes:
        if self._blobs is None:
            self._blobs = _open_regular(self.blobs_path)
            if self._blobs is None:
                raise JudgeError("the student's process wrote a broken log (no blob file)")
        off, n = int(ref[0]), int(ref[1])
        size = os.fstat(self._blobs.fileno()).st_size
        if off < 0 or n < 0 or off + n > size:
            raise JudgeError("the student's process wrote a broken log (a blob outside its file)")
        self._blobs.seek(off)
        return self._blobs.read(n)

    # ---- names
    def allowed_module(self, mod: str) -> bool:
        return mod.split(".")[0] in self.allowed

    def resolve(self, path: str):
        """A class or function by name — the judge's own. A function (something the judge's code
        might call: a default factory, a callback attribute) only from the chapters or the plain
        computing parts of the allowed libraries: never one that loads, compiles, runs or reaches
        files (torch.load, cpp_extension, numpy.load, from_pretrained...)."""
        mod, _, qual = path.partition(":")
        if not self.allowed_module(mod):
            raise JudgeError(f"the student's process named {path}: not something the judge rebuilds")
        if mod == "builtins" and qual.split(".")[0] in DENIED_BUILTINS:
            raise JudgeError(f"the student's process named builtins.{qual}: refused")
        if not qual:
            raise JudgeError(f"the student's process named the module {mod}: refused")
        if not self.chapter_module(mod) and _DANGEROUS.search(path):
            raise JudgeError(f"the student's process named {path}: refused")
        obj = _lookup(path)
        if callable(obj) and not isinstance(obj, type) and not self.chapter_module(mod) \
                and mod.split(".")[0] not in SAFE_FUNCTION_ROOTS:
            raise JudgeError(f"the student's process named the function {path}: refused")
        return obj

    def chapter_module(self, mod: str) -> bool:
        return mod.split(".")[0] in self.chapters

    def _bind(self, tag, obj, key=None):
        old = self.obj_of.get(tag, MISSING)
        if old is not MISSING and old is not obj:
            self.tag_of.pop(self._key(old), None)        # a shell replaced (a tensor over its storage)
        self.obj_of[tag] = obj
        self.tag_of[key if key is not None else self._key(obj)] = tag

    def _bound_to(self, key, value) -> bool:
        """Is `value` (under `key`) already one of the student's objects? (An id of an object the
        mirror no longer holds may have been reused: that is no binding.)"""
        tag = self.tag_of.get(key)
        if tag is None:
            return False
        other = self.obj_of.get(tag, MISSING)
        if other is value or (key != id(value) and other is not MISSING and self._key(other) == key):
            return True
        del self.tag_of[key]
        return False

    @staticmethod
    def _key(obj):
        torch = _torch()
        if torch is not None and isinstance(obj, torch.UntypedStorage):
            return ("st", obj._cdata)
        return id(obj)

    # ---- binding (before a call): the judge's argument objects are the student's ones
    def bind_roots(self, value, enc, states: dict):
        """Walk the judge's `value` alongside the student's encoding of it (iteratively: a linked
        list of blocks is deep), binding each of the student's tags to the judge's object at the
        same place."""
        for t, st in states.items():
            if isinstance(st, dict):
                self.last_state[str(t)] = st
        # Tags the student's process showed for the first time: each is one of the judge's objects
        # reachable from the arguments, found where the student's process saw it (through objects it
        # had shown before, by their last known state). Nothing new: nothing to look for.
        unbound = {int(t) for t in states if str(t).isdigit() and int(t) not in self.obj_of}
        visited = set()
        stack = [(value, enc)]
        while stack and unbound:
            value, enc = stack.pop()
            if not isinstance(enc, dict):
                continue
            if "r" in enc:
                tag = enc["r"]
                if not isinstance(tag, int) or tag in visited:
                    continue
                visited.add(tag)
                known = self.obj_of.get(tag, MISSING)
                if known is not MISSING:
                    if known is not value:
                        self.notes.append(f"an argument is not the object the student's process passed "
                                          f"({type(value).__name__})")
                        continue
                else:
                    key = self._key(value)
                    if self._bound_to(key, value):
                        self.notes.append(f"an argument ({type(value).__name__}) stands for two objects of the "
                                          "student's")
                        continue
                    self._bind(tag, value, key)
                    unbound.discard(tag)
                state = self.last_state.get(str(tag))
                if isinstance(state, dict):
                    stack.extend(self._children(value, state))
            elif "t" in enc and isinstance(value, tuple) and isinstance(enc["t"], list):
                stack.extend(zip(value, enc["t"]))
            elif "nt" in enc and isinstance(value, tuple) and isinstance(enc.get("v"), list):
                stack.extend(zip(value, enc["v"]))

    def _children(self, obj, state: dict):
        kind = state.get("k")
        torch = _torch()
        out = []
        if kind == "tensor" and torch is not None and isinstance(obj, torch.Tensor):
            out.append((obj.untyped_storage(), state.get("st")))
        elif kind in ("list", "deque") and isinstance(obj, (list, collections.deque)) and isinstance(state.get("v"), list):
            out.extend(zip(obj, state["v"]))
        elif kind == "dict" and isinstance(obj, dict) and isinstance(state.get("items"), list):
            items = list(obj.items())
            for i, pair in enumerate(state["items"]):
                if not (isinstance(pair, list) and len(pair) == 2):
                    continue
                ke, ve = pair
                if isinstance(ke, dict) and ("r" in ke or "id" in ke):
                    if i < len(items):
                        out += [(items[i][0], ke), (items[i][1], ve)]
                    continue
                try:
                    k = self.decode(ke)
                    if k in obj:
                        out.append((obj[k], ve))
                except Exception:               # noqa: BLE001 — an unhashable or unknown key: not bound
                    pass
        elif kind in ("obj", "exc"):
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict) and isinstance(state.get("d"), dict):
                out.extend((d[name], e) for name, e in state["d"].items() if name in d)
            for name, e in (state.get("s") or {}).items():
                try:
                    out.append((object.__getattribute__(obj, name), e))
                except (AttributeError, TypeError):
                    pass
        elif kind == "meth" and isinstance(obj, types.MethodType):
            out.append((obj.__self__, state.get("self")))
        elif kind == "partial" and isinstance(obj, functools.partial):
            out.append((obj.args, state.get("a")))
        return out

    # ---- decoding values
    def decode(self, e):
        if e is None or isinstance(e, (bool, int, float, str)):
            return e
        if isinstance(e, list):
            raise JudgeError("the student's process wrote a broken log (a bare list)")
        if not isinstance(e, dict) or len(e) == 0:
            raise JudgeError("the student's process wrote a broken log")
        if "r" in e:
            tag = e["r"]
            obj = self.obj_of.get(tag, MISSING)
            if obj is MISSING:
                obj = Placeholder(f"object #{tag}")
                self.notes.append(f"the student's object #{tag} was never shown to the judge")
                if os.environ.get("COURSE_JUDGE_DEBUG"):
                    print(f"JUDGE-DEBUG missing #{tag}; notes: {self.notes[-8:]}", file=sys.stderr)
            return obj
        if "t" in e:
            return tuple(self.decode(x) for x in e["t"])
        if "i" in e:
            return int(e["i"])
        if "id" in e:
            obj = self.obj_of.get(e["id"], MISSING)
            return id(obj) if obj is not MISSING else -int(e["id"])     # an id no object has here
        if "f" in e:
            return float(e["f"])
        if "b" in e:
            return base64.b64decode(e["b"])
        if "c" in e and len(e) == 1:
            return complex(self.decode(e["c"][0]), self.decode(e["c"][1]))
        if "e" in e:
            cls = self.resolve(e["e"][0])
            if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
                raise JudgeError(f"{e['e'][0]} is not an enum")
            return cls[e["e"][1]]
        if "nt" in e:
            cls = self.resolve(e["nt"])
            if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
                raise JudgeError(f"{e['nt']} is not a named tuple")
            return cls(*[self.decode(x) for x in e["v"]])
        torch, np = _torch(), _np()
        if "dt" in e:
            dt = getattr(torch, str(e["dt"]), None)
            if not isinstance(dt, torch.dtype):
                raise JudgeError(f"unknown dtype {e['dt']!r}")
            return dt
        if "dev" in e:
            return torch.device(str(e["dev"]))
        if "sz" in e:
            return torch.Size([int(x) for x in e["sz"]])
        if "npdt" in e:
            return np.dtype(str(e["npdt"]))
        if "nps" in e:
            return np.dtype(str(e["nps"][0])).type(self.decode(e["nps"][1]))
        if "sl" in e:
            return slice(*[self.decode(x) for x in e["sl"]])
        if "rg" in e:
            return range(*[int(x) for x in e["rg"]])
        if "ell" in e:
            return Ellipsis
        if "fs" in e:
            return frozenset(self.decode(x) for x in e["fs"])
        if "path" in e:
            return pathlib.Path(str(e["path"]))
        if "g" in e:
            path = str(e["g"])
            try:
                if path.endswith(":"):
                    mod = path[:-1]
                    if not self.allowed_module(mod):
                        raise JudgeError(f"the student's process named the module {mod}: refused")
                    return importlib.import_module(mod)
                return self.resolve(path)
            except (JudgeError, ImportError, AttributeError):
                # Never rebuilt (another module's function: os.system, time.monotonic): a stand-in that
                # fails the test if the test ever uses it.
                return Placeholder(path)
        raise JudgeError(f"the student's process wrote a value the judge does not know: {sorted(e)[:3]}")

    # ---- applying a call's changes
    def apply(self, states: dict, data: dict) -> None:
        torch, np = _torch(), _np()
        for t, st in states.items():
            if isinstance(st, dict):
                self.last_state[str(t)] = st
        new = {}
        for stag, state in states.items():
            tag = int(stag)
            if tag not in self.obj_of:
                obj = self.shell(state)
                new[tag] = obj
                self._bind(tag, obj, self._key(obj) if torch is not None and isinstance(obj, torch.UntypedStorage) else None)
        # storages (and their bytes) first, then tensors over them, then other objects, then containers
        order = {"storage": 0, "nd": 0, "tensor": 1, "meth": 2, "partial": 2, "ndo": 2, "obj": 3, "exc": 3,
                 "pyrng": 3, "tgen": 3, "npgen": 3, "count": 3, "lock": 3, "func": 3, "opaque": 3, "ba": 3,
                 "set": 4, "list": 4, "deque": 4, "dict": 5}
        for stag, state in sorted(states.items(), key=lambda kv: order.get(kv[1].get("k"), 9)):
            tag = int(stag)
            try:
                self.fill(tag, self.obj_of[tag], state, tag in new, data.get(stag))
            except JudgeError:
                raise
            except Exception as e:               # noqa: BLE001 — the student's state does not fit the judge's object
                self.notes.append(f"the student's object #{tag} ({state.get('c') or state.get('k')}) could not be "
                                  f"updated: {type(e).__name__}: {e}")
        for stag, d in data.items():
            if stag not in states:
                tag = int(stag)
                obj = self.obj_of.get(tag)
                if obj is not None:
                    self.fill_bytes(obj, d)

    def shell(self, state: dict):
        kind = state.get("k")
        torch, np = _torch(), _np()
        if kind == "storage":
            return torch.UntypedStorage(int(state["n"]))
        if kind == "tensor":
            return torch.empty(0)                # re-pointed at its storage by fill()
        if kind == "meta":
            return torch.empty_strided([int(x) for x in state["sz"]], [int(x) for x in state["str"]],
                                       dtype=self.decode({"dt": state["dt"]}), device="meta")
        if kind == "nd":
            return np.zeros(0, dtype=np.uint8)   # replaced in fill() (arrays cannot change shape)
        if kind == "list":
            return self._instance(state, list)
        if kind == "dict":
            if "df" in state:
                return collections.defaultdict()
            return self._instance(state, dict)
        if kind == "set":
            return self._instance(state, set)
        if kind == "deque":
            return collections.deque(maxlen=state.get("ml"))
        if kind == "ba":
            return bytearray()
        if kind == "lock":
            return threading.RLock() if state.get("c") == "RLock" else threading.Lock()
        if kind == "pyrng":
            return random.Random()
        if kind == "tgen":
            return torch.Generator()
        if kind == "npgen":
            return np.random.default_rng()
        if kind == "count":
            m = re.fullmatch(r"count\((-?\d+)(?:, (-?\d+))?\)", str(state.get("r", "")))
            import itertools
            return itertools.count(int(m.group(1)), int(m.group(2) or 1)) if m else Placeholder("itertools.count")
        if kind == "exc":
            return self._exception(state)
        if kind == "obj":
            return self._instance(state, None)
        if kind == "meth":
            return _Pending()
        if kind == "partial":
            return _Pending()
        if kind == "ndo":
            return _Pending()
        return Placeholder(str(state.get("c") or kind))

    def _instance(self, state, base):
        path = state.get("c")
        if not path or path in ("builtins:list", "builtins:dict", "builtins:set", "builtins:frozenset"):
            return base() if base is not None else Attrs("object")
        try:
            cls = self.resolve(path)
        except JudgeError:                         # a class of a module the judge does not rebuild from
            return base() if base is not None else Placeholder(path)
        except Exception:                          # noqa: BLE001 — a class the judge does not have
            return base() if base is not None else Attrs(path)
        if not isinstance(cls, type) or issubclass(cls, type) or (base is not None and not issubclass(cls, base)) \
                or issubclass(cls, BaseException):
            return Placeholder(path)
        new = cls.__new__
        if base is not None:
            if cls.__module__ in ("collections", "builtins"):
                return cls()
            return base.__new__(cls)
        if new is object.__new__ or getattr(new, "__self__", None) is object:
            return object.__new__(cls)
        try:
            torch = _torch()
            if torch is not None and issubclass(cls, torch.nn.Module):
                return object.__new__(cls)
        except TypeError:
            pass
        return Placeholder(path)

    def _exception(self, state):
        for path in state.get("mro", []) or [state.get("c")]:
            try:
                cls = self.resolve(path)
            except Exception:                       # noqa: BLE001
                continue
            if isinstance(cls, type) and issubclass(cls, Exception):
                exc = cls.__new__(cls)
                return exc
        return RuntimeError.__new__(RuntimeError)

    def _settable(self, obj, name: str) -> bool:
        if not isinstance(name, str) or name.startswith("__"):
            return False
        attr = inspect.getattr_static(type(obj), name, MISSING)
        if attr is MISSING:
            return True
        return not (callable(attr) or hasattr(type(attr), "__get__") or hasattr(type(attr), "__set__"))

    def _set_attrs(self, obj, d: dict, slots: dict, replace: bool):
        od = getattr(obj, "__dict__", None)
        if isinstance(od, dict):
            new = {}
            for name, e in d.items():
                if self._settable(obj, name):
                    new[name] = self.decode(e)
            if replace:
                for name in [k for k in od if isinstance(k, str) and k not in d and self._settable(obj, k)]:
                    del od[name]
            od.update(new)
        for name, e in slots.items():
            descr = inspect.getattr_static(type(obj), name, MISSING)
            if type(descr).__name__ == "member_descriptor":
                descr.__set__(obj, self.decode(e))

    def fill(self, tag, obj, state: dict, is_new: bool, data):
        kind = state.get("k")
        torch, np = _torch(), _np()
        if kind == "storage":
            if not (torch is not None and isinstance(obj, torch.UntypedStorage)):
                return
            n = int(state["n"])
            if obj.nbytes() != n:
                obj.resize_(n)
            if data is not None:
                self.fill_bytes(obj, data)
        elif kind == "tensor":
            st = self.decode(state["st"])
            if not isinstance(st, torch.UntypedStorage) or not isinstance(obj, torch.Tensor):
                raise JudgeError("the student's process claimed a tensor without a storage")
            dt = self.decode({"dt": state["dt"]})
            size, stride, off = [int(x) for x in state["sz"]], [int(x) for x in state["str"]], int(state["off"])
            self._check_view(st, dt, size, stride, off)
            if is_new:
                with torch.no_grad():
                    t = torch.empty(0, dtype=dt).set_(st, off, size, stride)
                if state.get("par"):
                    t = torch.nn.Parameter(t, requires_grad=bool(state.get("rg")))
                elif state.get("rg") and (dt.is_floating_point or dt.is_complex):
                    t.requires_grad_(True)
                self._bind(tag, t)
            elif (obj.dtype != dt or list(obj.shape) != size or list(obj.stride()) != stride
                  or obj.storage_offset() != off or obj.untyped_storage()._cdata != st._cdata):
                if obj.dtype != dt:
                    raise JudgeError("the student's process changed a tensor's dtype in place")
                with torch.no_grad():
                    obj.set_(st, off, size, stride)
        elif kind == "nd":
            if data is None:
                return
            dtype = np.dtype(str(state["dt"]))
            if dtype.hasobject:
                raise JudgeError("refused: an object array as bytes")
            shape = [int(x) for x in state["sh"]]
            raw = self.bytes_of(data, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, obj, dtype)
            arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
            if is_new:
                self._bind(tag, arr.copy())
            elif isinstance(obj, np.ndarray) and list(obj.shape) == shape and obj.dtype == dtype:
                obj[...] = arr
            else:
                raise JudgeError("the student's process changed an array's shape in place")
        elif kind == "ndo":
            arr = np.empty(len(state["v"]), dtype=object)
            for i, x in enumerate(state["v"]):
                arr[i] = self.decode(x)
            self._bind(tag, arr.reshape([int(x) for x in state["sh"]]))
        elif kind == "list":
            if isinstance(obj, list):
                obj[:] = [self.decode(x) for x in state["v"]]
                self._set_attrs(obj, state.get("d", {}), {}, False)
        elif kind == "deque":
            if isinstance(obj, collections.deque):
                obj.clear()
                obj.extend(self.decode(x) for x in state["v"])
        elif kind == "set":
            if isinstance(obj, set):
                obj.clear()
                obj.update(self.decode(x) for x in state["v"])
        elif kind == "dict":
            if isinstance(obj, dict):
                items = [(self.decode(k), self.decode(v)) for k, v in state["items"]]
                obj.clear()
                obj.update(items)
                if isinstance(obj, collections.defaultdict) and "df" in state:
                    df = self.decode(state["df"])
                    # called by the judge's own code on a missing key: a type, or a chapter function
                    ok = df is None or isinstance(df, type) or (
                        isinstance(df, types.FunctionType) and self.chapter_module(getattr(df, "__module__", "") or ""))
                    obj.default_factory = df if ok else None
                self._set_attrs(obj, state.get("d", {}), {}, False)
        elif kind == "ba":
            if isinstance(obj, bytearray):
                obj[:] = base64.b64decode(state["b"])
        elif kind == "obj":
            if isinstance(obj, (Placeholder,)):
                return
            if isinstance(obj, Attrs):
                for name, e in state.get("d", {}).items():
                    if isinstance(name, str) and not name.startswith("__"):
                        object.__setattr__(obj, name, self.decode(e))
                return
            if not is_new and class_name(type(obj)) != state.get("c"):
                self.notes.append(f"the student's object #{tag} is a {state.get('c')}, the judge's a "
                                  f"{class_name(type(obj))}: not updated")
                return
            self._set_attrs(obj, state.get("d", {}), state.get("s", {}), replace=not is_new)
        elif kind == "exc":
            if isinstance(obj, BaseException):
                args = self.decode(state.get("a", {"t": []}))
                obj.args = args if isinstance(args, tuple) else (args,)
                self._set_attrs(obj, state.get("d", {}), {}, False)
        elif kind == "pyrng":
            if isinstance(obj, random.Random):
                obj.setstate(_tuplify(self.decode(state["s"])))
        elif kind == "tgen":
            if isinstance(obj, torch.Generator):
                obj.set_state(torch.frombuffer(bytearray(self.blob(state["s"])), dtype=torch.uint8))
        elif kind == "npgen":
            if isinstance(obj, np.random.Generator):
                obj.bit_generator.state = state["s"]
        elif kind == "meth":
            target = self.decode(state["self"])
            name = str(state.get("n", ""))
            try:
                if not name.isidentifier() or name.startswith("_") or isinstance(target, (Placeholder, Attrs)) \
                        or not self.chapter_module(type(target).__module__ or ""):
                    raise AttributeError(name)     # a public method of a chapter object, nothing else
                self._bind(tag, getattr(target, name))
            except Exception:                      # noqa: BLE001
                self._bind(tag, Placeholder(f"method {name}"))
        elif kind == "partial":
            f = self.decode(state["f"])
            args = self.decode(state["a"])
            kw = {k: self.decode(v) for k, v in state.get("kw", {}).items()}
            # only a chapter's function with its arguments bound: nothing else the judge might call
            ok = isinstance(f, types.FunctionType) and self.chapter_module(getattr(f, "__module__", "") or "") \
                and isinstance(args, tuple)
            self._bind(tag, functools.partial(f, *args, **kw) if ok else Placeholder("functools.partial"))

    def _check_view(self, st, dt, size, stride, off):
        torch = _torch()
        item = torch.empty(0, dtype=dt).element_size()
        if any(s < 0 for s in size) or any(s < 0 for s in stride) or off < 0:
            raise JudgeError("the student's process claimed a tensor with a negative size or stride")
        if all(size):
            last = off + sum((s - 1) * st_ for s, st_ in zip(size, stride))
            if (last + 1) * item > st.nbytes():
                raise JudgeError("the student's process claimed a tensor larger than its storage")

    def bytes_of(self, data, n, obj, dtype) -> bytes:
        if "full" in data:
            raw = self.blob(data["full"])
            if len(raw) != n:
                raise JudgeError("the student's process claimed an array of another size")
            return raw
        base = bytearray(obj.tobytes()) if hasattr(obj, "tobytes") else bytearray(n)
        if len(base) != n:
            raise JudgeError("the student's process changed an array's size")
        for off, ref in data.get("chunks", []):
            chunk = self.blob(ref)
            off = int(off)
            if off < 0 or off + len(chunk) > n:
                raise JudgeError("the student's process wrote a change outside an array")
            base[off:off + len(chunk)] = chunk
        return bytes(base)

    def fill_bytes(self, obj, data):
        torch = _torch()
        if torch is None or not isinstance(obj, torch.UntypedStorage):
            return
        view = storage_bytes(obj)
        n = view.size
        if "full" in data:
            raw = self.blob(data["full"])
            if len(raw) != n:
                raise JudgeError("the student's process claimed a storage of another size")
            view[:] = _np().frombuffer(raw, dtype=_np().uint8)
            return
        for off, ref in data.get("chunks", []):
            chunk = self.blob(ref)
            off = int(off)
            if off < 0 or off + len(chunk) > n:
                raise JudgeError("the student's process wrote a change outside a storage")
            view[off:off + len(chunk)] = _np().frombuffer(chunk, dtype=_np().uint8)


class _Pending:
    pass


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ------------------------------------------------------------------------------- the judge's clock
# A test that times the task's code (a timeout must take at least its timeout, a fast path must be
# fast) times the student's process: in the judge's, the clocks move on by the time each call took
# there (the replay itself takes next to nothing). Only forward, never back.

_real_perf_counter = __import__("time").perf_counter
_CLOCK = {"offset": 0.0}


def _advance_clock(seconds) -> None:
    if isinstance(seconds, (int, float)) and 0 < seconds < 24 * 3600:
        _CLOCK["offset"] += float(seconds)


def virtual_clocks() -> None:
    """The judge's process: time.time / monotonic / perf_counter (and their _ns) add the student's
    process's time spent in the task's code."""
    import time as _time
    for name in ("time", "monotonic", "perf_counter"):
        real = getattr(_time, name)
        setattr(_time, name, (lambda real: lambda: real() + _CLOCK["offset"])(real))
        real_ns = getattr(_time, name + "_ns")
        setattr(_time, name + "_ns", (lambda real_ns: lambda: real_ns() + int(_CLOCK["offset"] * 1e9))(real_ns))


# ------------------------------------------------------------------------------- global generators


def rng_states() -> dict:
    """The global generators' states, as comparable values."""
    out = {"random": random.getstate()}
    torch, np = _torch(), _np()
    if torch is not None:
        out["torch"] = torch.get_rng_state().numpy().tobytes()
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = (name, keys.tobytes(), int(pos), int(has_gauss), float(gauss))
    return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch, np = _torch(), _np()
    if np is not None:
        np.random.seed(seed % (2 ** 32))
    if torch is not None:
        torch.manual_seed(seed)


# ------------------------------------------------------------------------------------ the runtime


class Runtime:
    def __init__(self):
        self.mode = ""                       # set by start_record / start_replay
        self.tls = threading.local()
        self.phase = "init"
        self.notes: list[str] = []
        self.lock = threading.RLock()
        self.thread_keys: dict = {}
        self.thread_counts: dict = {}
        self.log = None
        self.enc = None
        self.mirror = None
        self.streams: dict | None = None
        self.ends: dict = {}
        self.loaded: dict = {}               # loader calls already answered: their handle or error
        self.autoflush = False
        self.last_rng = None

    # ---- set-up
    def start_record(self, log_dir: str):
        self.mode = "record"
        os.makedirs(log_dir, exist_ok=True)
        self.log = open(os.path.join(log_dir, "events.jsonl"), "a", buffering=1 << 16)
        self.blobs = BlobWriter(os.path.join(log_dir, "blobs.bin"))
        self.enc = Encoder(self.blobs)

    def start_replay(self, log_dir: str, allowed_packages: set[str]):
        self.mode = "replay"
        self.log_dir = log_dir
        if not getattr(Runtime, "_clocks", False):
            Runtime._clocks = True
            virtual_clocks()
        self.mirror = Mirror(os.path.join(log_dir, "blobs.bin"), allowed_packages)

    def _load_streams(self):
        if self.streams is not None:
            return
        self.streams = {}
        path = os.path.join(self.log_dir, "events.jsonl")
        f = _open_regular(path)
        size = os.fstat(f.fileno()).st_size if f is not None else 0
        if size > MAX_EVENTS_BYTES:
            f.close()
            raise JudgeError(f"the student's process wrote a log of {size} bytes: more than the judge reads")
        if f is not None:
            with f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue                      # a line cut by a kill
                    if not isinstance(rec, dict) or not isinstance(rec.get("s"), str) or not isinstance(rec.get("e"), dict):
                        continue
                    ev = rec["e"]
                    if "end" in ev:
                        self.ends[rec["s"]] = ev
                        continue
                    self.streams.setdefault(rec["s"], collections.deque()).append(ev)

    def reset(self):
        """A test starts: forget which objects are which (both sides alike), keep the log."""
        if self.mode == "record" and self.enc is not None:
            self.enc = Encoder(self.blobs)
            self.last_rng = None
        elif self.mode == "replay" and self.mirror is not None:
            old = self.mirror
            self.mirror = Mirror(old.blobs_path, old.allowed)
            self.mirror._blobs = old._blobs

    # ---- streams
    def stream(self) -> str:
        t = threading.current_thread()
        if t is threading.main_thread():
            return self.phase
        key = getattr(t, "_course_stream", None)
        if key is not None:
            return key
        with self.lock:
            key = self.thread_keys.get(t)
            if key is None:
                base = re.sub(r"^Thread-\d+", "Thread", t.name)
                n = self.thread_counts.get((self.phase, base), 0)
                self.thread_counts[(self.phase, base)] = n + 1
                key = self.thread_keys[t] = f"{self.phase}|{base}#{n}"
            return key

    def set_phase(self, phase: str):
        self.phase = phase
        with self.lock:
            self.thread_keys.clear()
            self.thread_counts.clear()

    def end(self, nodeid: str, outcome: str, summary: str):
        if self.mode == "record" and self.log is not None:
            self._write(nodeid, {"end": outcome, "summary": summary[:500]})
            self.flush()

    def _write(self, stream: str, ev: dict):
        self.blobs.flush()                   # an event is never on disk before the bytes it names
        self.log.write(json.dumps({"s": stream, "e": ev}, allow_nan=True) + "\n")
        if self.autoflush:                   # a child process: it may be terminated at any time
            self.log.flush()

    def flush(self):
        if self.log is not None:
            self.log.flush()
            self.blobs.flush()

    def pending(self, stream: str) -> int:
        """Events of the student's process for `stream` the judge's test has not consumed."""
        if self.mode != "replay":
            return 0
        self._load_streams()
        return len(self.streams.get(stream, ()))

    # ---- calls
    def call(self, key, fn, args, kwargs, result: bool = True, pointers: list | None = None):
        tls = self.tls
        if getattr(tls, "depth", 0) or not self.mode:
            return fn(*args, **kwargs)
        tls.depth = 1
        try:
            if self.mode == "record":
                return self._record(key, fn, args, kwargs, result, pointers)
            return self._replay(key, args, kwargs, result, pointers)
        finally:
            tls.depth = 0

    def _roots(self, args, kwargs, pointers) -> tuple:
        """(args, kwargs as (name, value) pairs, the storages that raw pointers among the arguments
        point into: int arguments of a C function (`pointers`: their positions), or the values of
        small int64 tensors passed to a Triton kernel (a table of the caches' addresses))."""
        extra = []
        if pointers is POINTER_TABLES:
            torch = _torch()
            index = None
            for arg in list(args) + list(kwargs.values()):
                if isinstance(arg, torch.Tensor) and arg.dtype == torch.int64 and arg.device.type == "cpu" \
                        and 0 < arg.numel() <= 4096:
                    index = index or StorageIndex()
                    extra.append(tuple(index.find(int(v)) for v in arg.reshape(-1).tolist()))
        else:
            index = StorageIndex() if pointers else None
            for i in pointers or ():
                arg = args[i] if i < len(args) else None
                if type(arg).__module__ == "ctypes" and isinstance(getattr(arg, "value", None), int):
                    arg = arg.value                   # a c_void_p holding a tensor's data_ptr()
                found = index.find(arg) if isinstance(arg, int) and not isinstance(arg, bool) else None
                extra.append(found)
            # A pointer to a table of pointers (copy_blocks: the address of every layer's cache): the
            # memory the table points to is what the call writes.
            np = _np()
            for found in list(extra):
                if found is None or np is None:
                    continue
                raw = storage_bytes(found[0])
                if raw.size % 8 or raw.size > 32768:
                    extra.append(None)
                    continue
                extra.append(tuple(index.find(int(v)) for v in raw.view(np.int64).tolist()))
        if self.enc is not None:
            self.enc.root_storages = self._arg_storages(args, kwargs, extra)
        return (tuple(args), tuple(kwargs.items()), tuple(extra))

    def _arg_storages(self, args, kwargs, extra) -> set:
        """Tags of the storages of the call's tensor arguments (and of the tensors in its list,
        tuple and dict arguments, and of raw pointers' targets): their bytes are read after the call."""
        torch = _torch()
        if torch is None:
            return set()
        out = set()

        def add(t):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                st = t.untyped_storage()
                tag = self.enc.tag_of.get(("st", st._cdata))
                if tag is not None:
                    out.add(tag)
        for a in list(args) + list(kwargs.values()):
            add(a)
            if isinstance(a, (list, tuple)):
                for x in a:
                    add(x)
            elif isinstance(a, dict):
                for x in a.values():
                    add(x)
        for x in extra:
            for item in (x if isinstance(x, tuple) and x and isinstance(x[0], tuple) else (x,)):
                if isinstance(item, tuple) and item and isinstance(item[0], torch.UntypedStorage):
                    tag = self.enc.tag_of.get(("st", item[0]._cdata))
                    if tag is not None:
                        out.add(tag)
        return out

    def _record(self, key, fn, args, kwargs, result, pointers):
        """The student's side of a call. Nothing of the logging may reach the student's code: a
        failure to log is itself logged (the judge then fails the test, saying so) and the call
        goes on as if no grader were there."""
        stream = self.stream()
        try:
            with self.lock:
                roots = self._roots(args, kwargs, pointers)
                self.enc.callables, self.enc.grad_tensors = {}, {}
                pre_roots, pre_states, _, fresh = self.enc.walk(roots, "pre")
                reachable = self.enc.visited
                watched = dict(self.enc.callables)
                watched.update(self.enc.methods)
                watched.update(_test_function_modes())
                grad_inputs = list(self.enc.grad_tensors.values())
        except Exception as e:                 # noqa: BLE001 — the grader's failure, not the student's
            self._broken(stream, key, e)
            return fn(*args, **kwargs)
        exc = None
        calls: list = []
        prev = sys.getprofile()
        if watched:
            sys.setprofile(_callback_hook(watched, calls))
        t0 = _real_perf_counter()
        try:
            ret = fn(*args, **kwargs)
        except BaseException as e:          # noqa: BLE001 — logged, then raised on in the student's process
            exc, ret = e, None
        finally:
            if watched:
                sys.setprofile(prev)
        elapsed = _real_perf_counter() - t0
        grad = None
        try:
            if exc is None and result and grad_inputs:
                ret, grad = _record_autograd(key, ret, grad_inputs)
            self._log_call(stream, key, roots, ret, result, exc, calls, fresh, reachable, pre_roots, pre_states,
                           elapsed, grad)
        except Exception as e:                 # noqa: BLE001 — the grader's failure, not the student's
            self._broken(stream, key, e)
        if exc is not None:
            raise exc
        return ret

    def _broken(self, stream, key, error) -> None:
        try:
            with self.lock:
                self._write(stream, {"key": key, "broken": f"{type(error).__name__}: {error}"[:500]})
        except Exception:                      # noqa: BLE001
            pass

    def _log_call(self, stream, key, roots, ret, result, exc, calls, fresh, reachable, pre_roots, pre_states,
                  elapsed, grad):
        with self.lock:
            post_roots, post_states, data, _ = self.enc.walk(roots + (ret if result else None, exc, tuple(calls)),
                                                             "post", fresh, also=reachable)
            ev = {"key": key, "pre": {"roots": pre_roots, "states": pre_states},
                  "post": {"roots": post_roots, "states": post_states, "data": data}, "dur": round(elapsed, 6)}
            if grad is not None:
                ev["grad"] = [self.enc.enc(t) for t in grad]
            rng = rng_states()
            if rng != self.last_rng:
                ev["rng"] = self._enc_rng(rng)
                self.last_rng = rng
            if exc is not None:
                ev["raised"] = True
                ev["where"] = _where(exc)
            self._write(stream, ev)

    def _enc_rng(self, rng):
        out = {"random": self.enc.enc(rng["random"])}
        if "torch" in rng:
            out["torch"] = self.blobs.put(rng["torch"])
        if "numpy" in rng:
            name, keys, pos, has_gauss, gauss = rng["numpy"]
            out["numpy"] = [name, self.blobs.put(keys), pos, has_gauss, gauss]
        return out

    def _set_rng(self, rng):
        m = self.mirror
        if "random" in rng:
            random.setstate(_tuplify(m.decode(rng["random"])))
        torch, np = _torch(), _np()
        if "torch" in rng and torch is not None:
            torch.set_rng_state(torch.frombuffer(bytearray(m.blob(rng["torch"])), dtype=torch.uint8))
        if "numpy" in rng and np is not None:
            name, ref, pos, has_gauss, gauss = rng["numpy"]
            keys = np.frombuffer(m.blob(ref), dtype=np.uint32).copy()
            np.random.set_state((str(name), keys, int(pos), int(has_gauss), float(gauss)))

    def _replay(self, key, args, kwargs, result, pointers):
        self._load_streams()
        stream = self.stream()
        queue = self.streams.get(stream)
        m = self.mirror
        if not queue:
            phase = stream.split("|")[0]
            end = self.ends.get(phase)
            why = (f" (your process ended this test early: {end.get('end')}: {end.get('summary', '')})"
                   if end else "")
            raise JudgeError(f"the judge's test calls {_short(key)} here, but your process made no such call{why}")
        ev = queue.popleft()
        if "broken" in ev:
            raise JudgeError(f"the grader could not log your process's call of {_short(key)} "
                             f"({ev.get('broken')}): a grader's problem, please report it")
        _advance_clock(ev.get("dur"))
        if ev.get("key") != key:
            raise JudgeError(f"the judge's test calls {_short(key)} here, your process called "
                             f"{_short(str(ev.get('key')))}: the test ran differently in your process")
        roots = self._roots(args, kwargs, pointers)
        pre, post = ev.get("pre") or {}, ev.get("post") or {}
        if not isinstance(pre, dict) or not isinstance(post, dict):
            raise JudgeError("the student's process wrote a broken log")
        try:
            m.bind_roots(roots, pre.get("roots"), pre.get("states") or {})
        except JudgeError:
            raise
        except Exception as e:                      # noqa: BLE001
            raise JudgeError(f"the judge could not match its arguments of {_short(key)} to your process's: {e}") from e
        m.apply(post.get("states") or {}, post.get("data") or {})
        if DEBUG and m.notes:
            print(f"JUDGE-DEBUG after {_short(key)}: {m.notes}", file=sys.stderr)
            m.notes.clear()
        if ev.get("rng"):
            self._set_rng(ev["rng"])
        proots = post.get("roots")
        if not (isinstance(proots, dict) and isinstance(proots.get("t"), list) and len(proots["t"]) == 6):
            raise JudgeError("the student's process wrote a broken log (no result)")
        # The test's own functions the task's code called (a counting hash, a fake model): called
        # again here, in order, with what they were given, for what they do to the test's state.
        watched_here = bool(_test_function_modes())
        replayed = False
        for record in m.decode(proots["t"][5]) or ():
            if not (isinstance(record, tuple) and len(record) == 3):
                raise JudgeError("the student's process wrote a broken log (a callback)")
            cb, cargs, ckw = record
            if not isinstance(cargs, tuple) or not isinstance(ckw, tuple):
                raise JudgeError("the student's process wrote a broken log (a callback)")
            if cb == TORCH_FUNCTION:           # through the test's TorchFunctionMode, active here too
                func = cargs[0] if cargs else None
                if isinstance(func, Placeholder):  # a C-level callable the log could not name: no replay
                    continue
                if not watched_here:
                    raise JudgeError("the student's process claimed calls through a TorchFunctionMode the "
                                     "judge's test does not have")
                if not (callable(func) and _is_torch_callable(func)) or _DANGEROUS.search(
                        f"{getattr(func, '__module__', '')}:{getattr(func, '__qualname__', getattr(func, '__name__', ''))}"):
                    raise JudgeError("the student's process claimed a torch function call of something else")
                try:                              # on meta tensors: the mode sees the call, nothing is computed
                    func(*cargs[1:], **{str(k): v for k, v in ckw})
                except AssertionError:
                    raise
                except Exception:                 # noqa: BLE001 — an op without a meta kernel
                    pass
                continue
            if isinstance(cb, str) and cb.startswith(METHOD_MARK) and cargs:
                name = cb[len(METHOD_MARK):]
                cb = getattr(type(cargs[0]), name, None) if name.isidentifier() and not name.startswith("__") else None
                if not (isinstance(cb, types.FunctionType) and from_tests(cb)):
                    raise JudgeError("the student's process claimed a call of something that is not the test's")
            elif not (callable(cb) and from_tests(cb)):
                raise JudgeError("the student's process claimed a call of something that is not the test's")
            try:
                cb(*cargs, **{str(k): v for k, v in ckw})
            except Exception:                     # noqa: BLE001 — what it raised reached the task's
                pass                              # code there; what came of it is in the log
            replayed = True
        if replayed:
            # What a callback did to objects the log shows (a fake's own counters): as the student's
            # process left them — the log's state, not the log's state plus the callback once more.
            m.apply(post.get("states") or {}, post.get("data") or {})
        if ev.get("raised"):
            exc = m.decode(proots["t"][4])
            if not isinstance(exc, Exception):
                exc = RuntimeError(f"your code raised {type(exc).__name__}")
            where = ev.get("where")
            if isinstance(where, str) and where:
                try:                                # not a note: pytest.raises(match=) reads the notes too
                    exc._course_where = where[:300]
                except Exception:                   # noqa: BLE001
                    pass
            raise exc
        ret = m.decode(proots["t"][3]) if result else None
        if isinstance(ev.get("grad"), list) and result:
            ret = _replay_autograd(key, ret, [m.decode(e) for e in ev["grad"]])
        return ret

    # ---- autograd: the test's backward through the task's code
    def backward_event(self, key, grads) -> None:
        """The student's side: the gradients the task's code gave its inputs, logged where the test
        called backward."""
        stream = self.stream()
        with self.lock:
            roots, states, data, _ = self.enc.walk(tuple(grads), "post")
            self._write(stream, {"key": "backward:" + key, "post": {"roots": roots, "states": states, "data": data}})

    def backward_replay(self, key, n: int):
        self._load_streams()
        queue = self.streams.get(self.stream())
        if not queue:
            raise JudgeError(f"the judge's test backpropagates through {_short(key)} here, but your process did not")
        ev = queue.popleft()
        if ev.get("key") != "backward:" + key:
            raise JudgeError(f"the judge's test backpropagates through {_short(key)} here, your process did "
                             f"{_short(str(ev.get('key')))}")
        post = ev.get("post") or {}
        self.mirror.apply(post.get("states") or {}, post.get("data") or {})
        grads = self.mirror.decode(post.get("roots"))
        if not isinstance(grads, tuple) or len(grads) != n:
            raise JudgeError("the student's process wrote a broken log (gradients)")
        return grads


def _tensor_outputs(ret):
    """The tensors of a result that autograd tracks: a tensor, or a tuple / list of them (and other
    values); None when the result is of another shape."""
    torch = _torch()
    if isinstance(ret, torch.Tensor):
        return [ret] if ret.grad_fn is not None else []
    if isinstance(ret, (tuple, list)) and all(not isinstance(x, (tuple, list, dict)) for x in ret):
        return [x for x in ret if isinstance(x, torch.Tensor) and x.grad_fn is not None]
    return []


def _swap_outputs(ret, new: dict):
    torch = _torch()
    if isinstance(ret, torch.Tensor):
        return new.get(id(ret), ret)
    return type(ret)(new.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in ret)


def _record_autograd(key, ret, inputs):
    """The student's side: outputs the test may backpropagate through come back as outputs of a
    function whose backward runs the task's own graph and logs the gradients it gives the inputs."""
    torch = _torch()
    outs = _tensor_outputs(ret)
    if not outs:
        return ret, None

    class Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ins):
            return tuple(o.detach().clone() for o in outs)

        @staticmethod
        def backward(ctx, *grad_outs):
            grad_outs = [g if g is not None else torch.zeros_like(o) for g, o in zip(grad_outs, outs)]
            grads = torch.autograd.grad(outs, inputs, grad_outs, allow_unused=True, retain_graph=True)
            RUNTIME.backward_event(key, [g.detach() if g is not None else None for g in grads])
            return grads

    wrapped = Record.apply(*inputs)
    return _swap_outputs(ret, {id(o): w for o, w in zip(outs, wrapped)}), inputs


def _replay_autograd(key, ret, inputs):
    """The judge's side: the same outputs (the student's values), whose backward gives the inputs
    the gradients the student's process logged."""
    torch = _torch()
    outs = [x for x in ([ret] if isinstance(ret, torch.Tensor) else ret if isinstance(ret, (tuple, list)) else [])
            if isinstance(x, torch.Tensor) and x.requires_grad]
    if not outs or not all(isinstance(t, torch.Tensor) for t in inputs):
        return ret

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ins):
            return tuple(o.detach().clone() for o in outs)

        @staticmethod
        def backward(ctx, *grad_outs):
            return RUNTIME.backward_replay(key, len(inputs))

    wrapped = Replay.apply(*inputs)
    return _swap_outputs(ret, {id(o): w for o, w in zip(outs, wrapped)})


_FUNCTION_TYPES = (types.FunctionType, types.MethodType)
TORCH_FUNCTION = "__torch_function__"
METHOD_MARK = "__course_method__:"


class TestMethod(str):
    """A method of a class of the tests, called on its object (the first argument): logged by name,
    called in the judge's process on the judge's copy of the object."""
    def __new__(cls, name):
        return super().__new__(cls, METHOD_MARK + name)


def _is_torch_callable(func) -> bool:
    owner = getattr(func, "__objclass__", None)
    mod = getattr(owner, "__module__", None) if owner is not None else getattr(func, "__module__", None)
    return isinstance(mod, str) and mod.split(".")[0] == "torch"


def _test_function_modes() -> dict:
    """The tests' TorchFunctionModes active around the call (a mode counting the task's SDPA
    calls): {their handler's code: TORCH_FUNCTION}. Each torch function the task's code calls through
    one is called again in the judge's process, under the judge's own mode."""
    torch = _torch()
    if torch is None:
        return {}
    try:
        modes = torch.overrides._get_current_function_mode_stack()
    except Exception:                           # noqa: BLE001 — another torch
        return {}
    out = {}
    for mode in modes:
        handler = getattr(type(mode), "__torch_function__", None)
        if handler is not None and from_tests(handler):
            out[handler.__code__] = TORCH_FUNCTION
    return out


def _as_meta(x):
    """Tensors -> tensors of the same shape, stride and dtype on the meta device (no data): what a
    torch function call is given when the judge's process makes it again through a test's mode."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        try:
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
        except Exception:                        # noqa: BLE001
            return None
    if type(x) in (tuple, list):
        return type(x)(_as_meta(v) for v in x)
    return x


def _callback_hook(watched: dict, calls: list):
    """A profile function recording the outermost calls of the tests' functions `watched`
    ({code: function}) while the task's code runs: (function, positional args, keyword args).
    A test's TorchFunctionMode handler: (TORCH_FUNCTION, (the torch function, its args), its kwargs)."""
    active = [None]

    def hook(frame, event, arg):
        if event == "call":
            if active[0] is None:
                fn = watched.get(frame.f_code)
                if fn is TORCH_FUNCTION:
                    loc = frame.f_locals
                    names = frame.f_code.co_varnames
                    func, fargs, fkw = (loc.get(n) for n in names[1:2] + names[3:5])
                    calls.append((TORCH_FUNCTION, (func,) + _as_meta(tuple(fargs or ())),
                                  tuple((k, _as_meta(v)) for k, v in (fkw or {}).items())))
                    active[0] = frame
                elif fn is not None:
                    code = frame.f_code
                    names = code.co_varnames
                    loc = frame.f_locals
                    npos, nkw = code.co_argcount, code.co_kwonlyargcount
                    pos = [loc[n] for n in names[:npos] if n in loc]
                    i = npos + nkw
                    if code.co_flags & inspect.CO_VARARGS:
                        pos += list(loc.get(names[i], ()))
                        i += 1
                    kw = [(n, loc[n]) for n in names[npos:npos + nkw] if n in loc]
                    if code.co_flags & inspect.CO_VARKEYWORDS:
                        kw += list(loc.get(names[i], {}).items())
                    if isinstance(fn, types.MethodType):
                        pos = pos[1:]
                    calls.append((str(fn) if isinstance(fn, TestMethod) else fn, tuple(pos), tuple(kw)))
                    active[0] = frame
        elif event == "return" and frame is active[0]:
            active[0] = None
    return hook


def _short(key: str) -> str:
    return key.split(":", 1)[-1]


def _where(exc) -> str:
    """Where the student's code raised: the innermost frame of a chapter file."""
    tb = exc.__traceback__
    frames = traceback.extract_tb(tb) if tb is not None else []
    for fr in reversed(frames):
        if "_import" in fr.filename or re.search(r"/(0\d_[a-z_]+|kernels_cuda|kernels_cpu|model_executor)/", fr.filename):
            parts = pathlib.PurePath(fr.filename).parts
            if "_import" in parts:
                i = parts.index("_import")
                return "/".join(parts[i + 1:]) + f":{fr.lineno} in {fr.name}"
            return f"{pathlib.PurePath(fr.filename).name}:{fr.lineno} in {fr.name}"
    return ""


# --------------------------------------------------------------------------------- raw pointers


def _tensors_near(depth: int = 24):
    torch = _torch()
    seen = set()
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        for v in list(frame.f_locals.values()):
            for x in (v if isinstance(v, (list, tuple)) else (v,)):
                if torch is not None and isinstance(x, torch.Tensor) and id(x) not in seen:
                    seen.add(id(x))
                    yield x
        frame = frame.f_back


POINTER_TABLES = "pointer tables"


class StorageIndex:
    """Which tensor storage holds an address (a raw pointer of a C call, an entry of a pointer
    table): the tensors of the calling frames first, every live tensor if need be."""

    def __init__(self):
        self._near = None
        self._all = None

    @staticmethod
    def _build(tensors):
        import bisect
        spans = []
        for t in tensors:
            try:
                if t.device.type != "cpu":
                    continue
                st = t.untyped_storage()
                spans.append((st.data_ptr(), st.data_ptr() + max(1, st.nbytes()), st))
            except Exception:                     # noqa: BLE001 — a tensor without storage
                continue
        spans.sort(key=lambda x: x[0])
        return [s[0] for s in spans], spans, bisect

    def _lookup(self, table, address):
        starts, spans, bisect = table
        i = bisect.bisect_right(starts, address) - 1
        while i >= 0:
            lo, hi, st = spans[i]
            if lo <= address < hi:
                return st, address - lo
            if hi <= address and i > 0 and spans[i - 1][1] <= lo:
                break
            i -= 1
        return None

    def find(self, address: int):
        torch = _torch()
        if torch is None or not address:
            return None
        if self._near is None:
            self._near = self._build(_tensors_near())
        found = self._lookup(self._near, address)
        if found is None:
            if self._all is None:
                import gc
                self._all = self._build(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
            found = self._lookup(self._all, address)
        return found


# --------------------------------------------------------------------------------- loaders (C++)


class _Handle:
    """The student's process: a loaded library whose functions are boundary calls."""

    def __init__(self, key, inner, callables: dict):
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_callables", callables)

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        spec = self._callables.get(name)
        if spec is None:
            return value
        key = f"{self._key}.{name}"

        def call(*args, **kwargs):
            return RUNTIME.call(key, value, args, kwargs, pointers=spec.get("ptrs"))
        return call


class _ReplayHandle:
    def __init__(self, key, callables: dict, values: dict):
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_callables", callables)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name):
        if name in self._values:
            return self._values[name]
        spec = self._callables.get(name)
        if spec is None:
            raise AttributeError(f"the student's library has no {name}")
        key = f"{self._key}.{name}"

        def call(*args, **kwargs):
            return RUNTIME.call(key, None, args, kwargs, pointers=spec.get("ptrs"))
        return call


def _pointer_args(fn) -> list[int] | None:
    import ctypes
    argtypes = getattr(fn, "argtypes", None)
    if not argtypes:
        return None
    return [i for i, a in enumerate(argtypes) if a in (ctypes.c_void_p, ctypes.c_char_p)
            or (isinstance(a, type) and issubclass(a, ctypes._Pointer))]


def _load(self, key, spec, fn, args, kwargs):
    first = args[0] if args else next(iter(kwargs.values()), None)
    calls, outcome = list(spec.get("calls") or ()), list(spec.get("outcome") or ())
    if None in calls or first in calls:
        only_outcome = False
    elif None in outcome or first in outcome:
        only_outcome = True                        # another task's: whether it loads, nothing more
    else:
        return fn(*args, **kwargs)
    tls = self.tls
    if getattr(tls, "depth", 0):
        return fn(*args, **kwargs)
    # A library is loaded once per process and argument (a loader is called on every matmul): the
    # first call is logged, later ones give the same handle (or raise the same error), both sides.
    try:
        cache_key = (key, repr(args), repr(sorted(kwargs.items())))
    except Exception:                              # noqa: BLE001
        cache_key = None
    cached = self.loaded.get(cache_key) if cache_key is not None else None
    if cached is not None:
        if isinstance(cached, BaseException):
            raise cached
        return cached
    result = self._load_once(key, fn, args, kwargs, only_outcome)
    if cache_key is not None:
        self.loaded[cache_key] = result
    if isinstance(result, BaseException):
        raise result
    return result


def _load_once(self, key, fn, args, kwargs, only_outcome=False):
    if self.mode == "record":
        stream = self.stream()
        try:
            inner = fn(*args, **kwargs)
        except Exception as e:                    # noqa: BLE001 — the same error on every later call
            with self.lock:
                self._write(stream, {"key": key, "load": {"raised": [type(e).__name__, str(e)[:2000]]}})
            return e
        if only_outcome:
            with self.lock:
                self._write(stream, {"key": key, "load": {"loaded": True}})
            return inner
        callables, values = {}, {}
        for name in dir(inner):
            if name.startswith("_"):
                continue
            try:
                value = getattr(inner, name)
            except Exception:                     # noqa: BLE001
                continue
            if callable(value) and not isinstance(value, type):
                callables[name] = {"ptrs": _pointer_args(value)}
            elif value is None or isinstance(value, (bool, int, float, str)):
                values[name] = value
            elif isinstance(value, pathlib.PurePath):
                values[name] = str(value)
        with self.lock:
            self._write(stream, {"key": key, "load": {"callables": callables, "values": values}})
        return _Handle(key, inner, callables)
    if self.mode == "replay":
        self._load_streams()
        stream = self.stream()
        queue = self.streams.get(stream)
        if not queue:
            raise JudgeError(f"the judge's test loads {_short(key)} here, but your process did not")
        ev = queue.popleft()
        if ev.get("key") != key or not isinstance(ev.get("load"), dict):
            raise JudgeError(f"the judge's test loads {_short(key)} here, your process did something else: "
                             f"{_short(str(ev.get('key')))}")
        load = ev["load"]
        if "raised" in load:
            name, msg = (list(load["raised"]) + ["", ""])[:2]
            cls = {"RuntimeError": RuntimeError, "OSError": OSError, "ImportError": ImportError}.get(str(name))
            if cls is None:
                try:
                    mod, _, qual = key.partition(":")
                    m = importlib.import_module(mod)
                    cls = getattr(m, str(name), None)
                    if not (isinstance(cls, type) and issubclass(cls, Exception)):
                        cls = RuntimeError
                except Exception:                 # noqa: BLE001
                    cls = RuntimeError
            return cls(str(msg))
        if only_outcome:                          # it loaded there: the judge's own library here
            if load.get("loaded") is not True:
                raise JudgeError(f"the student's process wrote a broken log (the load of {_short(key)})")
            try:
                return fn(*args, **kwargs)
            except Exception as e:                # noqa: BLE001 — loads there, not here: cannot follow
                raise JudgeError(f"{_short(key)} loaded in your process but not in the judge's: {e}") from e
        callables = {str(k): (v if isinstance(v, dict) else {}) for k, v in (load.get("callables") or {}).items()}
        values = {str(k): v for k, v in (load.get("values") or {}).items()
                  if v is None or isinstance(v, (bool, int, float, str))}
        return _ReplayHandle(key, callables, values)
    return fn(*args, **kwargs)


Runtime.load = _load
Runtime._load_once = _load_once

RUNTIME = Runtime()


# --------------------------------------------------------------------------- processes a test starts

CHILD_ENV = ("COURSE_JUDGE_MODE", "COURSE_JUDGE_LOG", "COURSE_JUDGE_BOUNDARY", "COURSE_JUDGE_SEED",
             "COURSE_JUDGE_PACKAGES", "COURSE_TESTS_DIR", "COURSE_REF_DIRS", "COURSE_JUDGE_WORKSPACE")


def child_log(parent_log: str, key: str) -> str:
    import hashlib
    return os.path.join(parent_log, "child-" + hashlib.sha256(key.encode()).hexdigest()[:16])


_EARLY_DONE = False


def early() -> None:
    """Every process of a grading (the test's, and whatever it starts: a subprocess, a forkserver
    and its children, spawned processes), before a chapter module is imported: never the editable
    install's finder (it maps the packages to the instructor's repository), never a file of the
    reference, the task's functions decorated, and children and threads numbered."""
    global _EARLY_DONE, SPEC_CHECK
    if _EARLY_DONE:
        return
    _EARLY_DONE = True
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in (getattr(f, "__module__", "") or "")
                        and "__editable__" not in getattr(f, "__name__", "")]
    refs = [os.path.realpath(p) for p in json.loads(os.environ.get("COURSE_REF_DIRS", "[]"))]
    if refs and SPEC_CHECK is None:
        def refuse(fullname, spec):
            origin = os.path.realpath(spec.origin) if spec.origin else ""
            if any(origin == d or origin.startswith(d + os.sep) for d in refs):
                raise ImportError(f"grading must not import the reference solution: {fullname} -> {spec.origin}")
        SPEC_CHECK = refuse

        class Guard:
            _course_delegating = True

            def find_spec(self, fullname, path=None, target=None):
                for finder in sys.meta_path:
                    if getattr(finder, "_course_delegating", False) or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        refuse(fullname, spec)
                        return spec
                return None
        sys.meta_path.insert(0, Guard())
    install(json.loads(os.environ.get("COURSE_JUDGE_BOUNDARY", "{}")))
    watch_children()


def start_child(key: str) -> None:
    """In a process a test started: log (the student's side) or replay (the judge's) its own calls
    into the task's code, in a log of its own beside its parent's, named by `key` (its place among
    the processes started: the same in both processes)."""
    early()
    log = child_log(os.environ["COURSE_JUDGE_LOG"], key)
    RUNTIME.streams, RUNTIME.ends, RUNTIME.loaded = None, {}, {}
    if MODE == "record":
        RUNTIME.mode = "record"
        RUNTIME.autoflush = True
        RUNTIME.start_record(log)
        import atexit
        atexit.register(RUNTIME.flush)
    elif MODE == "replay":
        RUNTIME.mode = "replay"
        RUNTIME.start_replay(log, set(json.loads(os.environ.get("COURSE_JUDGE_PACKAGES", "[]"))))
    RUNTIME.set_phase("child:" + key)
    seed_everything(zlib.crc32(key.encode()) & 0x7FFFFFFF)


def _next_key(counts: dict, kind: str) -> str | None:
    """The next child's key in this phase, or None inside the task's code (what the student's code
    starts has no counterpart in the judge's process)."""
    if getattr(RUNTIME.tls, "depth", 0) or not MODE:
        return None
    phase = RUNTIME.phase
    n = counts.get((phase, kind), 0)
    counts[(phase, kind)] = n + 1
    return f"{phase}#{kind}{n}"


def watch_children() -> None:
    """Every subprocess, multiprocessing process and thread a test starts (outside the task's code)
    gets a key, the same in both processes — its place among those this test started: a child
    process logs (or replays) into a log of its own, a thread into a stream of its own."""
    import subprocess
    counts: dict = {}
    original = subprocess.Popen.__init__

    def init(self, args, *rest, **kwargs):
        key = _next_key(counts, "proc")
        if key is not None:
            env = kwargs.get("env")
            env = dict(os.environ if env is None else env)
            for k in CHILD_ENV:
                if k in os.environ:
                    env[k] = os.environ[k]
            env["COURSE_JUDGE_CHILD"] = key
            here = os.environ.get("COURSE_JUDGE_WORKSPACE") or os.getcwd()
            path = env.get("PYTHONPATH", "")
            if here not in path.split(os.pathsep):
                env["PYTHONPATH"] = here + (os.pathsep + path if path else "")
            kwargs["env"] = env
        return original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = init

    import multiprocessing.process as mpp
    mp_start, mp_bootstrap = mpp.BaseProcess.start, mpp.BaseProcess._bootstrap

    def start(self):
        key = _next_key(counts, "mp")
        if key is not None:
            self._course_key = key           # travels with the process object (pickled, or forked)
        return mp_start(self)

    def bootstrap(self, *args, **kwargs):
        key = getattr(self, "_course_key", None)
        if key is not None:
            start_child(key)
        else:
            RUNTIME.mode = ""                # not a child the judge follows: run nothing of its log
        return mp_bootstrap(self, *args, **kwargs)

    mpp.BaseProcess.start = start
    mpp.BaseProcess._bootstrap = bootstrap

    thread_start = threading.Thread.start

    def started(self):
        key = _next_key(counts, "thread")
        if key is not None:
            self._course_stream = key
        return thread_start(self)

    threading.Thread.start = started

    def forked():
        RUNTIME.mode = ""                    # a bare fork shares the log: it must not write into it, nor read on

    os.register_at_fork(after_in_child=forked)
