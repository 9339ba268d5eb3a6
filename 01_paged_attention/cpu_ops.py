"""Paged attention as a CPU kernel: C++ + OpenMP + AVX-512 / AVX2 (or portable scalar code),
the "cpu" rung beside the reference, Triton and CUDA. Mirrors vLLM's CPU attention
(csrc/cpu/cpu_attn_impl.hpp, used by vllm/v1/attention/backends/cpu_attn.py).

    from paged_attention import cpu_ops
    out = cpu_ops.unified_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                    query_start_loc, scale)          # [T, H, D]
    out = cpu_ops.paged_decode_attention(query, key_cache, value_cache, block_tables,
                                         seq_lens, scale)             # [S, H, D]
    out = cpu_ops.paged_prefill_attention(query, key, value, key_cache, value_cache,
                                          slot_mapping, query_start_loc, scale)   # [T, H, D]
    cpu_ops.is_available()    # False (with unavailable_reason()) when no compiler / build fails

Why a kernel at all: on a CPU, decode attention is memory-bound — each step reads every
cached K/V byte once — and the vectorized torch path (chapter 05) must first GATHER the
paged K/V into contiguous tensors for SDPA: it writes and re-reads every byte, plus ~20
small ops per sub-batch. The kernel reads K/V in place through the block table, all query
heads of a GQA group per K/V row, with an online softmax in fp32 (csrc/cpu_attention_kernel.cpp
explains the work split, split-KV and the cache behaviour).

The module has the same functions and signatures as every chapter-01 backend module
(reference.py, torch_ops.py, triton_ops.py, cuda_ops.py: reshape_and_cache, paged_decode_attention,
paged_prefill_attention) plus chapter 05's unified_attention, so the dispatch can list it.
Semantics are exactly chapter 05's `unified_attention` reference: request i's
query_start_loc[i+1] - query_start_loc[i] >= 1 new tokens are the last of its seq_lens[i]
KV tokens, causal with that offset; GQA head h reads KV head h // (H // KVH); fp32 softmax,
output in the query dtype (fp32, bf16, fp16); positions past seq_len and block-table
entries past ceil(seq_len / block_size) are never read.

Build: on first use, `torch.utils.cpp_extension.load` compiles csrc/ with g++ (-O3,
-fopenmp and the vector flags of the best instruction set this CPU reports — a runtime check,
so a build never uses an instruction the machine lacks) into torch's extension cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), once per machine and instruction
set; later processes load the cached library in ~0.1 s. VFS_CPU_ATTENTION_ISA=avx512|avx2|
scalar forces a variant; `load(isa)` builds one by name (tests check every variant the machine
runs, and "avx512_simde": the AVX-512 source with its intrinsics emulated by SIMDe, so the
AVX-512 code is checked on AVX2 machines too -- simde.py). Without a C++
compiler (or ninja, which torch builds with), `load()` raises a RuntimeError saying so and
`is_available()` is False: callers (the backend dispatch) fall back to the torch path.

Threads: the kernel's OpenMP pool is torch's own (the extension links the libgomp torch
already loaded), sized by torch.get_num_threads() at each call.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import sys
import time
import warnings

import torch

from paged_attention import checks
from paged_attention import cache_ops
from paged_attention import simde

__all__ = ["paged_decode_attention", "paged_prefill_attention", "reshape_and_cache", "unified_attention",
           "is_available", "load", "plan"]

# Resolved to its real path: torch.utils.cpp_extension rebuilds whenever the source PATHS change,
# so copies of the tree that link csrc/ to one shared folder (the course's proof) share one build.
CSRC = (pathlib.Path(__file__).resolve().parent / "csrc").resolve()
SOURCES = ("cpu_attention_binding.cpp", "cpu_attention_kernel.cpp")   # + cpu_attention.h, cpu_attention_vec.h
ISA_ENV = "VFS_CPU_ATTENTION_ISA"
# What each variant is compiled with. AVX-512 needs F+BW+VL+DQ (masked 16-bit loads, the
# reduction shuffles): exactly what torch's "AVX512" capability requires of the CPU.
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
ISA_ORDER = ("avx512", "avx2", "scalar")          # best first
# Tests only: the AVX-512 variant's source on an AVX2 CPU, its intrinsics emulated by SIMDe
# (paged_attention/simde.py says why). Never the engine's choice: it proves what the AVX-512
# code computes, not how fast it runs.
EMULATED_ISAS = {"avx512_simde": "avx2"}          # variant -> what the CPU must run
ALL_ISAS = ISA_ORDER + tuple(EMULATED_ISAS)
HEAD_DIM_MULTIPLE = 8                              # AVX2 vectors hold 8 fp32 lanes
# Every variant's compile flags before its ISA's (tests compile single kernels with them too).
BASE_CFLAGS = ("-O3", "-std=c++17", "-fopenmp", "-DNDEBUG")

_modules: dict[str | None, object] = {}     # None: the default variant (cpu_isa())
_failures: dict[str, str] = {}


def cpu_isa() -> str:
    """The best variant this CPU can run: torch's own runtime check of the CPU
    (torch.backends.cpu.get_cpu_capability(), which honours ATEN_CPU_CAPABILITY), or
    $VFS_CPU_ATTENTION_ISA when set (it may only pick a variant the CPU supports)."""
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
    -O1 (after build_extension's -O3, so it wins): optimising SIMDe's inlined emulation at -O3
    took 4x longer (~55 s for the attention kernel), and speed is not what that build is for."""
    if isa not in EMULATED_ISAS:
        return list(ISA_FLAGS[isa])
    include = simde.include_dir()
    return [*ISA_FLAGS[EMULATED_ISAS[isa]], "-DVFS_CPU_SIMDE_AVX512", "-O1", *([f"-I{include}"] if include else [])]


