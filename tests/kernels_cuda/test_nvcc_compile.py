"""Every .cu file in kernels_cuda/ compiles for Hopper (sm_90a) with nvcc — on CPU machines
too, where nothing can run them. Also guards against register spills, which on a GPU turn
a memory-bound kernel into a local-memory-bound one."""
import re
import shutil

import pytest

import kernels_cuda

SOURCES = kernels_cuda.cu_sources()


def test_there_are_kernels():
    assert SOURCES, "kernels_cuda/ holds no .cu files"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not installed")
@pytest.mark.parametrize("cu_file", SOURCES, ids=[p.stem for p in SOURCES])
def test_compiles_for_sm90_without_spills(cu_file, tmp_path):
    report = kernels_cuda.nvcc_compile(cu_file, out_dir=tmp_path)
    assert (tmp_path / f"{cu_file.stem}.sm_90a.cubin").stat().st_size > 0
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", report)]
    assert not any(spills), f"register spills in {cu_file.name}:\n{report}"
