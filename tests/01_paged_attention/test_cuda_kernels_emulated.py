"""The CUDA kernels == the reference, run on the CPU by the emulator (kernels_cuda/emulator):
the REAL kernels_cuda/paged_attention.cu and cache_kernels.cu — device code and launchers
(dispatch over dtype / head size / block size, grids, the v2 partition count, the shared-memory
opt-in, error codes) — compiled with g++ and run with one host thread per CUDA thread.

This is how a GPU-less CI checks what the kernels COMPUTE and how they are LAUNCHED (nvcc only
proves they compile). The same cases run on the real GPU in
tests/kernels_cuda/test_paged_attention_cuda.py.
"""
import ctypes

import pytest
import torch

from kernels_cuda import emulator
from paged_attention import cuda_ops, ops as pa, reference as ref
from paged_attention.kv_quant import KVQuant, quantize_rows
from paged_attention.synthetic import index_views, make_paged_kv, random_query
from tolerances import assert_close, assert_equal

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPES = list(CODES)
K_UNSUPPORTED_CONFIG, K_SHARED_MEMORY_TOO_LARGE = -1, -2      # paged_attention.cu's own error codes


def load_or_skip(name):
    try:
        return emulator.load(name)
    except emulator.EmulatorUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def emu():
    """paged_attention.cu, emulated (built once per source version, cached under ~/.cache)."""
    return load_or_skip("paged_attention")


