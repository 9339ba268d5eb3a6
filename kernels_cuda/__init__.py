"""CUDA C++ kernels and their loader — a leaf package; chapters reach it only through
their backend dispatch (`backend="cuda"`).

Layout, one op family per pair of files:
    <name>.cu           device code + a host launcher taking raw pointers and a stream
                        (no torch or c10 includes, so `nvcc` compiles it on any machine)
    <name>_binding.cpp  the torch binding (torch/extension.h only, no c10/cuda): checks
                        tensors, passes data_ptr()s and the stream as an int to the launcher
    launch.cuh          VFS_LAUNCH(kernel, grid, block, smem, stream)(args...): `<<<...>>>`
                        under nvcc, the emulator's launch under g++ — the only seam
    emulator/           the CPU emulator: compiles a .cu file, launcher included, with g++
                        and runs it on host threads (`emulator.load(name)`, ctypes)

Why split like this: a CPU-only torch cannot build CUDA extensions, but CI still must
prove the kernels compile and compute the right thing. `nvcc -cubin` on the bare .cu file
is the first proof on CPU machines (see `nvcc_compile`); the emulator running that same
file is the second; the full extension is built on demand on a GPU machine.
"""
from __future__ import annotations

import functools
import pathlib
import shutil
import subprocess

SRC_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT_ARCH = "sm_90a"   # Hopper (H100/H200), the GPUs this project is measured on


def cu_sources() -> list[pathlib.Path]:
    return sorted(SRC_DIR.glob("*.cu"))


def nvcc_compile(cu_file: str | pathlib.Path, arch: str = DEFAULT_ARCH, out_dir: str | pathlib.Path | None = None) -> str:
    """Compile one .cu file to a cubin with `nvcc`; return its `--resource-usage` report
    (registers, shared memory, spills per kernel). Raises RuntimeError with nvcc's output."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH (CUDA toolkit needed to compile the kernels)")
    cu_file = pathlib.Path(cu_file)
    out = pathlib.Path(out_dir or "/tmp") / (cu_file.stem + f".{arch}.cubin")
    cmd = [nvcc, f"-arch={arch}", "-cubin", "--resource-usage", "-O3", "-std=c++17",
           "-I", str(SRC_DIR), "-o", str(out), str(cu_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {cu_file.name}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout + proc.stderr


@functools.cache
def load(name: str):
    """Build (once per process, cached on disk by torch) and import the extension `name`
    from <name>.cu + <name>_binding.cpp. Needs a CUDA build of torch and a GPU."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError(f"the CUDA backend needs a GPU: kernels_cuda.load({name!r}) called without CUDA "
                           "(use backend='torch' or 'triton' on CPU)")
    from torch.utils.cpp_extension import load as load_extension
    cu, cpp = SRC_DIR / f"{name}.cu", SRC_DIR / f"{name}_binding.cpp"
    for f in (cu, cpp):
        if not f.exists():
            raise FileNotFoundError(f"kernels_cuda: missing {f.name}")
    return load_extension(
        name=f"vfs_{name}", sources=[str(cpp), str(cu)],
        extra_cuda_cflags=["-O3", "-std=c++17"],
        extra_include_paths=[str(SRC_DIR)], verbose=False)
