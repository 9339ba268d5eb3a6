"""kernels_cuda/copy_blocks.cu == the reference copy_blocks, run on the CPU by the emulator
(kernels_cuda/emulator): the real launcher (grid (num_pairs, num_caches), min(1024, words)
threads, the word type from vec_bytes) and kernel, compiled with g++, one host thread per CUDA
thread. What it checks: the pair/cache indexing and the word loop, for every word width the
launcher picks, with blocks larger than a thread block (the loop strides). In a course's
student edition a stripped kernel's throw comes back as a launch failure naming the task.
"""
import ctypes

import pytest
import torch

from kernels_cuda import emulator
from kvcache import reference as ref
from tolerances import assert_equal


@pytest.fixture(scope="module")
def emu():
    try:
        return emulator.load("copy_blocks")
    except emulator.EmulatorUnavailable as e:
        pytest.skip(str(e))


def run_emulated(emu, caches, mapping, vec_bytes):
    """What copy_blocks_binding.cpp does: a device table of the caches' base addresses, then
    the launcher. All caches share one block size (bytes)."""
    bytes_per_block = caches[0][0].numel() * caches[0].element_size()
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    m = mapping.to(torch.int64).contiguous()
    rc = emu.copy_blocks_launch(ptrs.data_ptr(), ptrs.data_ptr(), m.data_ptr(), len(caches), m.shape[0],
                                bytes_per_block, vec_bytes, 0)
    assert rc == 0, emu.copy_blocks_error_string(rc).decode()


@pytest.mark.parametrize("vec_bytes", [16, 8, 4, 2, 1])
def test_copy_blocks_kernel_equals_reference(emu, vec_bytes):
    g = torch.Generator().manual_seed(vec_bytes)
    # 17408 bytes per block: 1088 uint4 words > 1024 threads, so every width strides.
    keys = [torch.randn(6, 16, 2, 136, generator=g) for _ in range(2)]
    values = [torch.randn(6, 16, 2, 136, generator=g) for _ in range(2)]
    mapping = torch.tensor([[0, 3], [5, 1], [2, 4]])
    want_k, want_v = [k.clone() for k in keys], [v.clone() for v in values]
    ref.copy_blocks(want_k, want_v, mapping)
    run_emulated(emu, keys + values, mapping, vec_bytes)
    for got, want in zip(keys + values, want_k + want_v):
        assert_equal(got, want, "cache after copy_blocks")


def test_copy_blocks_kernel_fp16_blocks_larger_than_a_thread_block(emu):
    caches = [torch.arange(3 * 16 * 8 * 128, dtype=torch.float16).reshape(3, 16, 8, 128).clone()]
    want = caches[0].clone()
    want[0] = want[2]                                                    # 32 KiB blocks: 2048 words, 1024 threads
    run_emulated(emu, caches, torch.tensor([[2, 0]]), 16)
    assert_equal(caches[0], want, "cache after copy_blocks")
