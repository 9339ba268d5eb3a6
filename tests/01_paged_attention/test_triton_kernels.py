"""Triton kernels == the reference: under the interpreter on CPU (small shapes), natively on a
GPU (`gpu` mark, bigger shapes). Same helpers, same assertions, only the device differs."""
import itertools

import pytest
import torch

from paged_attention import build_attention_metadata, ops, reference as ref
from paged_attention.synthetic import make_paged_kv, random_query
from tolerances import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# The decode rungs: the default (choose_decode_config, through the ops dispatch) and each
# kernel with explicit launches. v2's tile must be block_size * 2^k (or a power of two dividing
# a bigger block), so its tiles are derived from the block size.
def decode_launches(block_size):
    from paged_attention.triton_ops import v2_tile_for
    v2_tiles = sorted({v2_tile_for(block_size, 16), v2_tile_for(block_size, 64)})
    return ([{}, dict(version="v1", tile=16), dict(version="v1", tile=64, num_warps=8, num_stages=3)]
            + [dict(version="v2", tile=t, num_warps=2, num_stages=1) for t in v2_tiles])


def check_decode(device, dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_kv_splits_list, seed=0,
                 launches=None):
    from paged_attention import triton_ops
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed,
                       pad_id=-7, extra_table_width=1)               # NaN junk, shuffled, junk padding
    q = random_query(len(seq_lens), num_heads, head_dim, dtype, device, seed=seed + 1)
    scale = head_dim ** -0.5
    want = ref.dense_decode_attention(q, kv.keys, kv.values, scale)
    for launch in (decode_launches(block_size) if launches is None else launches):
        for num_kv_splits in num_kv_splits_list:
            args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale)
            if launch:
                got = triton_ops.paged_decode_attention(*args, num_kv_splits=num_kv_splits, **launch)
            else:
                got = ops.paged_decode_attention(*args, backend="triton", num_kv_splits=num_kv_splits)
            assert_close(got, want, dtype, msg=f"{launch or 'default'} num_kv_splits={num_kv_splits}")


