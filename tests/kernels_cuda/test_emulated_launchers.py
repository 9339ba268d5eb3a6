"""The CPU emulator (kernels_cuda/emulator) runs the REAL launchers of kernels_cuda/*.cu, not a
copy of them: their early returns, dispatch and error codes come back through it. And the
emulator itself behaves like the driver where the launchers depend on it (launch limits,
shared-memory opt-in, threads that return early, fp16/bf16 rounding), and reports what it
cannot run (a shuffle nobody answered, a course stub's throw) as a launch failure.

The kernels' results are checked in the chapters' emulated tests
(tests/01_paged_attention/, tests/04_spec_decode/test_cuda_kernels_emulated.py,
tests/kernels_cuda/test_copy_blocks_emulated.py).
"""
import ctypes
import pathlib
import shutil

import pytest
import torch

from kernels_cuda import emulator

CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_CONFIGURATION, CUDA_ERROR_LAUNCH_FAILURE = 0, 1, 9, 719

# Probe kernels, compiled with swap_blocks.cu (the family with no kernel of its own: a fast build).
PROBES = r"""
namespace probe {
__global__ void one_write(int* out) { if (threadIdx.x == 0) out[0] = 1; }
__global__ void one_write_opted_in(int* out) { if (threadIdx.x == 0) out[0] = 1; }
// Odd threads return at once; the even ones meet at two barriers, then write.
__global__ void early_return(int* out) {
  if (threadIdx.x % 2) return;
  __syncthreads();
  __syncthreads();
  out[threadIdx.x] = 1;
}
// Lane 0 returns; the other lanes read its value.
__global__ void shuffle_from_returned_lane(int* out) {
  if (threadIdx.x == 0) return;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x), 0);
}
// A 2-D block of 16 x 4 threads = 2 warps: the xor butterfly sums each warp's linear ids.
__global__ void warp_sums(int* out) {
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  int x = t;
  for (int mask = 16; mask >= 1; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  out[blockIdx.x * 64 + t] = x;
}
// Each block reads the first word of dynamic shared memory before writing it.
__global__ void read_before_write(int* out) {
  VFS_DYNAMIC_SHARED(int, smem);
  if (threadIdx.x == 0) {
    out[blockIdx.x] = smem[0];
    smem[0] = 7;
  }
}
}  // namespace probe

int launch_probe(int which, int* out, int64_t smem) {
  switch (which) {
    case 0: VFS_LAUNCH(probe::one_write, 1, 32, smem, nullptr)(out); break;
    case 1: {
      const auto kernel = probe::one_write_opted_in;
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)))
        return static_cast<int>(cudaGetLastError());
      VFS_LAUNCH(kernel, 1, 32, smem, nullptr)(out);
      break;
    }
    case 2: VFS_LAUNCH(probe::early_return, 2, 64, 0, nullptr)(out); break;
    case 3: VFS_LAUNCH(probe::shuffle_from_returned_lane, 1, 32, 0, nullptr)(out); break;
    case 4: VFS_LAUNCH(probe::warp_sums, 3, dim3(16, 4), 0, nullptr)(out); break;
    case 5: VFS_LAUNCH(probe::read_before_write, 3, 32, 16, nullptr)(out); break;
    case 6: VFS_LAUNCH(probe::one_write, 1, 1025, 0, nullptr)(out); break;
  }
  return static_cast<int>(cudaGetLastError());
}
const char* probe_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

void to_half_bits(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __float2half_rn(x[i]).__x;
}
void to_bfloat16_bits(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(x[i]).__x;
}
void from_half_bits(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __half2float(__half{x[i]});
}
void from_bfloat16_bits(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __bfloat162float(__nv_bfloat16{x[i]});
}
"""
PROBE_SIGNATURES = ["int launch_probe(int, int*, int64_t)", "const char* probe_error_string(int)",
                    "void to_half_bits(const float*, uint16_t*, int64_t)",
                    "void to_bfloat16_bits(const float*, uint16_t*, int64_t)",
                    "void from_half_bits(const uint16_t*, float*, int64_t)",
                    "void from_bfloat16_bits(const uint16_t*, float*, int64_t)"]


