"""The GEMM's register tile stays in registers, in every vector build: what the compiler made of
kernels_cpu/csrc/gemm.cpp's micro-kernel, read from its assembly.

Why a test of machine code: with the vector header's masked load on every panel load, GCC 12
kept the AVX-512 tile's 12 accumulators in a stack array and stored all 12 to it on every k
step — results exact, speed half of oneDNN's on an AVX-512 EPYC (`python -m
benchmarks.bench_cpu_gemm`), invisible to every numeric test. The AVX2 build of the same source
was fine. The micro-kernel (`tile`, with the constants above it) is compiled alone, as the
extension's compile flags for each ISA would, with no torch headers: about a second per ISA, and
no CPU with that ISA needed (only compiled, never run).
"""
from __future__ import annotations

import platform
import re
import subprocess

import pytest

from kernels_cpu import build

GEMM_SOURCE = build.CSRC / "gemm.cpp"                 # the source the engine's extension is built from
# The micro-kernel and what it uses: from the anonymous namespace's start to the first function after it.
KERNEL_START, KERNEL_END = "namespace {", "// All `rows` rows against one panel"
VECTOR_REGISTER = {"avx512": "zmm", "avx2": "ymm"}

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector builds only"),
    pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here"),
]


def micro_kernel_source() -> str:
    """gemm.cpp's tile<ROWS> with its constants, plus one instantiation of the full 4-row tile."""
    text = GEMM_SOURCE.read_text()
    assert KERNEL_START in text and KERNEL_END in text, \
        f"{GEMM_SOURCE.name} changed shape: update KERNEL_START/KERNEL_END in this test"
    kernel = text[text.index(KERNEL_START):text.index(KERNEL_END)]
    return ("#include <algorithm>\n#include <cstdint>\n#include <utility>\n#include \"vec.h\"\n"
            + kernel + "}  // namespace\n"
            "void tile4(const float* A, int64_t lda, const float* panel, int64_t K, float* C, int64_t ldc,\n"
            "           int n_valid, const char* fetch, int64_t fetch_lines) {\n"
            "  tile<4>(A, lda, panel, K, C, ldc, n_valid, fetch, fetch_lines);\n}\n")


def assembly(isa: str, tmp_path) -> str:
    src = tmp_path / "tile.cpp"
    src.write_text(micro_kernel_source())
    cmd = [build.compiler(), *build.BASE_CFLAGS, *build.isa_flags(isa),
           f"-I{build.CSRC}", "-S", "-o", "-", str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"compiling the micro-kernel failed:\n{done.stderr[-3000:]}"
    return done.stdout


def inner_loops(asm: str) -> list[list[str]]:
    """The bodies of the innermost loops: the instructions between a label and a later jump back
    to it, with no other label between (GCC emits the k loop as one such block per version)."""
    lines = [line.strip() for line in asm.splitlines()]
    where = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L\w+:", line)}
    bodies = []
    for i, line in enumerate(lines):
        jump = re.fullmatch(r"j\w+\s+(\.L\w+)", line)
        if jump and where.get(jump.group(1), i) < i:
            body = lines[where[jump.group(1)] + 1:i + 1]
            if not any(instruction.endswith(":") for instruction in body):
                bodies.append(body)
    return bodies


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_tile_accumulators_stay_in_registers(isa, tmp_path):
    reg = VECTOR_REGISTER[isa]
    fma_loops = [body for body in inner_loops(assembly(isa, tmp_path)) if any(line.startswith("vfmadd") for line in body)]
    assert fma_loops, "found no branch-free FMA loop in the micro-kernel's assembly: update inner_loops()"
    # A vector register stored to the stack frame inside the k loop: the tile went to memory.
    spill = re.compile(rf"vmov\w*\s+%{reg}\d+,\s*-?\d*\(%r[sb]p\)")
    stores = [line for body in fma_loops for line in body if spill.fullmatch(line)]
    assert not stores, (f"the {isa} tile's k loop stores vectors to the stack on every iteration ({len(stores)} stores) "
                        f"(its accumulators left the registers), e.g. {stores[:3]}")