def check_prefill(device, dtype, lens, num_heads, num_kv_heads, head_dim, block_size, seed=0,
                  backends=("torch", "triton")):
    """Every backend's prefill == the reference loop (which is dense causal attention per
    prompt, bit for bit): same output to the dtype's tolerance, same cache rows bit for bit."""
    g = torch.Generator().manual_seed(seed)
    nb = [-(-n // block_size) for n in lens]
    ids = torch.randperm(sum(nb) + 2, generator=g).tolist()
    block_ids = [ids[sum(nb[:i]):sum(nb[:i + 1])] for i in range(len(lens))]
    md = build_attention_metadata(block_ids, [0] * len(lens), lens, block_size, device=device)
    q, k, v = (torch.randn(sum(lens), n, head_dim, generator=g).to(dtype).to(device)
               for n in (num_heads, num_kv_heads, num_kv_heads))
    shape = (len(ids), block_size, num_kv_heads, head_dim)
    caches = {}
    for backend in ("reference",) + tuple(backends):
        kc = torch.full(shape, float("nan"), dtype=dtype, device=device)
        vc = kc.clone()
        out = ops.paged_prefill_attention(q, k, v, kc, vc, md.slot_mapping, md.query_start_loc, 0.3, backend=backend)
        caches[backend] = (out, kc, vc)
    out_ref, kc_ref, vc_ref = caches["reference"]
    starts = md.query_start_loc.tolist()
    for s, e in zip(starts, starts[1:]):        # the oracle itself: dense causal attention per prompt
        assert torch.equal(out_ref[s:e], ref.dense_attention(q[s:e], k[s:e], v[s:e], 0.3, causal=True))
    for backend in backends:
        out, kc, vc = caches[backend]
        assert_close(out, out_ref, dtype, msg=backend)
        assert torch.equal(kc.nan_to_num(123.0), kc_ref.nan_to_num(123.0))   # same rows written, bit for bit
        assert torch.equal(vc.nan_to_num(123.0), vc_ref.nan_to_num(123.0))


# ----------------------------------------------------------------------------- CPU (interpreter)

# Every block size once, every dtype at least once, every rung in every case (so each rung meets
# each dtype and each block size): a covering set, not the 15-case product, because the
# interpreter's cost is per program launched. What each block size exercises: 1 one block id per
# row (default v1); 5 blocks padded 5 -> 8 rows (default v1); 12 padded 12 -> 16 rows (fp32's
# default: v2 with 2 blocks a tile); 16 a power of two (16-bit's default: v2 tile 64); 256 tiles
# that slice one block (fp32's default: slices of 32). test_decode_rungs_llama_head_dims... runs
# fp16 and bf16 at blocks 12 and 16.
@pytest.mark.parametrize("dtype,block_size", [(torch.float16, 1), (torch.bfloat16, 5), (torch.float32, 12),
                                              (torch.bfloat16, 16), (torch.float32, 256)],
                         ids=["fp16-1", "bf16-5", "fp32-12", "bf16-16", "fp32-256"])
def test_decode_block_sizes(dtype, block_size):
    # GQA 6/2, ragged lengths, partial last blocks, a seq_len-0 padding row; split-KV and not;
    # every rung (v1 tiles 16/64, v2 tiles of whole blocks or block slices, the default).
    check_decode("cpu", dtype, [37, 1, 0, 70], 6, 2, 32, block_size, [1, 3])


# dtype x head_dim x block_size as a pairwise covering set (every pair of values once, 4 cases
# instead of the 8 of the product): each dtype meets each head dim and each block size.
@pytest.mark.parametrize("dtype,head_dim,block_size", [(torch.float16, 64, 12), (torch.float16, 128, 16),
                                                       (torch.bfloat16, 64, 16), (torch.bfloat16, 128, 12)],
                         ids=["fp16-64-12", "fp16-128-16", "bf16-64-16", "bf16-128-12"])
def test_decode_rungs_llama_head_dims_and_block_boundaries(dtype, head_dim, block_size):
    """Head dims 64/128 (GQA 4), lengths on and around block and tile boundaries (tiles of
    2 and 4 blocks: 32/64 tokens at block 16, 24/48 at block 12), a 0 and a 1."""
    from paged_attention.triton_ops import choose_decode_config
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 4 * block_size, 4 * block_size + 1]
    # The default launch here IS the v2 tile of 4 blocks (the interpreter ignores warps and
    # stages), so that launch covers it; the default's dispatch runs in the tests above and below.
    default = choose_decode_config(len(lens), 2, max(lens), head_dim, dtype, block_size)
    assert (default.version, default.tile) == ("v2", 4 * block_size)
    check_decode("cpu", dtype, lens, 8, 2, head_dim, block_size, [1, 2],
                 launches=[dict(version="v1", tile=32), dict(version="v2", tile=2 * block_size),
                           dict(version="v2", tile=4 * block_size)])


def test_decode_rungs_refuse_tiles_they_cannot_run():
    from paged_attention import triton_ops
    kv = make_paged_kv([20], 1, 16, 16)
    q = random_query(1, 2, 16)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25)
    with pytest.raises(ValueError, match="decode v2 needs tile = block_size"):
        triton_ops.paged_decode_attention(*args, version="v2", tile=40)      # not 16 * 2^k
    with pytest.raises(ValueError, match="decode v2 needs tile = block_size"):
        triton_ops.paged_decode_attention(*args, version="v2", tile=48)
    with pytest.raises(ValueError, match="tile must be a power of two >= 16"):
        triton_ops.paged_decode_attention(*args, version="v1", tile=48)
    with pytest.raises(ValueError, match="version must be one of"):
        triton_ops.paged_decode_attention(*args, version="v3")
    with pytest.raises(ValueError, match="num_warps must be"):
        triton_ops.paged_decode_attention(*args, num_warps=3)
    kv5 = make_paged_kv([20], 1, 16, 5)
    with pytest.raises(ValueError, match=">= 16 rows"):          # 1 block of 5 tokens = 8 rows: too few for tl.dot
        triton_ops.paged_decode_attention(q, kv5.key_cache, kv5.value_cache, kv5.block_tables, kv5.seq_lens, 0.25,
                                          version="v2", tile=5)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_decode_rungs_read_views(version):
    """Both rungs read every input through its strides: index views hiding huge block ids in
    the storage, a strided query (a fused qkv slice), K and V interleaved in one tensor."""
    from paged_attention import triton_ops
    from paged_attention.synthetic import index_views, strided_rows
    kv = make_paged_kv([5, 9, 13, 0], 2, 16, 4, pad_id=0, extra_table_width=1)
    q = random_query(4, 4, 16)
    want = ref.dense_decode_attention(q, kv.keys, kv.values, 0.25)
    launch = dict(version=version, tile=16, num_kv_splits=2)
    both = torch.stack([kv.key_cache, kv.value_cache], dim=1)
    for name, bt in index_views(kv.block_tables, 10**6).items():
        out = triton_ops.paged_decode_attention(strided_rows(q), both[:, 0], both[:, 1], bt, kv.seq_lens, 0.25,
                                                **launch)
        assert_close(out, want, msg=name)


