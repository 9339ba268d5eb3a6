"""kernels_cpu.malloc.keep_freed_memory (through kernels_cpu.configure_process): afterwards a big
buffer freed and allocated again is served from memory the process kept, not faulted back in page
by page (malloc.py says why this costs prefill ~10%). Each case runs in its own process: malloc's
configuration is process-wide and cannot be undone. The engine applying it (and not with
cpu_kernels="off"): tests/07_mini_vllm/test_cpu_kernels.py."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kernels_cpu import malloc

# Configures malloc (or not), then counts the minor page faults of malloc + filling 64 MiB that was
# just freed (16384 pages of 4 KiB). Plain malloc/free through ctypes: what keep_freed_memory
# promises, without an allocator in between. (Through torch, whose allocator asks for aligned
# blocks, the reuse also depends on what else was allocated since; the engine-level probe in
# tests/07_mini_vllm/test_cpu_kernels.py measures that in a running engine.)
PROBE = textwrap.dedent("""
    import ctypes, json, resource, sys
    if sys.argv[1] == "configured":
        import kernels_cpu
        assert kernels_cpu.configure_process() is None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def faults_of_a_fresh_64_mib_buffer():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = libc.malloc(64 << 20)
        ctypes.memset(x, 1, 64 << 20)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        libc.free(x)
        return after - before
    faults_of_a_fresh_64_mib_buffer()                        # the first time, the pages are new either way
    print(json.dumps(min(faults_of_a_fresh_64_mib_buffer() for _ in range(3))))
""")
PAGES_IN_64_MIB = (64 << 20) // 4096


def faults_after(mode: str) -> int:
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(malloc._glibc() is None, reason="keep_freed_memory configures glibc's malloc")
def test_a_configured_process_keeps_freed_memory_for_reuse():
    assert faults_after("default malloc") >= PAGES_IN_64_MIB * 0.9     # every reuse faults in every page
    assert faults_after("configured") < PAGES_IN_64_MIB * 0.05         # the freed block is handed back


def test_keep_freed_memory_says_whether_it_applied():
    # In a fresh process as well: applied in this one, it would stay for the rest of the test run.
    # Twice: a second call (a second engine in the process) is fine too.
    code = "from kernels_cpu import malloc; print(json.dumps([malloc.keep_freed_memory(), malloc.keep_freed_memory()]))"
    proc = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for reason in json.loads(proc.stdout.strip().splitlines()[-1]):
        if malloc._glibc() is None:
            assert reason and "not glibc" in reason
        else:
            assert reason is None