def load_or_skip(name, **kwargs):
    try:
        return emulator.load(name, **kwargs)
    except emulator.EmulatorUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def probes():
    return load_or_skip("swap_blocks", extra_source=PROBES, extra_launchers=PROBE_SIGNATURES)


def message(lib, fn: str, rc: int) -> str:
    return getattr(lib, fn)(rc).decode()


# ----------------------------------------------------------------------------- the launchers' own paths

def test_copy_blocks_launcher_paths():
    """copy_blocks.cu: no pairs -> 0 without a launch; a word width it has no kernel for ->
    cudaErrorInvalidValue from its switch; a supported one copies."""
    lib = load_or_skip("copy_blocks")
    cache = torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64)
    before = cache.clone()
    ptrs = torch.tensor([cache.data_ptr()], dtype=torch.int64)
    mapping = torch.tensor([[3, 0]], dtype=torch.int64)
    assert lib.copy_blocks_launch(ptrs.data_ptr(), ptrs.data_ptr(), mapping.data_ptr(), 1, 0, 256, 16, 0) == 0
    assert torch.equal(cache, before)
    rc = lib.copy_blocks_launch(ptrs.data_ptr(), ptrs.data_ptr(), mapping.data_ptr(), 1, 1, 256, 3, 0)
    assert rc == CUDA_ERROR_INVALID_VALUE and message(lib, "copy_blocks_error_string", rc) == "invalid argument"
    assert torch.equal(cache, before)
    assert lib.copy_blocks_launch(ptrs.data_ptr(), ptrs.data_ptr(), mapping.data_ptr(), 1, 1, 256, 16, 0) == 0
    assert torch.equal(cache[0], before[3]) and torch.equal(cache[1:], before[1:])


def test_swap_blocks_launcher_paths():
    """swap_blocks.cu: one cudaMemcpyAsync per pair in either direction (all memory is host
    memory in the emulator); host to host is refused with cudaErrorInvalidValue."""
    lib = load_or_skip("swap_blocks")
    gpu = torch.randn(5, 8, 2, 16)
    cpu = torch.zeros(3, 8, 2, 16)
    block_bytes = gpu[0].numel() * gpu.element_size()
    out_pairs = torch.tensor([[4, 0], [1, 2]], dtype=torch.int64)
    assert lib.swap_blocks_launch(gpu.data_ptr(), cpu.data_ptr(), out_pairs.data_ptr(), 2, block_bytes,
                                  True, False, 0) == 0
    assert torch.equal(cpu[0], gpu[4]) and torch.equal(cpu[2], gpu[1]) and not cpu[1].any()
    in_pairs = torch.tensor([[2, 3]], dtype=torch.int64)
    assert lib.swap_blocks_launch(cpu.data_ptr(), gpu.data_ptr(), in_pairs.data_ptr(), 1, block_bytes,
                                  False, True, 0) == 0
    assert torch.equal(gpu[3], gpu[1])
    rc = lib.swap_blocks_launch(cpu.data_ptr(), cpu.data_ptr(), in_pairs.data_ptr(), 1, block_bytes, False, False, 0)
    assert rc == CUDA_ERROR_INVALID_VALUE and message(lib, "swap_blocks_error_string", rc) == "invalid argument"