@pytest.fixture(scope="module")
def cache_emu():
    """cache_kernels.cu, emulated."""
    return load_or_skip("cache_kernels")


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def launch_decode(emu, version, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                  dtype_code=None, head_size=None, kv_args=(0, False, 1.0, 1.0)):
    """What paged_attention_binding.cpp does for cuda_ops.paged_decode_attention: the launcher
    (vfs_paged_attention_v1 / _v2 / _v3) on raw pointers. Returns (launcher's return code, out).
    "v3-split" is v3 with the partition scratch (split-KV + v2's reduce), "v3" without it.
    kv_args: (kind, per_row, k_scale, v_scale) of an 8-bit cache (cuda_ops._kv_args); a float cache's by default."""
    num_seqs, num_heads, head_dim = query.shape
    strides = (ctypes.c_int64 * 9)(block_tables.stride(0), query.stride(0), query.stride(1),
                                   *key_cache.stride()[:3], *value_cache.stride()[:3])
    out = torch.empty_like(query)
    args = [CODES[query.dtype] if dtype_code is None else dtype_code, head_size or head_dim, key_cache.shape[1],
            ptr(out)]
    if version in ("v2", "v3-split"):
        parts = -(-max_seq_len // emu.vfs_paged_attention_partition_size())
        scratch = [torch.full((num_seqs, num_heads, parts), float("nan")) for _ in range(2)]
        scratch.append(torch.full((num_seqs, num_heads, parts, head_dim), float("nan")))
        args += [ptr(t) for t in scratch]
    elif version == "v3":
        args += [None, None, None]
    args += [ptr(query), ptr(key_cache), ptr(value_cache), ptr(block_tables), ptr(seq_lens), num_seqs, num_heads,
             key_cache.shape[2], block_tables.shape[1], max_seq_len, scale, *kv_args, strides, 0]
    rc = getattr(emu, f"vfs_paged_attention_{version.removesuffix('-split')}")(*args)
    return rc, out


def emulate_decode(emu, version, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                   kv_args=(0, False, 1.0, 1.0)):
    rc, out = launch_decode(emu, version, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                            kv_args=kv_args)
    assert rc == 0, f"launcher returned {rc}: {emu.vfs_paged_attention_error_string(rc).decode()}"
    return out


def reshape_and_cache_rc(cache_emu, key, value, key_cache, value_cache, slot_mapping) -> int:
    """What cache_kernels_binding.cpp does: the launcher vfs_reshape_and_cache on raw pointers."""
    strides = (ctypes.c_int64 * 10)(key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                    *key_cache.stride()[:3], *value_cache.stride()[:3])
    return cache_emu.vfs_reshape_and_cache(CODES[key.dtype], slot_mapping.dtype == torch.int64, ptr(key), ptr(value),
                                           ptr(key_cache), ptr(value_cache), ptr(slot_mapping), key.shape[0],
                                           key_cache.shape[1], key_cache.shape[2], key_cache.shape[3], strides, 0)


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


# v3 (kernels_cuda/paged_attention_v3.cuh) has its own tests, so that the course task of each
# kernel is graded by its own tests (course/tasks.toml: cuda_task2 = v1/v2, cuda_task5 = v3).
# Every (dtype, block size) template instance runs; v3 and v3-split share it (split is a runtime
# argument), so each case runs one of the two paths, in a checkerboard: each dtype and each block
# size meets both paths. 530 tokens: 2 partitions of 512 (the second 18 tokens), a partial last
# block at every block size.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", cuda_ops.SUPPORTED_BLOCK_SIZES)
def test_v3(emu, dtype, block_size):
    version = ("v3", "v3-split")[(DTYPES.index(dtype) + cuda_ops.SUPPORTED_BLOCK_SIZES.index(block_size)) % 2]
    check(emu, version, dtype, [37, 0, 530], 4, 2, 64, block_size)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_head_sizes(emu, head_dim):
    check(emu, "v1", torch.float16, [70, 3], 2, 1, head_dim, 16)
    check(emu, "v2", torch.bfloat16, [600], 2, 2, head_dim, 32)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_v3_head_sizes(emu, head_dim):
    check(emu, "v3", torch.float16, [70, 3], 8, 2, head_dim, 16)
    check(emu, "v3-split", torch.bfloat16, [530], 2, 2, head_dim, 32)
    check(emu, "v3-split", torch.float32, [530, 16], 4, 1, head_dim, 8)


# v3 serves a GQA group of up to V3_GROUP_MAX (4) query heads per thread block, MHA with its own
# instance, bigger groups in equal chunks: MHA, 3, 4, 5 (chunks 3 + 2) and 8 (4 + 4) heads per KV head.
# v3 runs every group; v3-split (the same kernel, writing per-head partials) runs the MHA instance
# and the uneven chunks (3 + 2: a masked head slot in the second chunk).
V3_GROUPS = [(2, 2), (6, 2), (8, 2), (5, 1), (8, 1)]


@pytest.mark.parametrize("version,num_heads,num_kv_heads",
                         [("v3", *g) for g in V3_GROUPS] + [("v3-split", *g) for g in [(2, 2), (5, 1)]])
def test_v3_gqa_groups_and_block_boundaries(emu, version, num_heads, num_kv_heads):
    # seq_len 0, 1, a block boundary +- 1, and 1100 tokens: 3 partitions of 512, each spread over
    # the 4 warps with several blocks per warp; shuffled blocks, NaN in every unused slot.
    seq_lens = [0, 1, 15, 16, 17, 1100]
    dtype = torch.bfloat16 if num_kv_heads == 2 else torch.float32
    check(emu, version, dtype, seq_lens, num_heads, num_kv_heads, 64, 16, seed=num_heads)


def test_v3_one_long_row_fp16(emu):
    """One sequence over 2 partitions with a partial last block, group 4, head 128, block 8."""
    check(emu, "v3", torch.float16, [530], 4, 1, 128, 8, seed=5)        # 512 + 18 tokens, 66 blocks + 2
    check(emu, "v3-split", torch.float16, [530], 4, 1, 128, 8, seed=5)

def test_values_all_ones_give_exactly_ones(emu, versions=("v1", "v2")):
    kv = make_paged_kv([5, 1030], 1, 64, 16, torch.bfloat16)
    kv.value_cache[~torch.isnan(kv.value_cache)] = 1.0
    q = random_query(2, 4, 64, torch.bfloat16) * 4
    for version in versions:
        out = emulate_decode(emu, version, q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 1.0, 1030)
        assert_equal(out, torch.ones_like(out), f"{version} output")


def test_rows_the_kernel_cannot_serve_come_out_nan(emu, versions=("v1", "v2")):
    """seq_len beyond its block table (v1, v2, v3), or beyond the max_seq_len the launch was
    sized for (v1's logits buffer, v2's and split v3's partition grid): NaN, never a silently
    wrong row. v3 without split has no buffer sized by max_seq_len: the row is simply right."""
    kv = make_paged_kv([8, 530], 1, 64, 8, pad_id=-1)
    q = random_query(2, 2, 64)
    table_width = kv.block_tables.shape[1]
    for version in versions:
        seq_lens = torch.tensor([table_width * 8 + 1, 530], dtype=torch.int32)   # row 0 overruns its table
        out = emulate_decode(emu, version, q, kv.key_cache, kv.value_cache, kv.block_tables, seq_lens, 0.1, 1000)
        assert torch.isnan(out[0]).all()
        assert_close(out[1], ref.dense_attention(q[1:2], kv.keys[1], kv.values[1], 0.1, causal=False)[0])
        out = emulate_decode(emu, version, q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1,
                             max_seq_len=500)    # stale hint: 530 > 500
        if version == "v3":
            assert_close(out[1], ref.dense_attention(q[1:2], kv.keys[1], kv.values[1], 0.1, causal=False)[0])
        else:
            assert torch.isnan(out[1]).all()
        assert not torch.isnan(out[0]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(cache_emu, dtype):
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
        rc = reshape_and_cache_rc(cache_emu, key, value, key_cache, value_cache, torch.tensor(slots, dtype=slot_dtype))
        assert rc == 0, cache_emu.vfs_cache_kernels_error_string(rc).decode()
        assert_equal(key_cache, expected_k, "key_cache")
        assert_equal(value_cache, expected_v, "value_cache")


# ----------------------------------------------------------------------------- what only the launchers do

def test_launcher_refuses_what_it_did_not_compile(emu, versions=("v1", "v2")):
    """The launcher's dispatch: a head size, block size or dtype without a template instance
    is its kUnsupportedConfig, for v1 and v2, with its message — nothing is launched."""
    kv = make_paged_kv([20], 1, 64, 16)
    q = random_query(1, 1, 64)
    for version in versions:
        args = (version, q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1, 20)
        assert launch_decode(emu, *args)[0] == 0
        assert launch_decode(emu, *args, head_size=96)[0] == K_UNSUPPORTED_CONFIG
        assert launch_decode(emu, *args, dtype_code=3)[0] == K_UNSUPPORTED_CONFIG
    kv12 = make_paged_kv([20], 1, 64, 12)
    rc, _ = launch_decode(emu, "v1", q, kv12.key_cache, kv12.value_cache, kv12.block_tables, kv12.seq_lens, 0.1, 20)
    assert rc == K_UNSUPPORTED_CONFIG
    assert "not compiled" in emu.vfs_paged_attention_error_string(rc).decode()


def test_v1_opts_in_to_more_than_48_kb_of_shared_memory(emu):
    """v1 keeps every logit in dynamic shared memory: 13000 tokens need 52 KB, more than a
    kernel gets without cudaFuncSetAttribute (the emulator refuses such a launch with
    cudaErrorInvalidValue, as the driver does). The launcher opts in, so v1 serves it and
    agrees with v2 (26 partitions) and the reference; past the device's 227 KB it returns
    its own kSharedMemoryTooLarge instead of launching."""
    seq_len = 13000
    kv = make_paged_kv([seq_len], 1, 64, 32, seed=3)
    q = random_query(1, 2, 64, seed=4)
    want = ref.dense_decode_attention(q, kv.keys, kv.values, 0.125)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125, seq_len)
    v1 = emulate_decode(emu, "v1", *args)
    assert_close(v1, want)
    assert_close(emulate_decode(emu, "v2", *args), want)
    rc, _ = launch_decode(emu, "v1", *args[:-1], 60000)        # 240 KB of logits
    assert rc == K_SHARED_MEMORY_TOO_LARGE
    assert "use v2" in emu.vfs_paged_attention_error_string(rc).decode()


# ----------------------------------------------------------------------------- the Python wrapper, end to end

class EmulatedExtensions:
    """Stands in for the built torch extensions (kernels_cuda/*_binding.cpp) on the CPU:
    enforces what the bindings TORCH_CHECK about layouts, then calls the real launchers in the
    emulator through raw pointers — exactly how the GPU would read the tensors. So `cuda_ops`
    (the wrapper) is tested as it runs on a GPU, minus the stream."""

    def __init__(self, emu, cache_emu):
        self.emu, self.cache_emu = emu, cache_emu
        self.calls = []

    @staticmethod
    def _binding_checks(out, query, key_cache, value_cache, block_tables, seq_lens):
        assert out.is_contiguous() and out.shape == query.shape, "binding: out must be contiguous, shaped like query"
        assert query.stride(2) == 1, "binding: query's head_size dim must be contiguous"
        assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, "binding: block_tables int32 rows"
        assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), "binding: seq_lens contiguous int32"
        assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1, "binding: cache rows contiguous"

    def paged_attention_v1(self, out, query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                           *kv_and_stream):
        self._binding_checks(out, query, key_cache, value_cache, block_tables, seq_lens)
        self.calls.append("v1")
        out.copy_(emulate_decode(self.emu, "v1", query, key_cache, value_cache, block_tables, seq_lens, scale,
                                 max_seq_len, kv_and_stream[:4]))

    def paged_attention_v2(self, out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables,
                           seq_lens, scale, max_seq_len, *kv_and_stream):
        self._binding_checks(out, query, key_cache, value_cache, block_tables, seq_lens)
        self.calls.append("v2")
        out.copy_(emulate_decode(self.emu, "v2", query, key_cache, value_cache, block_tables, seq_lens, scale,
                                 max_seq_len, kv_and_stream[:4]))

    def paged_attention_v3(self, out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, block_tables,
                           seq_lens, scale, max_seq_len, *kv_and_stream):
        self._binding_checks(out, query, key_cache, value_cache, block_tables, seq_lens)
        assert (exp_sums is None) == (max_logits is None) == (tmp_out is None), "binding: all scratch or none"
        version = "v3" if tmp_out is None else "v3-split"
        self.calls.append(version)
        out.copy_(emulate_decode(self.emu, version, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                 max_seq_len, kv_and_stream[:4]))

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping, stream):
        assert slot_mapping.is_contiguous(), "binding: slot_mapping must be contiguous"
        assert all(t.stride(-1) == 1 for t in (key, value, key_cache, value_cache)), "binding: head_size contiguous"
        rc = reshape_and_cache_rc(self.cache_emu, key, value, key_cache, value_cache, slot_mapping)
        assert rc == 0, self.cache_emu.vfs_cache_kernels_error_string(rc).decode()


