"""The CUDA rejection sampler == the reference, token for token, run on the CPU by the emulator
(kernels_cuda/emulator): the REAL kernels_cuda/rejection_sampler.cu — kernel and launcher
(grid of one block per request, 256 threads, the empty-batch early return) — compiled with g++,
one host thread per CUDA thread; warp shuffles and __syncthreads become barriers between real
threads. The same cases run on a GPU in tests/kernels_cuda/test_rejection_sampler_cuda.py.
"""
import ctypes

import pytest
import torch

from kernels_cuda import emulator
from spec_decode.ops import rejection_sample
from spec_decode.synthetic import make_rejection_case
from tolerances import assert_equal

# One warp per request: a configuration the launcher does not use (it launches 256 threads),
# kept to check the block argmax when a block is a single warp.
ONE_WARP = """
int rejection_sample_one_warp(int32_t* out, const int32_t* cu_num_draft, const int32_t* draft_ids,
                              const float* draft_probs, const float* target_probs, const int32_t* target_argmax,
                              const int32_t* bonus_ids, const int8_t* is_greedy, const float* uniform,
                              const float* inv_exp, int batch, int vocab, int out_stride, int64_t stream) {
  const auto kernel = vfs::rejection_sample_kernel<32>;
  VFS_LAUNCH(kernel, batch, 32, 0, reinterpret_cast<cudaStream_t>(stream))(
      out, cu_num_draft, draft_ids, draft_probs, target_probs, target_argmax, bonus_ids, is_greedy, uniform, inv_exp,
      vocab, out_stride);
  return static_cast<int>(cudaGetLastError());
}
"""
ONE_WARP_SIGNATURE = ("int rejection_sample_one_warp(int32_t*, const int32_t*, const int32_t*, const float*, const float*, "
                      "const int32_t*, const int32_t*, const int8_t*, const float*, const float*, int, int, int, int64_t)")


@pytest.fixture(scope="module")
def emu():
    """rejection_sampler.cu, emulated (built once per source version, cached under ~/.cache)."""
    try:
        return emulator.load("rejection_sampler", extra_source=ONE_WARP, extra_launchers=[ONE_WARP_SIGNATURE])
    except emulator.EmulatorUnavailable as e:
        pytest.skip(str(e))


def ptr(t):
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def emulate(emu, case, num_threads=256):
    """What rejection_sampler_binding.cpp does for cuda_ops.rejection_sample: the launcher
    vfs_rejection_sample on raw pointers (num_threads=32: the one-warp configuration above)."""
    i32 = lambda t: None if t is None else t.to(torch.int32).contiguous()      # noqa: E731
    batch, vocab = case.inv_exponential.shape
    out = torch.full((batch, case.max_spec_len + 1), -7, dtype=torch.int32)  # -7: anything not written shows
    keep = [i32(case.cu_num_draft_tokens), i32(case.draft_token_ids), case.draft_probs, case.target_probs,
            i32(case.target_argmax), i32(case.bonus_token_ids),
            None if case.is_greedy is None else case.is_greedy.to(torch.int8), case.uniform_probs,
            case.inv_exponential]
    launch = {256: emu.vfs_rejection_sample, 32: emu.rejection_sample_one_warp}[num_threads]
    rc = launch(ptr(out), *(ptr(t) for t in keep), batch, vocab, case.max_spec_len + 1, 0)
    assert rc == 0, emu.vfs_rejection_sampler_error_string(rc).decode()
    return out


@pytest.mark.parametrize("ngram", [False, True])
@pytest.mark.parametrize("greedy", [None, [False, True, False, False, True, False]])
def test_equals_reference(emu, ngram, greedy):
    # vocab 1000 > 256 threads: several elements per thread; 300-token rows; 0-draft request.
    case = make_rejection_case([3, 5, 0, 1, 6, 2], 1000, greedy=greedy, ngram=ngram, seed=21, extra_spec_len=2)
    assert_equal(emulate(emu, case), rejection_sample(*case.args(), backend="reference"), "output token ids")


@pytest.mark.parametrize("seed", range(4))
def test_small_vocab_and_one_warp(emu, seed):
    """vocab < threads (idle lanes with INT_MAX indices) and a 32-thread block (one warp)."""
    case = make_rejection_case([2, 4, 1], 5 + seed * 17, seed=seed)
    ref = rejection_sample(*case.args(), backend="reference")
    assert_equal(emulate(emu, case), ref, "output token ids")
    assert_equal(emulate(emu, case, num_threads=32), ref, "output token ids, 32 threads")


def test_argmax_ties_go_to_the_smallest_index(emu):
    """Every residual entry equal and the race weights all 1: torch.argmax picks index 0 of
    the residual's support; so must the block reduction, whichever warp finds it first."""
    V = 600
    case = make_rejection_case([1], V, seed=0)
    case.draft_token_ids[:] = 5
    case.draft_probs = torch.zeros(1, V)
    case.draft_probs[0, 5] = 1.0
    case.target_probs = torch.zeros(1, V)
    case.target_probs[0, 300:] = 1.0 / 300                  # the tie spans warps; p(5) = 0 -> rejected
    case.inv_exponential = torch.ones(1, V)
    ref = rejection_sample(*case.args(), backend="reference")
    assert ref[0, 0] == 300
    assert_equal(emulate(emu, case), ref, "output token ids")


def test_all_greedy_without_probabilities(emu):
    case = make_rejection_case([3, 2, 4], 64, greedy=[True, True, True], seed=5)
    case.target_probs = None
    assert_equal(emulate(emu, case), rejection_sample(*case.args(), backend="reference"), "output token ids")
