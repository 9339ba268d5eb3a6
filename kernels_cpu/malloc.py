"""Keep freed memory in the process: a prefill step stops page-faulting its buffers back in.

Why: PyTorch's CPU allocator is plain `malloc`/`free`, and glibc's malloc serves a large block
with its own `mmap` and gives it back to the kernel (`munmap`) on `free` (the threshold starts at
128 KiB and rises with use, but never above 32 MiB); smaller blocks come from the heap, whose
freed top is trimmed back to the kernel too. A 4096-token prefill step allocates big blocks in
every layer (SmolLM2's gate_up output is 4096 x 3072 fp32 = 48 MiB), frees them microseconds
later and allocates them again in the next layer: each time the kernel hands out fresh zeroed
pages, one minor page fault per 4 KiB. `python -m benchmarks.bench_cpu_malloc` counts the faults
and times bench_engine's workload with and without this (kernels_cpu/README.md has the results).

How vLLM does it: its CPU platform (`vllm/platforms/cpu.py: check_and_update_config`) puts
tcmalloc in `LD_PRELOAD` for the worker process (`vllm/v1/worker/cpu_worker.py` warns when it is
missing) — an allocator that keeps freed memory in per-size caches. A library cannot preload an
allocator into a process that is already running, so we tell glibc's own malloc, with `mallopt`,
to do the same thing for this process: never `mmap` a block (M_MMAP_MAX = 0: every block comes
from the heap, and a freed block goes back to malloc's free lists, ready for the next request of
that size) and never trim the heap (M_TRIM_THRESHOLD at its maximum). The cost: the process keeps
its peak heap (the engine reaches that peak in its first prefill step and then reuses it). The
engine applies it after loading the model, and it first returns what is free at that moment
(`malloc_trim`): the unpacked weights that packing dropped are not kept.

Process-wide and for the rest of the process's life (malloc has one configuration per process):
`kernels_cpu.configure_process()` applies it, which the engine calls at start-up on a CPU while its
CPU kernels are on (`EngineConfig.cpu_kernels="auto"`) unless `cpu_keep_freed_memory` is False.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

# glibc's <malloc.h> parameter numbers (stable ABI since glibc 2.0).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_MAX = 2**31 - 1          # mallopt takes an int: the largest threshold it can say


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def keep_freed_memory() -> str | None:
    """Configure this process's malloc to keep and reuse what it frees. Returns None when done (or
    already done), else why it could not be (not glibc: musl, macOS; such systems keep their
    default allocator and lose only speed)."""
    libc = _glibc()
    if libc is None:
        return f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'unknown libc'}): malloc left as it is"
    libc.malloc_trim(0)                    # what is free now (e.g. weights dropped after packing) goes back
    # mallopt returns 1 on success, 0 on error.
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX) != 1:
        return "glibc's mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD"
    return None
