"""The PyTorch ladder: dense == the per-request paged loop (backend "reference") ==
vectorized paged (backend "torch"), on adversarial layouts, plus the exact properties
every backend must also satisfy."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from paged_attention import ops, reference as ref, torch_ops
from paged_attention.synthetic import make_paged_kv, random_query
from tolerances import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # triton interpreter
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_all(q, kv, scale):
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale)
    return (ref.dense_decode_attention(q, kv.keys, kv.values, scale),
            ref.paged_decode_attention(*args),
            torch_ops.paged_decode_attention(*args))


@settings(max_examples=30, deadline=None)
@given(
    seq_lens=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    num_kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([4, 16, 24]),
    block_size=st.sampled_from([1, 2, 3, 7, 16, 32, 256]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_dense_random_shapes(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed):
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=seed, pad_id=-9, extra_table_width=1)
    q = random_query(len(seq_lens), num_kv_heads * group, head_dim, dtype, seed=seed + 1)
    dense, loop, vec = run_all(q, kv, head_dim ** -0.5)
    # The loop gathers rows and runs the dense code on them: bit-identical to dense.
    assert torch.equal(loop, dense)
    assert_close(vec, dense, dtype)
    assert not torch.isnan(vec).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_is_dense_attention_with_repeated_kv_heads(dtype):
    """GQA by grouping query heads == MHA on K/V heads repeated `group` times (the textbook form)."""
    kv = make_paged_kv([9, 20], num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype)
    q = random_query(2, 8, 16, dtype)
    out = torch_ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25)
    for i in range(2):
        k = kv.keys[i].repeat_interleave(4, dim=1)            # [seq_len, 8, d]
        v = kv.values[i].repeat_interleave(4, dim=1)
        want = ref.dense_attention(q[i:i + 1], k, v, 0.25, causal=False)[0]
        assert_close(out[i], want, dtype)


def test_dense_attention_matches_torch_sdpa():
    """The oracle itself agrees with PyTorch's scaled_dot_product_attention (causal, GQA expanded)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(11, 6, 16, generator=g), torch.randn(11, 2, 16, generator=g), torch.randn(11, 2, 16, generator=g)
    ours = ref.dense_attention(q, k, v, 0.3, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True, scale=0.3).transpose(0, 1)
    assert_close(ours, sdpa, torch.float32)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_physical_placement_and_junk_change_nothing(backend, dtype):
    """Same logical K/V, different physical blocks, junk (NaN / huge / zero) in every slot and
    block-table entry no request owns: bit-identical outputs, no NaN."""
    seq_lens = [13, 1, 40]
    q = random_query(3, 4, 16, dtype)
    outs = []
    for shuffle, junk, pad, spare in [(False, 0.0, 0, 0), (True, float("nan"), -3, 5), (True, 1e4, 10**6, 2)]:
        kv = make_paged_kv(seq_lens, 2, 16, 8, dtype, shuffle=shuffle, junk=junk, pad_id=pad,
                           num_spare_blocks=spare, extra_table_width=2)
        outs.append(ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                               0.25, backend=backend))
    assert not torch.isnan(outs[0]).any()
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_all_ones_give_exactly_ones(backend, dtype):
    """Attention weights sum to 1, so V == 1 must give 1 whatever the scores: exact after
    rounding to a 16-bit dtype; within 4 ulp in fp32 (the sum of the weights is rounded)."""
    kv = make_paged_kv([1, 17, 33], 1, 16, 16, dtype)
    for v in kv.values:
        v.fill_(1.0)
    kv.value_cache[~torch.isnan(kv.value_cache)] = 1.0
    q = random_query(3, 4, 16, dtype) * 4          # peaky softmax
    out = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 1.0, backend=backend)
    if dtype == torch.float32:
        assert (out - 1).abs().max() <= 4 * torch.finfo(torch.float32).eps
    else:
        assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_padding_row_with_seq_len_zero_gives_zeros(backend):
    kv = make_paged_kv([0, 5, 0], 2, 16, 4, pad_id=-1)
    q = random_query(3, 2, 16)
    out = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.5, backend=backend)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(out[1], ref.dense_attention(q[1:2], kv.keys[1], kv.values[1], 0.5, causal=False)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reference_caches_kv_that_decode_then_reads(dtype):
    """The whole journey in the reference: prefill a ragged batch (writes K/V by slot mapping),
    then decode one more token per request through the block tables == dense attention over
    prompt + new token."""
    from paged_attention import build_attention_metadata
    g = torch.Generator().manual_seed(3)
    lens, h, kvh, d, bs = [5, 12, 1], 4, 2, 16, 4
    block_ids = [[9, 2], [0, 7, 4, 11], [5]]               # room for one more token each
    md = build_attention_metadata(block_ids, [0, 0, 0], lens, bs)
    q, k, v = (torch.randn(sum(lens), n, d, generator=g).to(dtype) for n in (h, kvh, kvh))
    key_cache = torch.full((12, bs, kvh, d), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    out = ref.paged_prefill_attention(q, k, v, key_cache, value_cache, md.slot_mapping, md.query_start_loc, 0.25)
    starts = md.query_start_loc.tolist()
    for i in range(3):
        s, e = starts[i], starts[i + 1]
        assert_close(out[s:e], ref.dense_attention(q[s:e], k[s:e], v[s:e], 0.25, causal=True), dtype)
    # decode step: one new token per request, written at position lens[i]
    md2 = build_attention_metadata(block_ids, lens, [1, 1, 1], bs)
    q2, k2, v2 = (torch.randn(3, n, d, generator=g).to(dtype) for n in (h, kvh, kvh))
    ops.reshape_and_cache(k2, v2, key_cache, value_cache, md2.slot_mapping)
    dec = ref.paged_decode_attention(q2, key_cache, value_cache, md2.block_tables, md2.seq_lens, 0.25)
    for i in range(3):
        s, e = starts[i], starts[i + 1]
        keys, values = torch.cat([k[s:e], k2[i:i + 1]]), torch.cat([v[s:e], v2[i:i + 1]])
        assert_close(dec[i], ref.dense_attention(q2[i:i + 1], keys, values, 0.25, causal=False)[0], dtype)
