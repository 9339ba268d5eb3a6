"""kernels_cuda/copy_blocks.cu's kernel == the reference copy_blocks, run on the CPU.

The chapter emulators (tests/01_paged_attention/cuda_emulation) compile .cuh device code;
copy_blocks_kernel lives in a .cu next to its launcher (`<<<...>>>`, which g++ cannot
parse), so this harness cuts the kernel template out of the file, compiles it unchanged
with g++ (blockIdx/threadIdx/blockDim become host variables; the kernel has no barriers, so
its threads can run one after another) and launches it grid by grid, block by block. What it
checks: the pair/cache indexing and the word loop, for every word width the launcher picks.
It is the grading test of the CUDA copy_blocks task (course/tasks.toml).
"""
import ctypes
import hashlib
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

from kvcache import reference as ref

ROOT = pathlib.Path(__file__).resolve().parents[3]
SOURCE = ROOT / "kernels_cuda" / "copy_blocks.cu"

HARNESS = r'''
#include <cstdint>
#include <vector_types.h>
namespace emu { struct D3 { unsigned x = 0, y = 0, z = 0; }; D3 block_idx, thread_idx, block_dim; }
#define __global__
#define blockIdx emu::block_idx
#define threadIdx emu::thread_idx
#define blockDim emu::block_dim
namespace vfs {
KERNEL
}
template <typename Word>
static void run(const int64_t* s, const int64_t* d, const int64_t* m, int64_t caches, int64_t pairs, int64_t words,
                unsigned threads) {
  emu::block_dim.x = threads;
  for (int64_t c = 0; c < caches; ++c)
    for (int64_t p = 0; p < pairs; ++p)
      for (unsigned t = 0; t < threads; ++t) {
        emu::block_idx.x = unsigned(p); emu::block_idx.y = unsigned(c); emu::thread_idx.x = t;
        vfs::copy_blocks_kernel<Word>(s, d, m, words);
      }
}
extern "C" int emu_copy_blocks(const int64_t* s, const int64_t* d, const int64_t* m, int64_t caches, int64_t pairs,
                               int64_t bytes_per_block, int64_t vec_bytes, unsigned threads) {
  const int64_t words = bytes_per_block / vec_bytes;
  try {
    switch (vec_bytes) {
      case 16: run<uint4>(s, d, m, caches, pairs, words, threads); return 0;
      case 8: run<uint2>(s, d, m, caches, pairs, words, threads); return 0;
      case 4: run<uint32_t>(s, d, m, caches, pairs, words, threads); return 0;
      case 2: run<uint16_t>(s, d, m, caches, pairs, words, threads); return 0;
      case 1: run<uint8_t>(s, d, m, caches, pairs, words, threads); return 0;
    }
  } catch (...) {
    return -2;   // a stripped kernel (course assignments) throws: NotImplementedError
  }
  return -1;
}
'''


def cuda_include_dir():
    for c in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda",
              str(pathlib.Path(shutil.which("nvcc")).resolve().parents[1]) if shutil.which("nvcc") else ""]:
        if c and (pathlib.Path(c) / "include" / "vector_types.h").exists():
            return pathlib.Path(c) / "include"
    return None


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    include = cuda_include_dir()
    if include is None or shutil.which("g++") is None:
        pytest.skip("needs g++ and the CUDA headers (vector_types.h)")
    text = SOURCE.read_text()
    match = re.search(r"template <typename Word>\n__global__ void copy_blocks_kernel\(.*?\n}\n", text, re.S)
    assert match, "copy_blocks_kernel not found in kernels_cuda/copy_blocks.cu"
    code = HARNESS.replace("KERNEL", match.group(0))
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    out = tmp_path_factory.mktemp("copy_emu")
    src, lib = out / f"copy_{digest}.cpp", out / f"copy_{digest}.so"
    src.write_text(code)
    proc = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-I", str(include), str(src),
                           "-o", str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ctypes.CDLL(str(lib))


def run_emulated(emu, caches, mapping, vec_bytes, threads=64):
    bytes_per_block = caches[0][0].numel() * caches[0].element_size()
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    m = mapping.to(torch.int64).contiguous()
    rc = emu.emu_copy_blocks(ctypes.c_void_p(ptrs.data_ptr()), ctypes.c_void_p(ptrs.data_ptr()),
                             ctypes.c_void_p(m.data_ptr()), ctypes.c_int64(len(caches)), ctypes.c_int64(m.shape[0]),
                             ctypes.c_int64(bytes_per_block), ctypes.c_int64(vec_bytes), ctypes.c_uint(threads))
    assert rc == 0, "the kernel raised NotImplementedError" if rc == -2 else f"emulator returned {rc}"


@pytest.mark.parametrize("vec_bytes", [16, 8, 4, 2, 1])
def test_copy_blocks_kernel_equals_reference(emu, vec_bytes):
    g = torch.Generator().manual_seed(vec_bytes)
    keys = [torch.randn(6, 4, 2, 8, generator=g) for _ in range(2)]      # 256 bytes per block
    values = [torch.randn(6, 4, 2, 8, generator=g) for _ in range(2)]
    mapping = torch.tensor([[0, 3], [5, 1], [2, 4]])
    want_k, want_v = [k.clone() for k in keys], [v.clone() for v in values]
    ref.copy_blocks(want_k, want_v, mapping)
    run_emulated(emu, keys + values, mapping, vec_bytes, threads=5)      # fewer threads than words: the loop strides
    for got, want in zip(keys + values, want_k + want_v):
        assert torch.equal(got, want)


def test_copy_blocks_kernel_fp16_blocks_larger_than_a_thread_block(emu):
    caches = [torch.arange(3 * 16 * 64, dtype=torch.float16).reshape(3, 16, 1, 64).clone()]
    want = caches[0].clone()
    want[0] = want[2]                                                    # 2 KiB blocks, 32 threads
    run_emulated(emu, caches, torch.tensor([[2, 0]]), 16, threads=32)
    assert torch.equal(caches[0], want)
