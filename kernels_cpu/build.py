"""Build the C++ kernels of this package for the best instruction set this CPU runs, and load them.

Every kernel here (attention.py, gemm.py, layer_ops.py) is one source compiled per instruction set:
csrc/vec.h picks AVX-512, AVX2 + FMA or portable scalar code from the compiler's flags, and this
module picks the flags from a runtime check of the CPU (torch's own), so a build never uses an
instruction the machine lacks. `load_extension` compiles a kernel on first use with
`torch.utils.cpp_extension.load` (g++, -O3, -fopenmp; tens of seconds) into torch's extension
cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), once per machine, kernel and
instruction set; later processes load the cached library, and later calls are one dict lookup.

    VFS_CPU_ISA=avx512|avx2|scalar|avx512_simde   force a variant (only one this CPU can run)

"avx512_simde" is a tests-only variant: the AVX-512 source with its intrinsics emulated by SIMDe
(simde.py says why), so the AVX-512 code is checked on AVX2 machines too. Without a C++ compiler
(or ninja, which torch builds with) a load raises a RuntimeError saying so: callers then fall back
to their torch path. A build killed midway leaves torch's build lock behind, and the next build
would wait for it forever: `clear_stale_build_lock` removes such a lock first.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import time
import warnings

import torch

from kernels_cpu import simde

# Resolved to its real path: torch.utils.cpp_extension rebuilds whenever the source PATHS change,
# so copies of the tree that link csrc/ to one shared folder (the course's proof) share one build.
CSRC = (pathlib.Path(__file__).resolve().parent / "csrc").resolve()
ISA_ENV = "VFS_CPU_ISA"
# What each variant is compiled with. AVX-512 needs F+BW+VL+DQ (masked 16-bit loads, the
# reduction shuffles): exactly what torch's "AVX512" capability requires of the CPU.
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
ISA_ORDER = ("avx512", "avx2", "scalar")          # best first
# Tests only: the AVX-512 variant's source on an AVX2 CPU, its intrinsics emulated by SIMDe
# (simde.py says why). Never the engine's choice: it proves what the AVX-512 code computes,
# not how fast it runs.
EMULATED_ISAS = {"avx512_simde": "avx2"}          # variant -> what the CPU must run
ALL_ISAS = ISA_ORDER + tuple(EMULATED_ISAS)
# Every variant's compile flags before its ISA's (tests compile single kernels with them too).
BASE_CFLAGS = ("-O3", "-std=c++17", "-fopenmp", "-DNDEBUG")
# No build takes nearly this long: a build lock older than this was left by a killed build.
STALE_LOCK_SECONDS = 600

# Every extension loaded in this process, by (stem, isa); isa None = the default variant
# (cpu_isa()), so the hot path is one lookup. Failures are kept too: a failing 20-second build
# is not retried on every call.
_loaded: dict[tuple[str, str | None], object] = {}
_failed: dict[str, str] = {}


def cpu_isa() -> str:
    """The best variant this CPU can run: torch's own runtime check of the CPU
    (torch.backends.cpu.get_cpu_capability(), which honours ATEN_CPU_CAPABILITY), or
    $VFS_CPU_ISA when set (it may only pick a variant the CPU supports)."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    supported = "avx512" if capability.startswith("AVX512") else "avx2" if capability == "AVX2" else "scalar"
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return supported
    if forced not in ALL_ISAS:
        raise ValueError(f"{ISA_ENV}={forced!r}; choose one of {ALL_ISAS}")
    if ISA_ORDER.index(EMULATED_ISAS.get(forced, forced)) < ISA_ORDER.index(supported):
        raise RuntimeError(f"{ISA_ENV}={forced} but this CPU only supports {supported} (torch reports {capability})")
    return forced


def why_not_runnable(isa: str) -> str | None:
    """Why this machine cannot run the `isa` variant (None when it can): the CPU lacks the
    instructions, or (emulated variants) SIMDe's headers are missing."""
    best = cpu_isa()
    native = EMULATED_ISAS.get(isa, isa)
    if native not in ISA_ORDER:
        return f"unknown instruction set {isa!r}; choose one of {ALL_ISAS}"
    if ISA_ORDER.index(native) < ISA_ORDER.index(EMULATED_ISAS.get(best, best)):
        return f"this CPU cannot run {native}"
    return simde.missing_reason() if isa in EMULATED_ISAS else None


