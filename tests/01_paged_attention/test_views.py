"""Any view of any input: every op of every backend gives the answer of the contiguous
tensors, or refuses cleanly — never a silent read of the storage behind a view.

Why this is a real risk: a Triton or CUDA kernel reads an index tensor through its data
pointer, element i at ptr + i, which is the view's element i only when the tensor is
contiguous, while the argument checks read the VIEW. A `[::2]` slot mapping used to pass
the range check and then write the elements in between (out of bounds); strided seq_lens
gave wrong attention. Each view below hides junk in exactly the storage a pointer-reading
kernel would wrongly read: out-of-range slots, huge seq_lens, huge block ids — so a kernel
that reads storage instead of the view fails loudly (wrong output, NaN, or a write into
the wrong rows).
"""
import pytest
import torch

from paged_attention import build_attention_metadata, ops
from paged_attention.synthetic import index_views, make_paged_kv, random_query, strided_rows

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
BACKENDS = ["reference", "torch", "triton"]          # "cuda": test_cuda_kernels_emulated.py (and the GPU tests)


def views_of(t: torch.Tensor, junk: int) -> dict[str, torch.Tensor]:
    views = index_views(t, junk)
    for name, v in views.items():
        assert torch.equal(v, t), name
        assert name in ("offset", "row_slice") or not v.is_contiguous(), name
    return views


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_views(backend):
    g = torch.Generator().manual_seed(0)
    num_slots = 6 * 4
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([9, 23, -1, 0, 14])
    want_k, want_v = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    ops.reshape_and_cache(key, value, want_k, want_v, slots, backend=backend)
    for slot_dtype in (torch.int64, torch.int32):
        for name, view in views_of(slots.to(slot_dtype), junk=num_slots + 50).items():
            kc, vc = torch.zeros_like(want_k), torch.zeros_like(want_v)
            ops.reshape_and_cache(key, value, kc, vc, view, backend=backend)
            assert torch.equal(kc, want_k) and torch.equal(vc, want_v), name
    # strided key/value rows and K/V caches that are views of one interleaved tensor
    both = torch.zeros(6, 2, 4, 2, 8)
    ops.reshape_and_cache(strided_rows(key), strided_rows(value), both[:, 0], both[:, 1], slots, backend=backend)
    assert torch.equal(both[:, 0], want_k) and torch.equal(both[:, 1], want_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_checks_the_view_it_writes(backend):
    """A view with a bad slot is refused, whatever its storage holds, and nothing is written."""
    key = torch.randn(3, 2, 8)
    kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    bad = torch.tensor([[1, 0], [8, 0], [2, 0]])[:, 0]             # slot 8 is past the 8 slots
    with pytest.raises(IndexError, match=r"slots in \[1, 8\]"):
        ops.reshape_and_cache(key, key, kc, vc, bad, backend=backend)
    assert not kc.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_kv_splits", [None, 3])
def test_decode_views(backend, num_kv_splits):
    if num_kv_splits is not None and backend != "triton":
        pytest.skip("split-KV is a Triton variant")
    kv = make_paged_kv([5, 9, 13, 0], 2, 16, 4, pad_id=0, extra_table_width=1)
    q = random_query(4, 4, 16)
    variant = {} if num_kv_splits is None else dict(num_kv_splits=num_kv_splits)
    want = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25,
                                      backend=backend, **variant)
    assert not torch.isnan(want).any()
    for name, sl in views_of(kv.seq_lens, junk=10**6).items():
        out = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, sl, 0.25,
                                         backend=backend, **variant)
        assert torch.equal(out, want), f"seq_lens {name}"
    for name, bt in views_of(kv.block_tables, junk=10**6).items():
        out = ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, bt, kv.seq_lens, 0.25,
                                         backend=backend, **variant)
        assert torch.equal(out, want), f"block_tables {name}"
    # strided query / caches: a view of a fused qkv output, K and V interleaved in one tensor
    qkv = torch.cat([q, torch.full_like(q, float("nan"))], dim=1)
    both = torch.stack([kv.key_cache, kv.value_cache], dim=1)
    out = ops.paged_decode_attention(qkv[:, :4], both[:, 0], both[:, 1], kv.block_tables, kv.seq_lens, 0.25,
                                     backend=backend, **variant)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)     # the same data; only the op order may differ
    out = ops.paged_decode_attention(strided_rows(q), kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                     0.25, backend=backend, **variant)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_checks_the_view_it_reads(backend):
    """The checks see the view: a too-long seq_len or a bad block id IN the view raises,
    even though the storage elements next to it are fine."""
    kv = make_paged_kv([5, 9], 2, 16, 4, num_spare_blocks=0)
    q = random_query(2, 4, 16)
    bad_lens = torch.tensor([[5, 0], [99, 0]], dtype=torch.int32)[:, 0]
    with pytest.raises(ValueError, match="seq_len 99 is longer than the blocks given"):
        ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, bad_lens, 0.25, backend=backend)
    bad_table = torch.cat([kv.block_tables, torch.zeros_like(kv.block_tables)], dim=1)[:, :kv.block_tables.shape[1]]
    bad_table = bad_table.t().contiguous().t()
    bad_table[1, 0] = 77
    with pytest.raises(IndexError, match=r"blocks in \[\d+, 77\]"):
        ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, bad_table, kv.seq_lens, 0.25, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_views(backend):
    g = torch.Generator().manual_seed(1)
    lens, block_size = [5, 11, 1], 4
    block_ids = [[3, 0], [5, 1, 6], [2]]
    md = build_attention_metadata(block_ids, [0, 0, 0], lens, block_size)
    q, k, v = (torch.randn(sum(lens), n, 16, generator=g) for n in (4, 2, 2))

    def run(q, k, v, slots, qsl):
        kc = torch.full((8, block_size, 2, 16), float("nan"))
        vc = kc.clone()
        out = ops.paged_prefill_attention(q, k, v, kc, vc, slots, qsl, 0.3, backend=backend)
        return out, kc.nan_to_num(7.0), vc.nan_to_num(7.0)
    want = run(q, k, v, md.slot_mapping, md.query_start_loc)
    for name, slots in views_of(md.slot_mapping, junk=10**6).items():
        assert all(torch.equal(a, b) for a, b in zip(run(q, k, v, slots, md.query_start_loc), want)), f"slots {name}"
    for name, qsl in views_of(md.query_start_loc, junk=10**6).items():
        assert all(torch.equal(a, b) for a, b in zip(run(q, k, v, md.slot_mapping, qsl), want)), f"qsl {name}"
    got = run(strided_rows(q), strided_rows(k), strided_rows(v), md.slot_mapping, md.query_start_loc)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