@pytest.fixture
def emulated_cuda_ops(emu, cache_emu, monkeypatch):
    ext = EmulatedExtensions(emu, cache_emu)
    monkeypatch.setattr(cuda_ops, "_load", lambda name: ext)
    monkeypatch.setattr(cuda_ops, "_stream", lambda: 0)
    return cuda_ops


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_wrapper_accepts_any_view_of_the_index_tensors(emulated_cuda_ops, version):
    """The wrapper makes every index tensor readable by pointer (contiguous seq_lens, rows of
    block_tables with stride 1) BEFORE it checks values: same output for every view; the
    junk the views hide in their storage (huge seq_lens / block ids) is never read."""
    # 530 tokens: 2 partitions of 512 for v2 and split v3, a partial last block; GQA 2/1: the
    # views are of the index tensors (the kernels' head strides are tested above), and each
    # query head is one more thread block for v1, v2 and the split reduce.
    kv = make_paged_kv([37, 0, 530], 1, 64, 16, torch.float16, pad_id=-5, extra_table_width=1)
    q = random_query(3, 2, 64, torch.float16)
    want = ref.dense_decode_attention(q, kv.keys, kv.values, 0.125)
    run = lambda bt, sl, query=q: emulated_cuda_ops.paged_decode_attention(   # noqa: E731
        query, kv.key_cache, kv.value_cache, bt, sl, 0.125, version=version)
    base = run(kv.block_tables, kv.seq_lens)
    assert_close(base, want, torch.float16)
    # Each block_tables view with the same kind of seq_lens view where there is one (strided,
    # offset; 1-D has no transposed / row_slice): either one read by its storage changes the output.
    sl_views = index_views(kv.seq_lens, junk=10**6)
    for name, bt in index_views(kv.block_tables, junk=10**6).items():
        sl = sl_views.pop(name, kv.seq_lens)
        assert_equal(run(bt, sl), base, f"block_tables {name}, seq_lens {name if sl is not kv.seq_lens else 'as is'}")
    assert not sl_views                                                          # every seq_lens view ran
    strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)                   # head_dim not contiguous
    assert_equal(run(kv.block_tables, kv.seq_lens, strided_q), base, "strided query")


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
            assert_equal(kc, want_k, f"key_cache, slots {name}")
            assert_equal(vc, want_v, f"value_cache, slots {name}")
    kc, vc = torch.zeros_like(want_k), torch.zeros_like(want_v)
    strided = key.transpose(1, 2).contiguous().transpose(1, 2)
    emulated_cuda_ops.reshape_and_cache(strided, value, kc, vc, slots)
    assert_equal(kc, want_k, "key_cache, strided key")
    assert_equal(vc, want_v, "value_cache, strided key")
    with pytest.raises(IndexError, match=r"slots in \[-1, 32\]"):       # the view is what is checked
        emulated_cuda_ops.reshape_and_cache(key, value, kc, vc, torch.tensor([[1, 0], [32, 0], [2, 0], [3, 0], [-1, 0]])[:, 0])