def compiler() -> str | None:
    """The C++ compiler torch's extension builder will call ($CXX, else c++), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def missing_build_tool() -> str | None:
    """Why this machine cannot build the extension at all (None when it can): no C++
    compiler, or no ninja (torch.utils.cpp_extension builds with it)."""
    if compiler() is None:
        return (f"the CPU attention kernel needs a C++ compiler: '{os.environ.get('CXX', 'c++')}' is not on PATH "
                "(install g++, or set CXX); use backend='torch' meanwhile")
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return ("the CPU attention kernel is built by torch.utils.cpp_extension, which needs ninja "
                "(`pip install ninja` or apt-get install ninja-build); use backend='torch' meanwhile")
    return None


# A build takes 15-60 s here; a build lock older than this was left by a killed build.
STALE_LOCK_SECONDS = 600


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


def build_extension(name: str, sources: list[pathlib.Path], isa: str, what: str,
                    extra_cflags: tuple[str, ...] = ()):
    """Compile (first time, 15-60 s) or load from torch's extension cache the C++ extension `name`
    for `isa`, with this chapter's csrc/ (the vector header) on the include path; the module must
    report `isa()` as asked. RuntimeError naming `what` and the reason when it cannot: no compiler
    or ninja, a compile error (the compiler's output is in the message), flags the compiler
    ignored. Chapter 07's kernels are built by it too."""
    missing = missing_build_tool() or (simde.missing_reason() if isa in EMULATED_ISAS else None)
    if missing:
        raise RuntimeError(missing.replace("CPU attention kernel", what))
    from torch.utils.cpp_extension import load as load_extension
    try:
        flags = isa_flags(isa)
        clear_stale_build_lock(name)
        module = load_extension(
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


def load(isa: str | None = None):
    """Build (first call on this machine, ~20 s) or load (cached) the extension for `isa`
    (default: `cpu_isa()`), and return the module. Raises RuntimeError with the reason when
    it cannot: no compiler, or the build failed (the compiler's output is in the message)."""
    if isa is None and None in _modules:     # the hot path: the default variant, already loaded
        return _modules[None]
    requested, isa = isa, isa or cpu_isa()
    if isa in _modules:
        return _modules[isa]
    if isa in _failures:                     # don't retry a 20-second failing build per call
        raise RuntimeError(_failures[isa])
    try:
        module = build_extension(f"vfs_cpu_attention_{isa}", [CSRC / s for s in SOURCES], isa, "CPU attention kernel")
    except RuntimeError as e:
        _failures[isa] = str(e)
        raise
    _modules[isa] = module
    if requested is None:
        _modules[None] = module
    return module


def is_available(isa: str | None = None) -> bool:
    """True when the kernel is (or can be) built here. Builds it on the first call."""
    try:
        load(isa)
        return True
    except RuntimeError:
        return False


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why `load` fails here (None when it works)."""
    try:
        load(isa)
        return None
    except RuntimeError as e:
        return str(e)


def _check_cpu_layout(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """What this kernel needs beyond the shared checks: CPU tensors, a contiguous head_dim
    axis in the caches (read in place, so never copied), head_dim a multiple of 8."""
    if query.device.type != "cpu":
        raise ValueError(f"the cpu backend runs on CPU tensors, got {query.device}; use 'triton' or 'cuda' on a GPU")
    head_dim = query.shape[-1]
    if head_dim % HEAD_DIM_MULTIPLE:
        raise ValueError(f"the cpu backend needs head_dim to be a multiple of {HEAD_DIM_MULTIPLE} (one AVX2 vector), "
                         f"got {head_dim}; use backend='torch'")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.numel() and cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride along head_dim (the kernel reads its rows in place), "
                             f"got strides {cache.stride()}")


def _index_int32(t: torch.Tensor) -> torch.Tensor:
    """int32, unit last stride (the kernel reads rows through a pointer + row stride)."""
    t = t if t.dtype == torch.int32 else t.to(torch.int32)
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim] (any strides; head_dim contiguous or copied)
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]  (written in place)
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = skip
    check_values: bool = True,
) -> None:
    """The cache write as one C++ pass: a row copy per token and KV head, bit for bit what the torch
    path (cache_ops.reshape_and_cache) writes, without its index tensors and index_put_ calls (at a
    decode step's 64 rows those cost ~0.3 ms per layer). The C++ side range-checks every slot before
    it writes anything, check_values or not. Caches whose head_dim axis is strided take the torch path."""
    checks.check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, check_values)
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        return cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=False)
    if key.shape[0] == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    load().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def unified_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32 (int64 accepted)
    seq_lens: torch.Tensor,         # [num_seqs] int32: context + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cu_seqlens of the new tokens
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,   # accepted for one signature across backends; only validated
    max_seq_len: int | None = None,
    kv_splits: int | None = None,       # tests: split every item's KV into this many pieces (None: automatic)
    q_tile: int | None = None,          # tests: new tokens per work item (None: automatic)
) -> torch.Tensor:                      # [num_tokens, num_heads, head_dim], query's dtype
    """Unified (varlen, causal-with-context) paged attention on the CPU kernel."""
    seq_lens = checks.contiguous_index(seq_lens)
    query_start_loc = checks.contiguous_index(query_start_loc)
    checks.check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                      check_values=check_values, max_query_len=max_query_len, max_seq_len=max_seq_len)
    _check_cpu_layout(query, key_cache, value_cache)
    return _run(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, kv_splits, q_tile)


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]: one new token per request
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32: KV tokens, the new one included (0: a padding row)
    scale: float,
    check_values: bool = True,
    *,
    max_seq_len: int | None = None,
    kv_splits: int | None = None,
) -> torch.Tensor:               # [num_seqs, num_heads, head_dim]
    """Decode = unified attention with query_len 1 for every request (a seq_len-0 padding
    row gets zeros, as in the reference)."""
    seq_lens = checks.contiguous_index(seq_lens)
    checks.check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, check_values, max_seq_len)
    _check_cpu_layout(query, key_cache, value_cache)
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return _run(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, kv_splits, None)


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]: the prompts back to back
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,      # (written)
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = don't cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int: cu_seqlens of the prompts
    scale: float,
    check_values: bool = True,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Chapter 01's prefill: write the prompts' K/V (cache_ops' one scatter), then causal
    attention of each prompt over its OWN fresh K/V, as the reference does (a token with
    slot -1 is not cached but is attended). The kernel reads the fresh key [T, KVH, D] in
    place, viewed as a cache of T blocks of one position each: prompt i's block table is
    simply its token indices."""
    query_start_loc = checks.contiguous_index(query_start_loc)
    checks.check_prefill_args(query, key, value, key_cache, value_cache, slot_mapping, query_start_loc,
                              check_values, max_query_len)
    _check_cpu_layout(query, key_cache, value_cache)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=False)   # checked above
    num_tokens = query.shape[0]
    starts = query_start_loc.long()
    lens = starts[1:] - starts[:-1]                                              # [num_seqs]
    if num_tokens == 0 or lens.numel() == 0:
        return torch.empty(query.shape, dtype=query.dtype)
    width = max_query_len if max_query_len is not None else int(lens.max())
    # entries past a prompt's length are never read; clamped to stay valid ids all the same
    block_tables = (starts[:-1, None] + torch.arange(max(width, 1))).clamp_max(num_tokens - 1)   # [num_seqs, width]
    fresh_k = (key if key.stride(-1) == 1 else key.contiguous()).unsqueeze(1)    # [T, 1, KVH, D]
    fresh_v = (value if value.stride(-1) == 1 else value.contiguous()).unsqueeze(1)
    return _run(query, fresh_k, fresh_v, block_tables, lens, query_start_loc, scale, None, None)


def plan(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_heads: int, num_kv_heads: int, *,
         num_threads: int | None = None, kv_splits: int | None = None, q_tile: int | None = None) -> list[dict]:
    """The kernel's work items for a batch (in plan order; the kernel runs them longest first):
    dicts (seq, kv_head, num_kv_heads, q_begin, q_count, kv_begin, kv_end, split). Shows how
    a step is cut up: one item per decode request (all its KV heads), query tiles per KV head
    for a long prefill, split-KV pieces of a request that is a large share of the work
    (num_threads: default torch's)."""
    names = ("seq", "kv_head", "num_kv_heads", "q_begin", "q_count", "kv_begin", "kv_end", "split")
    items = load().plan(_index_int32(checks.contiguous_index(seq_lens)),
                        _index_int32(checks.contiguous_index(query_start_loc)), num_heads, num_kv_heads,
                        num_threads or 0, kv_splits or 0, q_tile or 0)
    return [dict(zip(names, item)) for item in items]


def _run(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, kv_splits, q_tile):
    for name, knob in (("kv_splits", kv_splits), ("q_tile", q_tile)):
        if knob is not None and knob < 1:
            raise ValueError(f"{name} must be >= 1 (or None for automatic), got {knob}")
    ext = load()
    query = query if query.shape[-1] == 0 or query.stride(-1) == 1 else query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    ext.unified_attention_out(out, query, key_cache, value_cache, _index_int32(block_tables),
                              _index_int32(seq_lens), _index_int32(query_start_loc), float(scale),
                              kv_splits or 0, q_tile or 0)
    return out


def _self_check() -> None:   # python -m paged_attention.cpu_ops: build, say which variant
    module = load()
    print(f"cpu attention kernel: {module.isa()} ({module.vector_width()} fp32 lanes), "
          f"{torch.get_num_threads()} threads, compiler {compiler()}", file=sys.stderr)


if __name__ == "__main__":
    _self_check()