def runnable_isas() -> tuple[str, ...]:
    """The variants this machine runs: `cpu_isa()`, every native one below it, best first, then
    the emulated ones when SIMDe's headers are here (tests build each by name)."""
    return tuple(isa for isa in ALL_ISAS if why_not_runnable(isa) is None)


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of the `isa` variant. An emulated one adds SIMDe's include folder, and
    -O1 (after BASE_CFLAGS' -O3, so it wins): optimising SIMDe's inlined emulation at -O3
    takes several times longer to compile, and speed is not what that build is for."""
    if isa not in EMULATED_ISAS:
        return list(ISA_FLAGS[isa])
    include = simde.include_dir()
    return [*ISA_FLAGS[EMULATED_ISAS[isa]], "-DVFS_CPU_SIMDE_AVX512", "-O1", *([f"-I{include}"] if include else [])]


def compiler() -> str | None:
    """The C++ compiler torch's extension builder will call ($CXX, else c++), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def missing_build_tool(what: str = "a CPU kernel") -> str | None:
    """Why this machine cannot build the extensions at all (None when it can): no C++
    compiler, or no ninja (torch.utils.cpp_extension builds with it). `what` names the kernel."""
    if compiler() is None:
        return (f"{what} needs a C++ compiler: '{os.environ.get('CXX', 'c++')}' is not on PATH "
                "(install g++, or set CXX); use the torch path meanwhile")
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return (f"{what} is built by torch.utils.cpp_extension, which needs ninja "
                "(`pip install ninja` or apt-get install ninja-build); use the torch path meanwhile")
    return None


def clear_stale_build_lock(name: str) -> pathlib.Path | None:
    """torch.utils.cpp_extension holds `<its build dir>/lock` while it builds an extension, and a
    second process waits for that file to go away -- with no time limit. A build killed midway
    (Ctrl-C, a test timeout) leaves the file behind, and every later load of the extension then
    hangs silently. Remove such a lock (older than any build here), with a warning; return its
    path, or None when there was none to remove."""
    from torch.utils.cpp_extension import _get_build_directory
    lock = pathlib.Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age < STALE_LOCK_SECONDS:
        return None                          # a build in progress in another process: wait for it
    warnings.warn(f"removing a stale build lock {lock} ({age / 60:.0f} min old): an earlier build of "
                  f"{name} was interrupted", RuntimeWarning, stacklevel=2)
    lock.unlink(missing_ok=True)
    return lock


def unwritten(sources: list[pathlib.Path]) -> str | None:
    """The `#error ... not implemented` line of a source that cannot build as it stands (in a
    course's student edition: an optional task not written yet), found without running the
    compiler, which would spend seconds on the headers before reaching it in every process."""
    for source in sources:
        for line in pathlib.Path(source).read_text(errors="replace").splitlines():
            if line.lstrip().startswith("#error") and "not implemented" in line:
                return f"{pathlib.Path(source).name}: {line.strip()}"
    return None


def build_extension(name: str, sources: list[pathlib.Path], isa: str, what: str,
                    extra_cflags: tuple[str, ...] = ()):
    """Compile (first time: tens of seconds) or load from torch's extension cache the C++ extension `name`
    for `isa`, with csrc/ (the vector header) on the include path; the module must report
    `isa()` as asked. RuntimeError naming `what` and the reason when it cannot: no compiler
    or ninja, a compile error (the compiler's output is in the message), flags the compiler
    ignored."""
    missing = missing_build_tool(f"the {what}") or (simde.missing_reason() if isa in EMULATED_ISAS else None)
    if missing:
        raise RuntimeError(missing)
    stub = unwritten(sources)
    if stub:
        raise RuntimeError(f"the {what} cannot be built: {stub}")
    from torch.utils.cpp_extension import load as load_torch_extension
    try:
        flags = isa_flags(isa)
        clear_stale_build_lock(name)
        module = load_torch_extension(
            name=name,
            sources=[str(s) for s in sources],
            extra_include_paths=[str(CSRC)],
            extra_cflags=[*BASE_CFLAGS, *extra_cflags, *flags],
            extra_ldflags=["-fopenmp"],
            verbose=False)           # (ninja tracks the headers: an edited .h rebuilds too)
    except Exception as e:                   # noqa: BLE001 — a build error becomes one clear message
        raise RuntimeError(f"building the {what} ({isa}) failed: {type(e).__name__}: {e}") from e
    if module.isa() != isa:
        raise RuntimeError(f"the {isa} build of the {what} reports instruction set {module.isa()!r}: "
                           f"the compiler ignored {flags}")
    return module


def load_extension(stem: str, sources: tuple[str, ...], what: str, isa: str | None = None,
                   extra_cflags: tuple[str, ...] = ()):
    """The extension `vfs_<stem>_<isa>` built from csrc/`sources` (isa None: `cpu_isa()`), built on
    first use (`build_extension`) and then cached for the process. RuntimeError with the reason
    when it cannot be built; the same error again, without a retry, on later calls."""
    module = _loaded.get((stem, isa))
    if module is not None:                   # the hot path: loaded already
        return module
    resolved = isa or cpu_isa()
    if (stem, resolved) not in _loaded:
        name = f"vfs_{stem}_{resolved}"
        if name in _failed:
            raise RuntimeError(_failed[name])
        try:
            _loaded[stem, resolved] = build_extension(name, [CSRC / s for s in sources], resolved, what, extra_cflags)
        except RuntimeError as e:
            _failed[name] = str(e)
            raise
    _loaded[stem, isa] = _loaded[stem, resolved]
    return _loaded[stem, isa]


def loaded_extensions() -> list[str]:
    """The extensions this process has loaded (`vfs_<stem>_<isa>`), sorted: empty while no
    kernel of this package has run (e.g. an engine with cpu_kernels="off")."""
    return sorted(f"vfs_{stem}_{isa}" for stem, isa in _loaded if isa is not None)


def unavailable_reason_of(load) -> str | None:
    """Why `load()` (a kernel module's loader) fails here, None when it works; builds on the first call.
    Each kernel module's `is_available` / `unavailable_reason` are this."""
    try:
        load()
        return None
    except RuntimeError as e:
        return str(e)
