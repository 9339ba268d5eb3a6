"""python -m kernels_cpu                           build (or load) every kernel for this CPU, say which variant
   python -m kernels_cpu build KERNEL:ISA ...      build these variants (the test session prebuilds with it)

KERNEL is attention, gemm, layer_ops or quant_gemm; ISA one of build.ALL_ISAS."""
from __future__ import annotations

import sys

import torch

from kernels_cpu import attention, build, gemm, layer_ops, quant_gemm

LOADERS = {"attention": attention.load, "gemm": gemm.load_kernel, "layer_ops": layer_ops.load,
           "quant_gemm": quant_gemm.load}


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        failed = 0
        for job in argv[1:]:                     # each on its own: one failed build does not stop the rest
            kernel, _, isa = job.partition(":")
            try:
                LOADERS[kernel](isa or None)
            except (KeyError, RuntimeError, ValueError) as e:
                print(f"{job}: {type(e).__name__}: {e}", file=sys.stderr)
                failed += 1
        return 1 if failed else 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    if reason := build.missing_build_tool():
        print(f"cannot build the CPU kernels here: {reason}", file=sys.stderr)
        return 1
    for kernel, load in LOADERS.items():
        module = load()
        units = [name.upper() for name in ("vnni", "amx") if getattr(module, name, lambda: False)()]
        print(f"{kernel}: {module.isa()}" + (f" ({', '.join(units)})" if units else ""))
    print(f"{torch.get_num_threads()} threads, compiler {build.compiler()}, "
          f"runnable variants {', '.join(build.runnable_isas())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