# ----------------------------------------------------------------------------- v3 through the same checks

def test_v3_values_all_ones_give_exactly_ones(emu):
    test_values_all_ones_give_exactly_ones(emu, versions=("v3", "v3-split"))


def test_v3_rows_the_kernel_cannot_serve_come_out_nan(emu):
    test_rows_the_kernel_cannot_serve_come_out_nan(emu, versions=("v3", "v3-split"))


def test_v3_launcher_refuses_what_it_did_not_compile(emu):
    test_launcher_refuses_what_it_did_not_compile(emu, versions=("v3", "v3-split"))


@pytest.mark.parametrize("split", [False, True])
def test_v3_wrapper_accepts_any_view_of_the_index_tensors(emulated_cuda_ops, split, monkeypatch):
    """cuda_ops.paged_decode_attention(version="v3") with both paths of `use_v3_split` forced."""
    monkeypatch.setattr(emulated_cuda_ops, "use_v3_split", lambda *args: split)
    test_wrapper_accepts_any_view_of_the_index_tensors(emulated_cuda_ops, "v3")
    assert emulated_cuda_ops._load("paged_attention").calls[-1] == ("v3-split" if split else "v3")


def test_use_v3_split_splits_only_long_contexts_on_an_unfilled_gpu():
    split = cuda_ops.use_v3_split
    assert split(32768, 1, 32, 8)                  # 8 thread blocks for 132 SMs: split
    assert not split(512, 1, 32, 8)                # one partition: nothing to split
    assert not split(2048, 128, 32, 8)             # 1024 thread blocks fill the GPU already
    assert split(8192, 16, 32, 8)                  # 128 thread blocks: split
    assert cuda_ops.v3_thread_blocks_per_seq(64, 8) == 16     # group 8 = 2 chunks of 4


