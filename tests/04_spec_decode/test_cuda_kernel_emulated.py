"""The CUDA rejection sampler (kernels_cuda/rejection_sampler.cuh) == the reference, token for
token, executed on the CPU by a thread-per-CUDA-thread emulator (cuda_emulation/).

The device code is compiled unchanged with g++; warp shuffles and __syncthreads become
barriers between real threads. The same cases run on a GPU in
tests/kernels_cuda/test_rejection_sampler_cuda.py.
"""
import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

from spec_decode.ops import rejection_sample
from spec_decode.synthetic import make_rejection_case

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels_cuda"
EMULATOR = pathlib.Path(__file__).resolve().parent / "cuda_emulation" / "emulate_rejection.cpp"


@pytest.fixture(scope="module")
def emu():
    """Build once per source version (cached under ~/.cache), load with ctypes."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    sources = [EMULATOR, KERNELS / "rejection_sampler.cuh"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "vllm_from_scratch"
    lib = cache / f"rejection_emulator_{digest}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-I", str(KERNELS), str(EMULATOR),
               "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


def ptr(t):
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def emulate(emu, case, num_threads=256):
    """Mirror of cuda_ops.rejection_sample + the binding, calling the emulator."""
    i32 = lambda t: None if t is None else t.to(torch.int32).contiguous()      # noqa: E731
    batch, vocab = case.inv_exponential.shape
    out = torch.full((batch, case.max_spec_len + 1), -7, dtype=torch.int32)  # -7: anything not written shows
    keep = [i32(case.cu_num_draft_tokens), i32(case.draft_token_ids), case.draft_probs, case.target_probs,
            i32(case.target_argmax), i32(case.bonus_token_ids),
            None if case.is_greedy is None else case.is_greedy.to(torch.int8), case.uniform_probs,
            case.inv_exponential]
    rc = emu.emu_rejection_sample(ptr(out), *(ptr(t) for t in keep), batch, vocab, case.max_spec_len + 1, num_threads)
    assert rc == 0
    return out


@pytest.mark.parametrize("ngram", [False, True])
@pytest.mark.parametrize("greedy", [None, [False, True, False, False, True, False]])
def test_equals_reference(emu, ngram, greedy):
    # vocab 1000 > 256 threads: several elements per thread; 300-token rows; 0-draft request.
    case = make_rejection_case([3, 5, 0, 1, 6, 2], 1000, greedy=greedy, ngram=ngram, seed=21, extra_spec_len=2)
    assert torch.equal(emulate(emu, case), rejection_sample(*case.args(), backend="reference"))


@pytest.mark.parametrize("seed", range(4))
def test_small_vocab_and_one_warp(emu, seed):
    """vocab < threads (idle lanes with INT_MAX indices) and a 32-thread block (one warp)."""
    case = make_rejection_case([2, 4, 1], 5 + seed * 17, seed=seed)
    ref = rejection_sample(*case.args(), backend="reference")
    assert torch.equal(emulate(emu, case), ref)
    assert torch.equal(emulate(emu, case, num_threads=32), ref)


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
    assert torch.equal(emulate(emu, case), ref)


def test_all_greedy_without_probabilities(emu):
    case = make_rejection_case([3, 2, 4], 64, greedy=[True, True, True], seed=5)
    case.target_probs = None
    assert torch.equal(emulate(emu, case), rejection_sample(*case.args(), backend="reference"))
