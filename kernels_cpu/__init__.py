"""CPU kernels (C++ + OpenMP + AVX-512 / AVX2 / scalar) and the machinery that builds them — a
leaf package like kernels_cuda: it imports torch only, never a chapter. The chapters and the
engine reach it through one seam each: the "cpu" attention backend (chapters 01 and 05), the
engine's linear methods and CustomOps (chapter 07, `EngineConfig.cpu_kernels`).

    attention.py   paged attention (decode, prefill, chunked prefill) reading K/V in place, + the cache write
    gemm.py        linears on weights packed once: our column-panel kernel, and oneDNN's (vLLM's choice)
    layer_ops.py   RMSNorm (+ residual add), SiLU-and-mul, split + RoPE of the qkv projection, fused
    quant_gemm.py  int4 / int8 weights read straight by the matmul (WNA16), int8 x int8 (W8A8): chapter 10's "cpu"
    malloc.py      keep freed memory in the process (a prefill step stops page-faulting its buffers)
    build.py       compile per instruction set on first use, choose the best the CPU runs, load
    simde.py       SIMDe's headers: the AVX-512 code emulated on AVX2 machines (tests)
    csrc/          the C++ (vec.h: the vector wrapper every kernel is written against)
    dev/           the tuning steps as builds you can run: `python -m kernels_cpu.dev.attention`, `.gemm`

`python -m kernels_cpu` builds the kernels for this CPU and says which variant it runs.
README.md says why each kernel exists and how it is tested.
"""
from __future__ import annotations


def configure_process() -> str | None:
    """The process-wide settings the CPU kernels want, applied once an engine has loaded its
    model: malloc keeps what it frees for reuse (malloc.py). Returns None when applied, else why
    it could not be (not glibc: the process keeps its allocator and loses only speed)."""
    from kernels_cpu import malloc
    return malloc.keep_freed_memory()