# ----------------------------------------------------------------------------- an 8-bit cache (kv_quant.py)

KV_MODES = {"int8_per_token_head": KVQuant("int8_per_token_head"),
            "fp8_per_token_head": KVQuant("fp8_per_token_head"),
            "fp8": KVQuant("fp8", k_scale=0.02, v_scale=0.01)}


def quantized_cache(kq: KVQuant, float_cache: torch.Tensor, which: str) -> torch.Tensor:
    """make_paged_kv's cache in 8 bits (kv_quant.py's rows); every slot no request owns holds 0x7F
    bytes: int8 127, an fp8 NaN, a scale of 3.4e38 — what a kernel that reads one would show."""
    unused = float_cache.isnan().any(-1)                                   # [num_blocks, block_size, kv_heads]
    rows = quantize_rows(float_cache.nan_to_num(0.0), kq, which)
    rows.view(torch.uint8)[unused] = 0x7F
    return rows


@pytest.mark.parametrize("mode", KV_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_version_reads_an_8bit_cache(emu, mode, dtype):
    """v1, v2, v3 and split v3 on an int8 / fp8 cache (per-row scales inline, or the layer's):
    equal to the torch backend's read of the same bytes. GQA 4/2, a padding row, partial last
    blocks, 530 tokens = 2 partitions; the block size changes with the case, so every lane width
    of the 8-bit loads (1, 2, 4 and 8 bytes a lane) is met."""
    kq = KV_MODES[mode]
    block_size = cuda_ops.SUPPORTED_BLOCK_SIZES[(list(KV_MODES).index(mode) + DTYPES.index(dtype)) % 3]
    seq_lens = [37, 0, 530]
    kv = make_paged_kv(seq_lens, 2, 64, block_size, seed=11, extra_table_width=1)
    kc, vc = quantized_cache(kq, kv.key_cache, "k"), quantized_cache(kq, kv.value_cache, "v")
    q = random_query(len(seq_lens), 4, 64, dtype, seed=12)
    want = pa.paged_decode_attention(q, kc, vc, kv.block_tables, kv.seq_lens, 0.125, backend="torch", kv_quant=kq)
    for version in ("v1", "v2", "v3", "v3-split"):
        out = emulate_decode(emu, version, q, kc, vc, kv.block_tables, kv.seq_lens, 0.125, max(seq_lens),
                             cuda_ops._kv_args(kq))
        assert_close(out, want, dtype)


@pytest.mark.parametrize("mode", KV_MODES)
def test_wrapper_reads_an_8bit_cache(emulated_cuda_ops, mode):
    """cuda_ops.paged_decode_attention(kv_quant=...) end to end (its checks, vLLM's v1/v2 rule, the
    launch arguments), and bad 8-bit launches are refused by the launcher."""
    kq = KV_MODES[mode]
    kv = make_paged_kv([45, 600], 1, 128, 16, seed=13)
    kc, vc = quantized_cache(kq, kv.key_cache, "k"), quantized_cache(kq, kv.value_cache, "v")
    q = random_query(2, 3, 128, torch.bfloat16, seed=14)
    want = pa.paged_decode_attention(q, kc, vc, kv.block_tables, kv.seq_lens, 0.1, backend="torch", kv_quant=kq)
    for version in (None, "v3"):
        out = emulated_cuda_ops.paged_decode_attention(q, kc, vc, kv.block_tables, kv.seq_lens, 0.1, version=version,
                                                       kv_quant=kq)
        assert_close(out, want, torch.bfloat16)
    assert emulated_cuda_ops._load("paged_attention").calls[-2:] == ["v2", "v3-split"]   # 600 tokens: 2 partitions


def test_launcher_refuses_a_cache_kind_it_does_not_know(emu):
    kv = make_paged_kv([20], 1, 64, 16, seed=15)
    q = random_query(1, 1, 64, seed=16)
    for kv_args in [(3, False, 1.0, 1.0), (0, True, 1.0, 1.0)]:       # no kind 3; a float cache has no row scales
        for version in ("v1", "v2", "v3"):
            rc, _ = launch_decode(emu, version, q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125,
                                  20, kv_args=kv_args)
            assert rc == K_UNSUPPORTED_CONFIG
    assert "KV cache kind" in emu.vfs_paged_attention_error_string(K_UNSUPPORTED_CONFIG).decode()