def test_choose_decode_config():
    """The chooser's rule (see its docstring): v2 with a tile of whole blocks, v1 where v2's
    tile would be too tall or too padded; split-KV by choose_num_kv_splits; every pick runs (the tests
    above) and compiles without spills (test_triton_compile.py)."""
    from paged_attention.triton_ops import DecodeConfig, choose_decode_config
    bf16 = torch.bfloat16
    assert choose_decode_config(128, 8, 8192, 128, bf16, 16) == DecodeConfig("v2", 64, 4, 4, 1)
    assert choose_decode_config(1, 8, 32768, 128, bf16, 16) == DecodeConfig("v2", 64, 4, 4, 32)
    assert choose_decode_config(1, 8, 32768, 128, torch.float32, 16).tile == 32
    assert choose_decode_config(4, 8, 100, 64, bf16, 12).tile == 48           # 4 blocks of 12 (16 rows each)
    assert choose_decode_config(4, 8, 100, 64, bf16, 256).tile == 64          # a quarter of a 256-token block
    assert choose_decode_config(4, 8, 100, 64, bf16, 200).version == "v1"     # one 200-token block = 256 rows
    assert choose_decode_config(4, 8, 100, 64, bf16, 5) == DecodeConfig("v1", 32, 4, 4, 1)   # 5 -> 8 rows: 3/8 padding
    assert choose_decode_config(4, 8, 100, 64, bf16, 1).version == "v1"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 1), (8, 2)])
def test_decode_mha_mqa_gqa(num_heads, num_kv_heads):
    check_decode("cpu", torch.float16, [19, 50], num_heads, num_kv_heads, 64, 16, [1, 2])


def test_decode_head_dim_not_a_power_of_two():
    check_decode("cpu", torch.float32, [21, 9], 4, 2, 24, 8, [1, 2])


def test_split_kv_more_splits_than_tiles_and_stale_max_seq_len():
    """Splits past a request's end are empty (weight 0); a max_seq_len hint that is too small
    unbalances the splits but the last split still runs to seq_len."""
    kv = make_paged_kv([3, 40], 2, 16, 4, pad_id=-1)
    q = random_query(2, 4, 16)
    want = ref.dense_decode_attention(q, kv.keys, kv.values, 0.25)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25)
    assert_close(ops.paged_decode_attention(*args, backend="triton", num_kv_splits=8), want)
    # (check_values=True would refuse the stale hint: the engine's hot path is what may pass one)
    assert_close(ops.paged_decode_attention(*args, backend="triton", num_kv_splits=2, max_seq_len=5,
                                            check_values=False), want)
    with pytest.raises(ValueError, match="max_seq_len=5 is smaller than the longest seq_len 40"):
        ops.paged_decode_attention(*args, backend="triton", num_kv_splits=2, max_seq_len=5)


