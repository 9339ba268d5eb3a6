"""Backend "cpu" (paged_attention.cpu_ops): chapter 01's rung on the CPU attention kernel ==
the reference through the dispatch, with the same functions and signatures as every backend
module. The kernel itself (layouts, dtypes, instruction sets, splits, bad input, AddressSanitizer)
is tested in tests/kernels_cpu/test_attention.py; the cache write in test_cache_ops.py."""
from __future__ import annotations

import inspect

import pytest
import torch

from paged_attention import cpu_ops, ops, torch_ops
from paged_attention.reference import dense_decode_attention
from paged_attention.synthetic import make_paged_kv
from tolerances import assert_close

pytestmark = pytest.mark.skipif(not cpu_ops.is_available(), reason=f"{cpu_ops.unavailable_reason()}")


def test_same_functions_as_the_other_backend_modules():
    """cpu_ops can be listed in the dispatch: the same op names and parameters as torch_ops."""
    def params(fn):
        return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]
    for op in ("reshape_and_cache", "paged_decode_attention", "paged_prefill_attention"):
        assert params(getattr(cpu_ops, op)) == params(getattr(torch_ops, op)), op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_the_reference(dtype):
    """Shuffled blocks, NaN in every unused slot, junk ids in the table padding, and a seq_len-0
    padding row (zeros, as in the reference)."""
    kv = make_paged_kv([5, 0, 90, 33], 3, 64, 16, dtype, pad_id=-7, extra_table_width=2)
    query = torch.randn(4, 9, 64).to(dtype)
    out = ops.paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125,
                                     backend="cpu")
    ref = ops.paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125,
                                     backend="reference")
    assert torch.equal(out[1], torch.zeros(9, 64, dtype=dtype))
    assert_close(out, ref, dtype)
    assert_close(out, dense_decode_attention(query, kv.keys, kv.values, 0.125), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_equals_the_torch_backend(dtype):
    """The cache write is the same scatter as the torch backend (bit for bit, slot -1 skipped),
    and the attention runs over the FRESH K/V (a token that is not cached is still attended);
    an empty prompt is fine."""
    g = torch.Generator().manual_seed(3)
    lens, num_kv_heads, head_dim, block_size = [37, 0, 1, 70], 2, 32, 8
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    query, key, value = (torch.randn(sum(lens), n, head_dim, generator=g).to(dtype) for n in (6, 2, 2))
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:sum(lens)]
    slots[[3, 50]] = -1                                              # padding tokens: not cached
    results = {}
    for backend in ("cpu", "torch"):
        kc = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        vc = kc.clone()
        out = ops.paged_prefill_attention(query, key, value, kc, vc, slots, qsl, 0.3, backend=backend)
        results[backend] = (out, kc.nan_to_num(7.0), vc.nan_to_num(7.0))
    assert_close(results["cpu"][0], results["torch"][0], dtype)
    assert torch.equal(results["cpu"][1], results["torch"][1]) and torch.equal(results["cpu"][2], results["torch"][2])


def test_bad_input_is_refused_by_the_chapters_checks():
    """The rung runs chapter 01's checks before the kernel: the same messages as every backend."""
    kv = make_paged_kv([5, 9], 2, 16, 4)
    query = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="longer than the blocks"):
        cpu_ops.paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens + 100, 0.25)
    with pytest.raises(ValueError, match="max_seq_len"):
        cpu_ops.paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25,
                                       max_seq_len=2)