def test_reshape_and_cache_launcher_paths():
    """cache_kernels.cu: no tokens -> 0 without a launch (a 0-block grid is an invalid
    configuration); an unknown dtype -> its 'unsupported dtype'; and the launcher returns
    cudaGetLastError(): a 0-thread block (num_kv_heads * head_size == 0) comes back as
    cudaErrorInvalidConfiguration."""
    lib = load_or_skip("cache_kernels")
    key = torch.randn(2, 1, 64)
    cache = torch.zeros(2, 8, 1, 64)
    slots = torch.tensor([3, 9], dtype=torch.int64)
    strides = (ctypes.c_int64 * 10)(64, 64, 64, 64, 512, 64, 64, 512, 64, 64)
    args = [key.data_ptr(), key.data_ptr(), cache.data_ptr(), cache.data_ptr(), slots.data_ptr()]
    assert lib.vfs_reshape_and_cache(0, True, *args, 0, 8, 1, 64, strides, 0) == 0
    assert not cache.any()
    rc = lib.vfs_reshape_and_cache(7, True, *args, 2, 8, 1, 64, strides, 0)
    assert rc == -1 and message(lib, "vfs_cache_kernels_error_string", rc) == "unsupported dtype"
    rc = lib.vfs_reshape_and_cache(0, True, *args, 2, 8, 1, 0, strides, 0)
    assert rc == CUDA_ERROR_INVALID_CONFIGURATION
    assert message(lib, "vfs_cache_kernels_error_string", rc) == "invalid configuration argument"
    assert not cache.any()
    assert lib.vfs_reshape_and_cache(0, True, *args, 2, 8, 1, 64, strides, 0) == 0
    assert torch.equal(cache[0, 3], key[0]) and torch.equal(cache[1, 1], key[1])


def test_rejection_sampler_launcher_skips_an_empty_batch():
    lib = load_or_skip("rejection_sampler")
    out = torch.full((1, 4), -7, dtype=torch.int32)
    assert lib.vfs_rejection_sample(out.data_ptr(), *[None] * 9, 0, 10, 4, 0) == 0
    assert (out == -7).all()


def test_a_course_stub_fails_the_launch_naming_its_task(tmp_path):
    """course/ replaces a solution region by a throw (on the host) named after the task: the
    emulator turns it into cudaErrorLaunchFailure, and the launcher's error string names it.
    (A student edition has no course/: skipped there.)"""
    R = pytest.importorskip("course.regions", reason="the course's grader (course/) is not in a student edition")
    kernels = tmp_path / "kernels_cuda"
    shutil.copytree(emulator.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("emulator", "__pycache__"))
    source = kernels / "copy_blocks.cu"
    text = source.read_text()
    task_of = {r.key: ("cuda_task4", "copy_blocks") for r in R.find_regions(text, "kernels_cuda/copy_blocks.cu")}
    assert task_of, "copy_blocks.cu has no solution region"
    source.write_text(R.strip(text, "kernels_cuda/copy_blocks.cu", task_of))
    lib = load_or_skip("copy_blocks", kernels_dir=kernels)
    cache = torch.zeros(2, 64)
    ptrs = torch.tensor([cache.data_ptr()], dtype=torch.int64)
    mapping = torch.tensor([[1, 0]], dtype=torch.int64)
    rc = lib.copy_blocks_launch(ptrs.data_ptr(), ptrs.data_ptr(), mapping.data_ptr(), 1, 1, 256, 16, 0)
    assert rc == CUDA_ERROR_LAUNCH_FAILURE
    assert "cuda_task4_NotImplementedError" in message(lib, "copy_blocks_error_string", rc)


# ----------------------------------------------------------------------------- the emulated driver

def test_dynamic_shared_memory_needs_the_opt_in_above_48_kb(probes):
    out = torch.zeros(1, dtype=torch.int32)
    assert probes.launch_probe(0, out.data_ptr(), 48 * 1024) == CUDA_SUCCESS and out[0] == 1
    out.zero_()
    rc = probes.launch_probe(0, out.data_ptr(), 48 * 1024 + 4)
    assert rc == CUDA_ERROR_INVALID_VALUE and out[0] == 0          # refused: nothing ran
    assert probes.launch_probe(1, out.data_ptr(), 100 * 1024) == CUDA_SUCCESS and out[0] == 1
    assert probes.launch_probe(1, out.data_ptr(), 228 * 1024) == CUDA_ERROR_INVALID_VALUE   # above 227 KB


