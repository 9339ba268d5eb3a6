"""Run kernels_cuda/ on the CPU: the REAL `<name>.cu` (device code and host launcher,
unchanged) compiled with g++ against `cuda_runtime_emulated.h`, loaded with ctypes.

    from kernels_cuda import emulator
    pa = emulator.load("paged_attention")
    rc = pa.vfs_paged_attention_v1(dtype, head_size, block_size, out_ptr, ..., strides, 0)
    assert rc == 0, pa.vfs_paged_attention_error_string(rc).decode()

Why: CI machines have nvcc but no GPU. The launchers choose grids, dispatch (dtype, head
size, block size), opt in to shared memory and return error codes; running them here, not a
re-derivation of them, is what makes a launcher bug visible without a GPU. The only seam is
`VFS_LAUNCH` (kernels_cuda/launch.cuh), `<<<...>>>` under nvcc.

How: each kernel family is one shared library, built from a generated source that includes
`<name>.cu` and exports each launcher's address under `vfs_emu_<launcher>`. The launchers'
C++ signatures are written out in `LAUNCHERS`; the generated source `static_assert`s them
against the compiled `.cu`, and ctypes calls through them. Built once per version of the
sources (their hash names the library, in ~/.cache/vllm_from_scratch/cuda_emulator); needs
g++ (C++17, `_Float16`), no CUDA toolkit.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
from types import SimpleNamespace
from typing import Sequence

EMULATOR_DIR = pathlib.Path(__file__).resolve().parent
KERNELS_DIR = EMULATOR_DIR.parent
CXXFLAGS = ["-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas"]

# The launchers' C++ signatures, as the bindings (<name>_binding.cpp) declare them.
LAUNCHERS: dict[str, list[str]] = {
    "paged_attention": [
        "int vfs_paged_attention_v1(int, int, int, void*, const void*, const void*, const void*, const int*, "
        "const int*, int, int, int, int, int, float, int, bool, float, float, const int64_t*, int64_t)",
        "int vfs_paged_attention_v2(int, int, int, void*, float*, float*, float*, const void*, const void*, "
        "const void*, const int*, const int*, int, int, int, int, int, float, int, bool, float, float, "
        "const int64_t*, int64_t)",
        "int vfs_paged_attention_v3(int, int, int, void*, float*, float*, float*, const void*, const void*, "
        "const void*, const int*, const int*, int, int, int, int, int, float, int, bool, float, float, "
        "const int64_t*, int64_t)",
        "int vfs_paged_attention_v3_group_max()",
        "int vfs_paged_attention_partition_size()",
        "const char* vfs_paged_attention_error_string(int)",
    ],
    "cache_kernels": [
        "int vfs_reshape_and_cache(int, bool, const void*, const void*, void*, void*, const void*, int64_t, int, "
        "int, int, const int64_t*, int64_t)",
        "int vfs_reshape_and_cache_quant(int, bool, int, bool, const void*, const void*, void*, void*, const void*, "
        "int64_t, int, int, int, float, float, const int64_t*, int64_t)",
        "const char* vfs_cache_kernels_error_string(int)",
    ],
    "copy_blocks": [
        "int copy_blocks_launch(const int64_t*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, "
        "int64_t, int64_t)",
        "const char* copy_blocks_error_string(int)",
    ],
    "swap_blocks": [
        "int swap_blocks_launch(const char*, char*, const int64_t*, int64_t, int64_t, bool, bool, int64_t)",
        "const char* swap_blocks_error_string(int)",
    ],
    "rejection_sampler": [
        "int vfs_rejection_sample(int32_t*, const int32_t*, const int32_t*, const float*, const float*, "
        "const int32_t*, const int32_t*, const int8_t*, const float*, const float*, int, int, int, int64_t)",
        "const char* vfs_rejection_sampler_error_string(int)",
    ],
}

_CTYPES = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
           "bool": ctypes.c_bool, "unsigned": ctypes.c_uint, "void": None}
_SIGNATURE = re.compile(r"^\s*(?P<ret>.+?)\s*\b(?P<name>\w+)\s*\((?P<args>.*)\)\s*$")


class EmulatorUnavailable(RuntimeError):
    """No C++ compiler that can build the emulator (tests skip on this, and only on this)."""


def _parse(signature: str) -> tuple[str, str, list[str]]:
    m = _SIGNATURE.match(signature)
    if m is None:
        raise ValueError(f"not a C++ function signature: {signature!r}")
    args = [a.strip() for a in m["args"].split(",") if a.strip()]
    return m["ret"], m["name"], args


def _ctype(c_type: str, result: bool = False):
    c_type = " ".join(c_type.replace("*", " * ").split()).replace(" *", "*")
    if result and c_type == "const char*":
        return ctypes.c_char_p      # a message: bytes
    if c_type in _CTYPES:
        return _CTYPES[c_type]
    if c_type.endswith("*"):
        return ctypes.c_void_p      # tensors' data_ptr(), ctypes arrays, None for nullptr
    raise ValueError(f"no ctypes type for {c_type!r}")


def _source(name: str, launchers: Sequence[str], extra_source: str) -> str:
    lines = [f"// Generated by kernels_cuda/emulator/__init__.py: {name}.cu on the CPU.",
             f'#include "{name}.cu"', "#include <type_traits>", extra_source, ""]
    for sig in launchers:
        ret, fn, args = _parse(sig)
        pointer = f"{ret} (*)({', '.join(args)})"
        lines += [f"static_assert(std::is_same_v<decltype(&{fn}), {pointer}>,",
                  f'              "{fn}: the signature in kernels_cuda/emulator LAUNCHERS is not the launcher\'s");',
                  f'extern "C" {pointer.replace("(*)", "(* const vfs_emu_" + fn + ")")} = &{fn};']
    return "\n".join(lines) + "\n"


def _cache_dir() -> pathlib.Path:
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return base / "vllm_from_scratch" / "cuda_emulator"


@functools.cache
def _compiler_works(cxx: str) -> bool:
    """Can `cxx` build the emulator at all? (Tells a missing toolchain from a broken kernel.)"""
    probe = "#include <thread>\nextern \"C\" float f(float x) { return static_cast<float>(static_cast<_Float16>(x)); }\n"
    proc = subprocess.run([cxx, *CXXFLAGS, "-x", "c++", "-", "-o", os.devnull], input=probe, capture_output=True,
                          text=True)
    return proc.returncode == 0


def _build(name: str, source: str, kernels_dir: pathlib.Path) -> pathlib.Path:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        raise EmulatorUnavailable("the CUDA emulator needs g++ (C++17)")
    inputs = sorted(p for p in kernels_dir.iterdir() if p.suffix in {".cu", ".cuh", ".h"})
    inputs += sorted(EMULATOR_DIR.rglob("*.h"))
    digest = hashlib.sha256()
    for part in [source.encode(), " ".join([cxx, *CXXFLAGS]).encode()] + [p.read_bytes() for p in inputs]:
        digest.update(hashlib.sha256(part).digest())
    lib = _cache_dir() / f"{name}_{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    src = lib.with_suffix(f".{os.getpid()}.cpp")
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    src.write_text(source)
    # include/ first: its cuda_runtime.h, cuda_fp16.h, ... are the emulated runtime.
    cmd = [cxx, *CXXFLAGS, "-I", str(EMULATOR_DIR / "include"), "-I", str(kernels_dir), str(src), "-o", str(tmp)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        src.unlink(missing_ok=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        if not _compiler_works(cxx):
            raise EmulatorUnavailable(f"{cxx} cannot build the CUDA emulator (C++17 with _Float16 needed)")
        raise RuntimeError(f"emulated build of {kernels_dir / name}.cu failed:\n{proc.stderr[-6000:]}")
    tmp.replace(lib)     # atomic: a concurrent build of the same sources writes the same file
    return lib


def load(name: str, *, extra_source: str = "", extra_launchers: Sequence[str] = (),
         kernels_dir: str | pathlib.Path | None = None) -> SimpleNamespace:
    """Build (cached) and load the emulated `<kernels_dir>/<name>.cu`; return its launchers as
    ctypes functions named as in C++ (plus `.library`, the CDLL, and `.path`).

    `extra_source` is C++ appended after the .cu (it may define more host functions that use
    VFS_LAUNCH, e.g. a kernel configuration the launcher does not instantiate), exported like
    the launchers when listed in `extra_launchers`. `kernels_dir` defaults to the kernels_cuda/
    this module belongs to (in a course workspace, the student's)."""
    kernels_dir = pathlib.Path(kernels_dir) if kernels_dir is not None else KERNELS_DIR
    if name not in LAUNCHERS:
        raise ValueError(f"unknown kernel family {name!r}; known: {sorted(LAUNCHERS)}")
    launchers = [*LAUNCHERS[name], *extra_launchers]
    path = _build(name, _source(name, launchers, extra_source), kernels_dir)
    library = ctypes.CDLL(str(path))
    out = SimpleNamespace(library=library, path=path)
    for sig in launchers:
        ret, fn, args = _parse(sig)
        address = ctypes.c_void_p.in_dll(library, f"vfs_emu_{fn}").value
        prototype = ctypes.CFUNCTYPE(_ctype(ret, result=True), *(_ctype(a) for a in args))
        setattr(out, fn, prototype(address))
    return out
