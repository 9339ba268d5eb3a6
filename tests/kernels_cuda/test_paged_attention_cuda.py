"""The CUDA paged-attention and cache kernels (kernels_cuda/paged_attention.cu, cache_kernels.cu)
== the PyTorch reference, on a GPU. Same adversarial layouts as the CPU tests: shuffled
physical blocks, NaN in every slot no request owns, junk block-table padding, partial last
blocks, GQA/MQA, a seq_len-0 padding row. Run with `make test-gpu`.
(On CPU, tests/01_paged_attention/test_cuda_kernels_emulated.py runs the same .cu files,
launchers included, in the emulator, kernels_cuda/emulator.)"""
import pytest
import torch

from paged_attention import ops, reference as ref
from paged_attention.cuda_ops import PARTITION_SIZE, SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES
from paged_attention.synthetic import make_paged_kv, random_query
from tolerances import assert_close

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check(dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size, versions=("v1", "v2", "v3", None), seed=0):
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=seed,
                       pad_id=-5, extra_table_width=2)
    q = random_query(len(seq_lens), num_heads, head_dim, dtype, "cuda", seed=seed + 1)
    scale = head_dim ** -0.5
    want = ref.dense_decode_attention(q, kv.keys, kv.values, scale)
    for version in versions:
        got = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale,
                                         backend="cuda", version=version)
        assert_close(got, want, dtype, msg=f"version={version}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_SIZES)
@pytest.mark.parametrize("block_size", SUPPORTED_BLOCK_SIZES)
def test_decode_every_compiled_config(dtype, head_dim, block_size):
    # 1 token, a padding row, partial blocks, exactly one partition, just over, several partitions
    seq_lens = [1, 0, 37, PARTITION_SIZE, PARTITION_SIZE + 1, 3000]
    for num_heads, num_kv_heads in [(8, 8), (32, 8), (9, 3), (16, 1), (10, 2)]:
        check(dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_long_contexts(dtype):
    # v1 with > 48 KB of logits in shared memory (opt-in), and v2 with 64 partitions
    check(dtype, [20000, 32768, 7], 8, 2, 128, 16)


@pytest.mark.parametrize("split", [False, True])
def test_v3_split_and_unsplit_agree_with_the_reference(split, monkeypatch):
    """v3 on Llama-3-8B decode shapes, both paths forced: batch 1 x 32k (the split case) and
    batch 128 x 2k (the unsplit case), bf16, against the reference and SDPA on contiguous K/V."""
    from paged_attention import cuda_ops
    monkeypatch.setattr(cuda_ops, "use_v3_split", lambda *args: split)
    for seq_lens in ([32768], [2048] * 128):
        kv = make_paged_kv(seq_lens, 8, 128, 16, torch.bfloat16, "cuda", pad_id=-5, extra_table_width=1)
        q = random_query(len(seq_lens), 32, 128, torch.bfloat16, "cuda", seed=1)
        want = ref.dense_decode_attention(q, kv.keys, kv.values, 128 ** -0.5)
        got = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 128 ** -0.5,
                                         backend="cuda", version="v3")
        assert_close(got, want, torch.bfloat16)
        n = len(seq_lens)
        k = torch.stack(kv.keys).repeat_interleave(4, dim=2).transpose(1, 2)      # [n, 32, len, 128]
        v = torch.stack(kv.values).repeat_interleave(4, dim=2).transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q.view(n, 32, 1, 128), k, v, scale=128 ** -0.5)
        assert_close(got, sdpa.view(n, 32, 128), torch.bfloat16)


def test_decode_big_batch():
    check(torch.float16, [int(x) for x in torch.randint(1, 4096, (256,), generator=torch.Generator().manual_seed(0))],
          32, 8, 128, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_all_ones_give_exactly_ones(dtype):
    kv = make_paged_kv([1, 700, 33], 2, 128, 16, dtype, "cuda")
    kv.value_cache[~torch.isnan(kv.value_cache)] = 1.0
    q = random_query(3, 8, 128, dtype, "cuda") * 4
    for version in ("v1", "v2", "v3"):
        out = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 1.0,
                                         backend="cuda", version=version)
        if dtype == torch.float32:
            assert (out - 1).abs().max() <= 4 * torch.finfo(torch.float32).eps
        else:
            assert torch.equal(out, torch.ones_like(out))


def test_strided_query_and_shared_kv_tensor():
    """q as a view of a fused qkv output; K and V caches as the two halves of one
    [num_blocks, 2, block_size, kvh, d] tensor (non-contiguous block stride)."""
    kv = make_paged_kv([50, 130], 2, 64, 16, torch.float16, "cuda")
    both = torch.stack([kv.key_cache, kv.value_cache], dim=1)          # [nb, 2, bs, kvh, d]
    qkv = random_query(2, 8 + 4, 64, torch.float16, "cuda")
    q = qkv[:, :8]
    assert not q.is_contiguous()
    want = ref.dense_decode_attention(q, kv.keys, kv.values, 0.125)
    for version in ("v1", "v2", "v3"):
        got = ops.paged_decode_attention(q, both[:, 0], both[:, 1], kv.block_tables, kv.seq_lens, 0.125,
                                         backend="cuda", version=version)
        assert_close(got, want, torch.float16)