def test_block_of_more_than_1024_threads_is_an_invalid_configuration(probes):
    out = torch.zeros(1, dtype=torch.int32)
    assert probes.launch_probe(6, out.data_ptr(), 0) == CUDA_ERROR_INVALID_CONFIGURATION and out[0] == 0


def test_threads_that_return_do_not_hold_back_syncthreads(probes):
    out = torch.zeros(64, dtype=torch.int32)
    assert probes.launch_probe(2, out.data_ptr(), 0) == CUDA_SUCCESS
    assert out.tolist() == [1, 0] * 32


def test_shuffles_on_a_2d_block(probes):
    """threadIdx.x fastest, warps of 32 consecutive linear ids; the xor butterfly gives each
    lane its warp's total."""
    out = torch.zeros(3 * 64, dtype=torch.int32)
    assert probes.launch_probe(4, out.data_ptr(), 0) == CUDA_SUCCESS
    per_block = [sum(range(32))] * 32 + [sum(range(32, 64))] * 32
    assert out.tolist() == per_block * 3


def test_a_shuffle_from_a_lane_that_returned_is_a_launch_failure(probes):
    out = torch.zeros(32, dtype=torch.int32)
    rc = probes.launch_probe(3, out.data_ptr(), 0)
    assert rc == CUDA_ERROR_LAUNCH_FAILURE
    assert "shuffle from lane 0, which is not at this shuffle" in message(probes, "probe_error_string", rc)
    assert probes.launch_probe(0, out.data_ptr(), 0) == CUDA_SUCCESS     # the failure is not sticky here


def test_dynamic_shared_memory_is_poisoned_before_every_block(probes):
    out = torch.zeros(3, dtype=torch.int32)
    assert probes.launch_probe(5, out.data_ptr(), 16) == CUDA_SUCCESS
    assert out.tolist() == [-1, -1, -1]          # 0xffffffff: never the previous block's 7


def test_fp16_and_bf16_conversions_round_like_torch(probes):
    """Round to nearest even, overflow to inf, subnormals, NaN: every 16-bit pattern back to
    float, and floats chosen near every rounding boundary to 16 bits."""
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    for dtype, from_bits, to_bits in ((torch.float16, probes.from_half_bits, probes.to_half_bits),
                                      (torch.bfloat16, probes.from_bfloat16_bits, probes.to_bfloat16_bits)):
        got = torch.empty(bits.numel(), dtype=torch.float32)
        from_bits(bits.data_ptr(), got.data_ptr(), bits.numel())
        want = bits.view(dtype).float()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])

        g = torch.Generator().manual_seed(0)
        finite = want[want.isfinite()]
        x = torch.cat([finite, finite * (1 + 2.0 ** -9), finite * (1 - 2.0 ** -12), torch.randn(100_000, generator=g),
                       torch.randn(10_000, generator=g) * 1e5, torch.randn(10_000, generator=g) * 1e-6,
                       torch.tensor([float("inf"), -float("inf"), 65520.0, 65519.99, 3.4e38])])
        out = torch.empty(x.numel(), dtype=torch.int16)
        to_bits(x.data_ptr(), out.data_ptr(), x.numel())
        assert torch.equal(out, x.to(dtype).view(torch.int16))
        nan = torch.full((1,), float("nan"))
        to_bits(nan.data_ptr(), out.data_ptr(), 1)
        assert torch.isnan(out[:1].view(dtype)).all()


def test_a_signature_that_is_not_the_launchers_does_not_build(monkeypatch):
    """LAUNCHERS is checked against the compiled .cu: calling through a wrong prototype would
    pass garbage, so it is a build error instead."""
    wrong = ["int copy_blocks_launch(const int64_t*, int64_t)", "const char* copy_blocks_error_string(int)"]
    monkeypatch.setitem(emulator.LAUNCHERS, "copy_blocks", wrong)
    with pytest.raises(RuntimeError, match="copy_blocks_launch: the signature in kernels_cuda/emulator LAUNCHERS"):
        load_or_skip("copy_blocks")