def test_decode_row_longer_than_its_block_table_gives_nan_not_a_wrong_answer():
    """With check_values=False (the engine's hot path) a seq_len the block table cannot hold
    must not read the next row's block ids: that row comes out NaN, the others are exact."""
    kv = make_paged_kv([8, 8], 1, 16, 4)
    q = random_query(2, 2, 16)
    seq_lens = torch.tensor([8, 9], dtype=torch.int32)      # row 1 claims 9 tokens in 2 blocks of 4
    from paged_attention import triton_ops
    launches = (dict(version="v1", tile=16), dict(version="v2", tile=16), dict(version="v2", tile=32), {})
    for launch, num_kv_splits in itertools.product(launches, (1, 2)):
        out = triton_ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, seq_lens, 0.25,
                                                check_values=False, num_kv_splits=num_kv_splits, **launch)
        assert torch.isnan(out[1]).all(), launch
        assert_close(out[0], ref.dense_attention(q[:1], kv.keys[0], kv.values[0], 0.25, causal=False)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill(dtype):
    check_prefill("cpu", dtype, [5, 20, 1], 4, 2, 16, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_longer_than_one_query_tile(dtype):
    """Causal masking ACROSS query tiles on the CPU: prompts longer than BLOCK_M (32 rows in
    fp32, 64 in 16-bit) and not a multiple of it, so a program whose tile starts at row
    BLOCK_M must see every key of the earlier tiles and only the first keys of its own;
    several prompts of different lengths (tiles past a short prompt's end are empty), GQA
    4/2, a 1-token prompt, block size 16 with partial last blocks."""
    from paged_attention.triton_ops import PREFILL_BLOCKS
    block_m = PREFILL_BLOCKS[dtype][0]
    lens = [2 * block_m + 7, block_m + 1, 1]          # 3 tiles, 2 tiles (the second holds one row), 1
    check_prefill("cpu", dtype, lens, 4, 2, 16, 16)


def test_prefill_with_an_empty_prompt():
    """A 0-token prompt (query_start_loc repeats a value) is allowed in chapter 01's prefill."""
    check_prefill("cpu", torch.float32, [7, 0, 3], 2, 1, 16, 4)


def test_choose_num_kv_splits():
    from paged_attention.triton_ops import choose_num_kv_splits
    assert choose_num_kv_splits(num_seqs=64, num_kv_heads=8, max_seq_len=32768) == 1   # 512 programs already
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=200) == 1      # too short to split
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768) == 32   # 256 / 8 programs
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=1, max_seq_len=1024) == 4     # capped by length: 1024 / 256


# ----------------------------------------------------------------------------- GPU (native Triton)

GPU_LAUNCHES = [{}, dict(version="v1", tile=16)]     # the chooser's (v2 where the block size allows) and v1

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 7, 16, 32, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_decode(dtype, block_size, head_dim):
    seq_lens = [1, 0, 17, 300, 1024, 2049, 4000, 513]
    for num_heads, num_kv_heads in [(8, 8), (32, 8), (9, 3), (16, 1)]:
        check_decode("cuda", dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size, [1, None, 8],
                     launches=GPU_LAUNCHES)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_decode_long_context_few_sequences(dtype):
    check_decode("cuda", dtype, [32768, 5000], 32, 8, 128, 16, [None, 1, 64],
                 launches=GPU_LAUNCHES + [dict(version="v2", tile=128, num_warps=8, num_stages=3)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_prefill(dtype, head_dim):
    check_prefill("cuda", dtype, [1, 100, 513, 64, 1000], 12, 4, head_dim, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_junk_and_ones(dtype):
    kv = make_paged_kv([1, 700, 33], 2, 128, 16, dtype, "cuda", junk=float("nan"), pad_id=-3, extra_table_width=3)
    kv.value_cache[~torch.isnan(kv.value_cache)] = 1.0
    q = random_query(3, 8, 128, dtype, "cuda") * 4
    for num_kv_splits in (1, 4):
        out = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 1.0,
                                         backend="triton", num_kv_splits=num_kv_splits)
        if dtype == torch.float32:
            assert (out - 1).abs().max() <= 4 * torch.finfo(torch.float32).eps
        else:
            assert torch.equal(out, torch.ones_like(out))
