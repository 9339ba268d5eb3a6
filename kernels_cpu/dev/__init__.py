"""The tuning story of the CPU kernels as builds you can run (llm.c's dev/ folder, for C++).

Each kernel's source takes a version number at compile time (-DVFS_CPU_ATTENTION_VERSION=N,
-DVFS_CPU_GEMM_VERSION=N); the highest is what the engine builds. One command per kernel builds
every version, checks each against a plain-torch reference and times them on SmolLM2's shapes:

    python -m kernels_cpu.dev.attention        # 1: no tile prefetch, 2: + next-tile prefetch, 3: + touch_tile
    python -m kernels_cpu.dev.gemm             # 1: the register tile, 2: + next-panel prefetch
    ... --smoke                                # tiny shapes, validation only (tests run this)
"""
