"""The CUDA kernels (kernels_cuda/paged_attention.cuh, cache_kernels.cuh) == the reference,
executed on the CPU by a thread-per-CUDA-thread emulator (cuda_emulation/emulate.cpp).

This is how a GPU-less CI checks what the kernels COMPUTE (nvcc only proves they compile):
the device code is compiled unchanged with g++, __syncthreads and warp shuffles become
barriers between real threads. The same cases run on the real GPU in
tests/kernels_cuda/test_paged_attention_cuda.py.
"""
import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

from paged_attention import cuda_ops, reference as ref
from paged_attention.synthetic import index_views, make_paged_kv, random_query
from tolerances import assert_close

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels_cuda"
EMULATOR = pathlib.Path(__file__).resolve().parent / "cuda_emulation" / "emulate.cpp"
CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPES = list(CODES)


def cuda_include_dir() -> pathlib.Path | None:
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(pathlib.Path(nvcc).resolve().parents[1]))
    for c in candidates:
        if c and (pathlib.Path(c) / "include" / "cuda_fp16.h").exists():
            return pathlib.Path(c) / "include"
    return None


@pytest.fixture(scope="module")
def emu():
    """Build the emulator once per source version (cached under ~/.cache), load it with ctypes."""
    include = cuda_include_dir()
    if include is None or shutil.which("g++") is None:
        pytest.skip("needs g++ and the CUDA headers (cuda_fp16.h)")
    sources = [EMULATOR] + sorted(KERNELS.glob("*.cuh"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "vllm_from_scratch"
    lib = cache / f"cuda_emulator_{digest}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w",
               "-I", str(KERNELS), "-I", str(include), str(EMULATOR), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def emulate_decode(emu, version, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len):
    """Mirror of cuda_ops.paged_decode_attention + the binding, calling the emulator."""
    num_seqs, num_heads, head_dim = query.shape
    strides = (ctypes.c_int64 * 9)(block_tables.stride(0), query.stride(0), query.stride(1),
                                   *key_cache.stride()[:3], *value_cache.stride()[:3])
    out = torch.empty_like(query)
    args = [CODES[query.dtype], head_dim, key_cache.shape[1], ptr(out)]
    if version == "v2":
        parts = -(-max_seq_len // cuda_ops.PARTITION_SIZE)
        scratch = [torch.full((num_seqs, num_heads, parts), float("nan")) for _ in range(2)]
        scratch.append(torch.full((num_seqs, num_heads, parts, head_dim), float("nan")))
        args += [ptr(t) for t in scratch]
    args += [ptr(query), ptr(key_cache), ptr(value_cache), ptr(block_tables), ptr(seq_lens), num_seqs, num_heads,
             key_cache.shape[2], block_tables.shape[1], max_seq_len, ctypes.c_float(scale), strides]
    rc = getattr(emu, f"emu_paged_attention_{version}")(*args)
    assert rc == 0, f"emulator returned {rc}"
    return out


def check(emu, version, dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=seed, pad_id=-5, extra_table_width=1)
    q = random_query(len(seq_lens), num_heads, head_dim, dtype, seed=seed + 1)
    out = emulate_decode(emu, version, q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                         head_dim ** -0.5, max(seq_lens))
    assert_close(out, ref.dense_decode_attention(q, kv.keys, kv.values, head_dim ** -0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", cuda_ops.SUPPORTED_BLOCK_SIZES)
def test_v1_and_v2(emu, dtype, block_size):
    # GQA 4/2, a padding row, partial blocks, and a 600-token row = 2 partitions of 512 for v2.
    for version in ("v1", "v2"):
        check(emu, version, dtype, [37, 0, 600], 4, 2, 64, block_size)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_head_sizes(emu, head_dim):
    check(emu, "v1", torch.float16, [70, 3], 2, 1, head_dim, 16)
    check(emu, "v2", torch.bfloat16, [600], 2, 2, head_dim, 32)


def test_values_all_ones_give_exactly_ones(emu):
    kv = make_paged_kv([5, 1030], 1, 64, 16, torch.bfloat16)
    kv.value_cache[~torch.isnan(kv.value_cache)] = 1.0
    q = random_query(2, 4, 64, torch.bfloat16) * 4
    for version in ("v1", "v2"):
        out = emulate_decode(emu, version, q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 1.0, 1030)
        assert torch.equal(out, torch.ones_like(out))


def test_rows_the_kernel_cannot_serve_come_out_nan(emu):
    """seq_len beyond its block table (v1 and v2), or beyond the max_seq_len the launch was
    sized for (v1's logits buffer, v2's partition grid): NaN, never a silently wrong row."""
    kv = make_paged_kv([8, 600], 1, 64, 8, pad_id=-1)
    q = random_query(2, 2, 64)
    table_width = kv.block_tables.shape[1]
    for version in ("v1", "v2"):
        seq_lens = torch.tensor([table_width * 8 + 1, 600], dtype=torch.int32)   # row 0 overruns its table
        out = emulate_decode(emu, version, q, kv.key_cache, kv.value_cache, kv.block_tables, seq_lens, 0.1, 1000)
        assert torch.isnan(out[0]).all()
        assert_close(out[1], ref.dense_attention(q[1:2], kv.keys[1], kv.values[1], 0.1, causal=False)[0])
        out = emulate_decode(emu, version, q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1,
                             max_seq_len=500)    # stale hint: 600 > 500
        assert torch.isnan(out[1]).all()
        assert not torch.isnan(out[0]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(emu, dtype):
    g = torch.Generator().manual_seed(0)
    key = torch.randn(6, 2, 64, generator=g).to(dtype)
    value = torch.randn(6, 2, 64, generator=g).to(dtype)
    slots = [5, 17, -1, 0, 31, 8]
    expected_k = torch.zeros(4, 8, 2, 64, dtype=dtype)
    expected_v = torch.zeros_like(expected_k)
    for t, s in enumerate(slots):
        if s >= 0:
            expected_k[s // 8, s % 8], expected_v[s // 8, s % 8] = key[t], value[t]
    for slot_dtype in (torch.int64, torch.int32):
        key_cache, value_cache = torch.zeros_like(expected_k), torch.zeros_like(expected_v)
        strides = (ctypes.c_int64 * 10)(key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                        *key_cache.stride()[:3], *value_cache.stride()[:3])
        slot_mapping = torch.tensor(slots, dtype=slot_dtype)
        rc = emu.emu_reshape_and_cache(CODES[dtype], ctypes.c_bool(slot_dtype == torch.int64), ptr(key), ptr(value),
                                       ptr(key_cache), ptr(value_cache), ptr(slot_mapping), ctypes.c_int64(6), 8, 2, 64,
                                       strides)
        assert rc == 0
        assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


# ----------------------------------------------------------------------------- the Python wrapper, end to end

class EmulatedExtensions:
    """Stands in for the built torch extensions (kernels_cuda/*_binding.cpp) on the CPU:
    enforces what the bindings TORCH_CHECK about layouts, then runs the real device code in
    the emulator through raw pointers — exactly how the GPU would read the tensors. So
    `cuda_ops` (the wrapper) is tested as it runs on a GPU, minus the stream."""

    def __init__(self, emu):
        self.emu = emu

    @staticmethod
    def _binding_checks(out, query, key_cache, value_cache, block_tables, seq_lens):
        assert out.is_contiguous() and out.shape == query.shape, "binding: out must be contiguous, shaped like query"
        assert query.stride(2) == 1, "binding: query's head_size dim must be contiguous"
        assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, "binding: block_tables int32 rows"
        assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), "binding: seq_lens contiguous int32"
        assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1, "binding: cache rows contiguous"

    def paged_attention_v1(self, out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, stream):
        self._binding_checks(out, query, key_cache, value_cache, block_tables, seq_lens)
        out.copy_(emulate_decode(self.emu, "v1", query, key_cache, value_cache, block_tables, seq_lens, scale,
                                 max_seq_len))

    def paged_attention_v2(self, out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables,
                           seq_lens, scale, max_seq_len, stream):
        self._binding_checks(out, query, key_cache, value_cache, block_tables, seq_lens)
        out.copy_(emulate_decode(self.emu, "v2", query, key_cache, value_cache, block_tables, seq_lens, scale,
                                 max_seq_len))

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping, stream):
        assert slot_mapping.is_contiguous(), "binding: slot_mapping must be contiguous"
        assert all(t.stride(-1) == 1 for t in (key, value, key_cache, value_cache)), "binding: head_size contiguous"
        strides = (ctypes.c_int64 * 10)(key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                        *key_cache.stride()[:3], *value_cache.stride()[:3])
        rc = self.emu.emu_reshape_and_cache(CODES[key.dtype], ctypes.c_bool(slot_mapping.dtype == torch.int64),
                                            ptr(key), ptr(value), ptr(key_cache), ptr(value_cache), ptr(slot_mapping),
                                            ctypes.c_int64(key.shape[0]), key_cache.shape[1], key_cache.shape[2],
                                            key_cache.shape[3], strides)
        assert rc == 0


@pytest.fixture
def emulated_cuda_ops(emu, monkeypatch):
    ext = EmulatedExtensions(emu)
    monkeypatch.setattr(cuda_ops, "_load", lambda name: ext)
    monkeypatch.setattr(cuda_ops, "_stream", lambda: 0)
    return cuda_ops


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_wrapper_accepts_any_view_of_the_index_tensors(emulated_cuda_ops, version):
    """The wrapper makes every index tensor readable by pointer (contiguous seq_lens, rows of
    block_tables with stride 1) BEFORE it checks values: same output for every view; the
    junk the views hide in their storage (huge seq_lens / block ids) is never read."""
    kv = make_paged_kv([37, 0, 600], 2, 64, 16, torch.float16, pad_id=-5, extra_table_width=1)
    q = random_query(3, 4, 64, torch.float16)
    want = ref.dense_decode_attention(q, kv.keys, kv.values, 0.125)
    run = lambda bt, sl, query=q: emulated_cuda_ops.paged_decode_attention(   # noqa: E731
        query, kv.key_cache, kv.value_cache, bt, sl, 0.125, version=version)
    base = run(kv.block_tables, kv.seq_lens)
    assert_close(base, want, torch.float16)
    for name, sl in index_views(kv.seq_lens, junk=10**6).items():
        assert torch.equal(run(kv.block_tables, sl), base), f"seq_lens {name}"
    for name, bt in index_views(kv.block_tables, junk=10**6).items():
        assert torch.equal(run(bt, kv.seq_lens), base), f"block_tables {name}"
    strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)                   # head_dim not contiguous
    assert torch.equal(run(kv.block_tables, kv.seq_lens, strided_q), base)


def test_wrapper_cache_write_accepts_any_view_of_slot_mapping(emulated_cuda_ops):
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(5, 2, 64, generator=g).half(), torch.randn(5, 2, 64, generator=g).half()
    slots = torch.tensor([9, 31, -1, 0, 14])
    want_k, want_v = torch.zeros(4, 8, 2, 64, dtype=torch.half), torch.zeros(4, 8, 2, 64, dtype=torch.half)
    ref.reshape_and_cache(key, value, want_k, want_v, slots)
    for slot_dtype in (torch.int64, torch.int32):
        for name, view in index_views(slots.to(slot_dtype), junk=4 * 8 + 50).items():
            kc, vc = torch.zeros_like(want_k), torch.zeros_like(want_v)
            emulated_cuda_ops.reshape_and_cache(key, value, kc, vc, view)
            assert torch.equal(kc, want_k) and torch.equal(vc, want_v), name
    kc, vc = torch.zeros_like(want_k), torch.zeros_like(want_v)
    strided = key.transpose(1, 2).contiguous().transpose(1, 2)
    emulated_cuda_ops.reshape_and_cache(strided, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(IndexError, match=r"slots in \[-1, 32\]"):       # the view is what is checked
        emulated_cuda_ops.reshape_and_cache(key, value, kc, vc, torch.tensor([[1, 0], [32, 0], [2, 0], [3, 0], [-1, 0]])[:, 0])