def test_unsupported_config_and_misaligned_cache_raise():
    kv = make_paged_kv([5], 1, 80, 16, torch.float16, "cuda")
    q = random_query(1, 1, 80, torch.float16, "cuda")
    with pytest.raises(ValueError, match="head sizes"):
        ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1, backend="cuda")
    kv = make_paged_kv([5], 1, 64, 16, torch.float16, "cuda")
    flat = torch.zeros(kv.key_cache.numel() + 1, dtype=torch.float16, device="cuda")
    shifted = flat[1:].view_as(kv.key_cache)                            # 2-byte offset: not 16-byte aligned
    shifted.copy_(kv.key_cache)
    q = random_query(1, 1, 64, torch.float16, "cuda")
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ops.paged_decode_attention(q, shifted, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1, backend="cuda")


def test_stale_max_seq_len_is_caught():
    kv = make_paged_kv([600], 1, 64, 16, torch.float16, "cuda")
    q = random_query(1, 1, 64, torch.float16, "cuda")
    with pytest.raises(ValueError, match="max_seq_len=500 is smaller"):
        ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1,
                                   backend="cuda", max_seq_len=500)
    for version in ("v1", "v2"):   # unchecked hot path: the row comes out NaN, not wrong
        out = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1,
                                         backend="cuda", max_seq_len=500, check_values=False, version=version)
        assert torch.isnan(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_then_decode_on_the_cuda_backend(dtype):
    """Prefill (CUDA cache write + Triton attention) then decode (CUDA kernel) == the torch backend."""
    from paged_attention import build_attention_metadata
    g = torch.Generator().manual_seed(0)
    lens, h, kvh, d, bs = [7, 300, 1], 8, 2, 128, 16
    nb = [-(-(n + 1) // bs) for n in lens]
    ids = torch.randperm(sum(nb) + 3, generator=g).tolist()
    block_ids = [ids[sum(nb[:i]):sum(nb[:i + 1])] for i in range(3)]
    md = build_attention_metadata(block_ids, [0] * 3, lens, bs, device="cuda")
    q, k, v = (torch.randn(sum(lens), n, d, generator=g).to(dtype).cuda() for n in (h, kvh, kvh))
    q2, k2, v2 = (torch.randn(3, n, d, generator=g).to(dtype).cuda() for n in (h, kvh, kvh))   # one decode step
    md2 = build_attention_metadata(block_ids, lens, [1] * 3, bs, device="cuda")
    results = {}
    for backend in ("torch", "cuda"):
        kc = torch.full((len(ids), bs, kvh, d), float("nan"), dtype=dtype, device="cuda")
        vc = kc.clone()
        pre = ops.paged_prefill_attention(q, k, v, kc, vc, md.slot_mapping, md.query_start_loc, d ** -0.5,
                                          backend=backend)
        ops.reshape_and_cache(k2, v2, kc, vc, md2.slot_mapping, backend=backend)
        dec = ops.paged_decode_attention(q2, kc, vc, md2.block_tables, md2.seq_lens, d ** -0.5, backend=backend)
        results[backend] = (pre, dec, kc)
    assert_close(results["cuda"][0], results["torch"][0], dtype)
    assert_close(results["cuda"][1], results["torch"][1], dtype)
    assert torch.equal(results["cuda"][2].nan_to_num(7.0), results["torch"][2].nan_to_num(7.0))


def test_any_view_of_the_index_tensors():
    """Strided / offset / transposed seq_lens, block_tables and slot_mapping (junk in the
    storage they skip): the wrapper hands the kernels what they can read by pointer, so the
    output and the cache writes equal the contiguous ones (CPU twin: the emulated-wrapper
    tests in tests/01_paged_attention/test_cuda_kernels_emulated.py)."""
    from paged_attention.synthetic import index_views
    kv = make_paged_kv([37, 0, 600], 2, 64, 16, torch.float16, "cuda", pad_id=-5, extra_table_width=1)
    q = random_query(3, 4, 64, torch.float16, "cuda")
    for version in ("v1", "v2", "v3"):
        run = lambda bt, sl: ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, bt, sl, 0.125,  # noqa: E731
                                                        backend="cuda", version=version)
        base = run(kv.block_tables, kv.seq_lens)
        for name, sl in index_views(kv.seq_lens, junk=10**6).items():
            assert torch.equal(run(kv.block_tables, sl), base), f"seq_lens {name}"
        for name, bt in index_views(kv.block_tables, junk=10**6).items():
            assert torch.equal(run(bt, kv.seq_lens), base), f"block_tables {name}"
    key = random_query(4, 2, 64, torch.float16, "cuda")
    slots = torch.tensor([3, -1, 40, 17], device="cuda")
    want = torch.zeros(4, 16, 2, 64, dtype=torch.float16, device="cuda")
    ref.reshape_and_cache(key, key, want, want.clone(), slots)
    for name, view in index_views(slots, junk=10**6).items():
        kc = torch.zeros_like(want)
        ops.reshape_and_cache(key, key, kc, torch.zeros_like(want), view, backend="cuda")
        assert torch.equal(kc, want), name
