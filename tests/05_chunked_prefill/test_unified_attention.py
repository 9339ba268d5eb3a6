"""Unified (mixed-batch) paged attention: every backend vs the reference loop, and the
reference vs dense causal SDPA on contiguous K/V.

Kinds: tolerance (from the shared table), exact (poison must change nothing, V = 1 gives 1,
the sub-batch plan), property (hypothesis over random ragged batches), bad input. The
Triton kernels run under the interpreter on a CPU (tiny shapes: tens of programs per
call); the `gpu`-marked tests at the end run them natively at engine sizes
(`make test-gpu CH=05`). test_triton_compile.py compiles them for Hopper.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from chunked_prefill import attention_reference, attention_vectorized, build_attention_plan, ops
from chunked_prefill.ops import unified_attention
from paged_attention import build_attention_metadata
from paged_attention.synthetic import PagedBatch, index_views, make_paged_batch, strided_rows
from tolerances import assert_close

BACKENDS = ["torch", "triton"]
# triton 3.6's interpreter converts 1-element arrays with int(); numpy >= 1.25 warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
NAN = float("nan")
Batch = PagedBatch


def make_batch(query_lens, context_lens, *, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
               dtype=torch.float32, device="cpu", poison=NAN, table_pad=10**6, shuffle=True,
               spare_blocks=2, values_one=False, seed=0) -> PagedBatch:
    """A mixed batch in an adversarial paged layout, with its dense twin — chapter 01's
    synthetic paged K/V (`make_paged_batch`).

    Physical blocks are shuffled; every slot no request owns (spare blocks, the tail of
    each last block) holds `poison`; block-table padding (one extra column at least) holds
    `table_pad` (an id far out of range): a kernel that reads any of them changes its output.
    """
    return make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                            seed=seed, junk=poison, pad_id=table_pad, shuffle=shuffle, num_spare_blocks=spare_blocks,
                            extra_table_width=1, value_fill=1.0 if values_one else None)


def dense_attention(b: Batch) -> torch.Tensor:
    """Per request: dense causal SDPA on contiguous K/V, lower-right aligned (fp32)."""
    group = b.query.shape[1] // b.key_cache.shape[2]
    out, start = [], 0
    for q_len, k, v in zip(b.query_lens, b.keys, b.values):
        q = b.query[start:start + q_len].float().transpose(0, 1)               # [h, q_len, d]
        start += q_len
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)          # [h, s, d]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        s = k.shape[1]
        visible = torch.arange(s, device=k.device)[None, :] <= torch.arange(s - q_len, s, device=k.device)[:, None]
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=b.scale).transpose(0, 1))
    return torch.cat(out).to(b.query.dtype)


def run(backend: str, b: Batch, **kwargs) -> torch.Tensor:
    return unified_attention(*b.args, backend=backend, **kwargs)


# (query_lens, context_lens, block_size): each request is query_len new tokens after context_len cached ones
SCENARIOS = {
    "prefill": ([5, 11, 5, 1], [0, 0, 0, 0], 4),     # two equal prompts share one causal call (torch)
    "decode": ([1, 1, 1, 1], [3, 17, 8, 30], 4),
    "mixed": ([1, 7, 1, 12], [20, 0, 5, 9], 4),
    "chunk_splits_block": ([6, 1, 3], [5, 13, 0], 8),  # the chunk covers positions 5..10: starts and ends mid-block
    "exact_blocks": ([4, 1, 8], [12, 7, 0], 4),         # seq_lens 16, 8, 8: every last block exactly full
}


# ---------------------------------------------------------------- the oracle itself

@pytest.mark.parametrize("name", SCENARIOS)
def test_reference_matches_dense_sdpa(name):
    q, c, bs = SCENARIOS[name]
    b = make_batch(q, c, block_size=bs, num_heads=6, num_kv_heads=2)
    assert_close(attention_reference.unified_attention(*b.args), dense_attention(b))


# ---------------------------------------------------------------- every backend vs the oracle

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_backend_matches_reference(backend, name):
    q, c, bs = SCENARIOS[name]
    b = make_batch(q, c, block_size=bs, num_heads=6, num_kv_heads=2)
    out = run(backend, b, max_query_len=max(q), max_seq_len=int(b.seq_lens.max()))
    assert torch.isfinite(out).all()
    assert_close(out, attention_reference.unified_attention(*b.args))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 64, 256])
def test_block_sizes(backend, block_size):
    b = make_batch([1, 6, 1, 9], [9, 3, 0, 14], block_size=block_size)
    assert_close(run(backend, b), attention_reference.unified_attention(*b.args))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (16, 2), (4, 1), (8, 1)],
                         ids=["MHA", "GQA3", "GQA8", "MQA4", "MQA8"])
def test_gqa_ratios(backend, num_heads, num_kv_heads):
    b = make_batch([1, 5, 1], [7, 4, 12], num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert_close(run(backend, b), attention_reference.unified_attention(*b.args))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_head_dims(backend, head_dim):
    """64 and 128 (SmolLM2, Llama); 80 is not a power of two (the kernel pads and masks it)."""
    b = make_batch([1, 4], [6, 3], head_dim=head_dim, num_heads=3, num_kv_heads=1)
    assert_close(run(backend, b), attention_reference.unified_attention(*b.args))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(backend, dtype):
    b = make_batch([1, 7, 1, 12], [20, 0, 5, 9], dtype=dtype, num_heads=6, num_kv_heads=2)
    out = run(backend, b)
    assert out.dtype == dtype
    assert_close(out, attention_reference.unified_attention(*b.args), dtype=dtype)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_unshuffled_and_shuffled_blocks_agree(backend):
    """Physical placement is invisible: the same K/V in different blocks, the same output."""
    q, c = [1, 6, 1], [9, 3, 17]
    a = run(backend, make_batch(q, c, shuffle=False, spare_blocks=0))
    b = run(backend, make_batch(q, c, shuffle=True, spare_blocks=5))
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_poison_in_unused_slots_blocks_and_table_padding_changes_nothing(backend):
    """NaN in every slot no request owns and junk ids in the table padding: bit-identical output."""
    q, c = [1, 6, 1, 3], [9, 3, 0, 6]
    clean = run(backend, make_batch(q, c, poison=0.0, table_pad=0))
    poisoned = run(backend, make_batch(q, c, poison=NAN, table_pad=10**6))
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_values_all_one_give_one(backend, dtype):
    """With V = 1 every output is a convex combination of ones: 1, whatever the scores.

    Exact for fp16/bf16. In fp32 the softmax weights are summed twice in different orders
    (numerator and denominator), so the ratio may be off by a few ulp of 1.0, never more.
    """
    b = make_batch([1, 6, 1, 3], [9, 3, 0, 6], dtype=dtype, values_one=True)
    out = run(backend, b).float()
    if dtype == torch.float32:
        assert (out - 1).abs().max() <= 4 * torch.finfo(torch.float32).eps
    else:
        assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_chunked_prefill_equals_one_shot_prefill(backend):
    """A 20-token prompt in chunks 7 + 7 + 6 (block 8: every chunk boundary splits a block),
    each chunk attending to the cached earlier chunks, reproduces the one-shot prefill."""
    prompt, chunks, bs = 20, [7, 7, 6], 8
    full = make_batch([prompt], [0], block_size=bs)
    one_shot = run(backend, full)
    got, done = [], 0
    for n in chunks:
        # the same cache and block table; only this step's metadata changes
        step = replace(full, query=full.query[done:done + n], query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                       seq_lens=torch.tensor([done + n], dtype=torch.int32), query_lens=[n])
        got.append(run(backend, step))
        done += n
    assert_close(torch.cat(got), one_shot)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_empty_batch(backend):
    b = make_batch([], [], spare_blocks=1)
    out = run(backend, b)
    assert out.shape == (0, 4, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_query(backend):
    """The query may be a view into a fused QKV projection: [num_tokens, heads + 2 kv_heads, d]."""
    b = make_batch([1, 5], [6, 3], num_heads=4, num_kv_heads=2)
    qkv = torch.randn(b.query.shape[0], 8, 16)
    qkv[:, :4] = b.query
    strided = replace(b, query=qkv[:, :4])
    assert not strided.query.is_contiguous()
    assert torch.equal(run(backend, strided), run(backend, b))


# ---------------------------------------------------------------- property test

@st.composite
def ragged_batches(draw):
    n = draw(st.integers(1, 4))
    query_lens = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    context_lens = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    num_heads, num_kv_heads = draw(st.sampled_from([(2, 2), (6, 2), (4, 1)]))
    return make_batch(query_lens, context_lens, block_size=block_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, deadline=None)
@given(b=ragged_batches())
def test_random_ragged_batches(backend, b):
    expected = attention_reference.unified_attention(*b.args)
    assert_close(run(backend, b), expected)
    assert_close(expected, dense_attention(b))


# ---------------------------------------------------------------- the torch path's plan

def test_plan_sub_batches_groups_by_query_len_sorted_and_capped():
    query_lens = [1, 5, 1, 1, 5, 300, 1]
    seq_lens = [10, 20, 60, 30, 8, 900, 40]
    # query_len 1, by seq_len: 0 (10), 3 (30), 6 (40), 2 (60). [0, 3, 6] pads to 3 x 40 = 120
    # rows, which fits; adding 2 would pad to 4 x 60 = 240. The 900-row request is alone.
    assert attention_vectorized.plan_sub_batches(query_lens, seq_lens, kv_rows_per_batch=120) == [
        [0, 3, 6], [2], [4, 1], [5]]
    assert attention_vectorized.plan_sub_batches(query_lens, seq_lens, kv_rows_per_batch=10**6) == [
        [0, 3, 6, 2], [4, 1], [5]]


class CountSDPA(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.scaled_dot_product_attention
        return func(*args, **(kwargs or {}))


def test_torch_path_one_call_for_a_decode_batch():
    """64 decodes that fit the row budget are ONE SDPA call (no Python loop over
    requests); the default budget makes one call per planned sub-batch; tiny budgets
    (every request alone) give the same answer."""
    b = make_batch([1] * 64, [(7 * i) % 40 for i in range(64)])
    with CountSDPA() as batched:
        one_call = attention_vectorized.unified_attention(*b.args, kv_rows_per_batch=64 * 40)
    with CountSDPA() as default:
        out = run("torch", b)
    with CountSDPA() as alone:
        one_by_one = attention_vectorized.unified_attention(*b.args, kv_rows_per_batch=1)
    plan = attention_vectorized.plan_sub_batches([1] * 64, b.seq_lens.tolist())
    assert (batched.calls, default.calls, alone.calls) == (1, len(plan), 64)
    assert len(plan) == 2            # 64 x 40 padded rows exceed 2048: the sorted requests split in two
    expected = attention_reference.unified_attention(*b.args)
    for got in (one_call, out, one_by_one):
        assert_close(got, expected)


# ---------------------------------------------------------------- Triton-specific variants

@pytest.mark.parametrize("name,num_kv_splits", [("decode", 2), ("decode", 16), ("mixed", 2), ("mixed", 4)])
def test_triton_split_kv_matches_reference(name, num_kv_splits):
    """The 3-D (split-KV) kernel + reduce is correct for any batch, not only decode."""
    from chunked_prefill import triton_ops
    q, c, bs = SCENARIOS[name]
    b = make_batch(q, c, block_size=bs, num_heads=6, num_kv_heads=2)
    out = triton_ops.unified_attention(*b.args, num_kv_splits=num_kv_splits, tile_n=16)
    assert_close(out, attention_reference.unified_attention(*b.args))


@pytest.mark.parametrize("block_m,tile_n", [(16, 16), (64, 32), (8, 64)])
def test_triton_tile_shapes(block_m, tile_n):
    """16 rows with GROUP 3 is 5 positions x 3 heads + 1 masked row; tiles of 16 keys
    cross 4-slot blocks; 8 rows is 2 positions (interpreter-only: GPU tl.dot wants >= 16)."""
    from chunked_prefill import triton_ops
    b = make_batch([1, 7, 1, 12], [20, 0, 5, 9], num_heads=6, num_kv_heads=2)
    out = triton_ops.unified_attention(*b.args, block_m=block_m, tile_n=tile_n, num_kv_splits=1)
    assert_close(out, attention_reference.unified_attention(*b.args))


def test_triton_launch_heuristics():
    from chunked_prefill import triton_ops as T
    half, fp32 = torch.bfloat16, torch.float32
    assert T.choose_tiles(3, 1, 64, half) == (16, 5, 64)         # decode: tl.dot's 16-row minimum, 64-key tiles
    assert T.choose_tiles(3, None, 64, half) == (64, 21, 32)     # unknown max_query_len: prefill tiles
    assert T.choose_tiles(8, 4, 128, half) == (32, 4, 32)
    assert T.choose_tiles(4, 512, 256, half) == (32, 8, 32)      # head_dim 256: 32 rows
    assert T.choose_tiles(32, 1, 64, half) == (32, 1, 64)        # a tile holds at least one whole group
    assert T.choose_tiles(4, 1, 256, half) == (16, 4, 32)        # head_dim 256 decode keeps 32-key tiles
    assert T.choose_tiles(3, 1, 64, fp32) == (16, 5, 32)         # fp32 decode too
    assert T.choose_tiles(3, None, 64, fp32) == (16, 5, 32)      # ieee fp32: operands in registers
    assert T.choose_tiles(1, None, 256, fp32) == (16, 16, 16)
    assert T.choose_num_kv_splits(4, 3, max_query_len=1, max_seq_len=4096) == 16
    assert T.choose_num_kv_splits(4, 3, max_query_len=1, max_seq_len=40) == 2   # only 2 tiles of 32 keys
    assert T.choose_num_kv_splits(64, 3, max_query_len=1, max_seq_len=4096) == 1  # 192 programs: enough
    assert T.choose_num_kv_splits(4, 3, max_query_len=2, max_seq_len=4096) == 1   # not pure decode
    assert T.choose_num_kv_splits(4, 3, max_query_len=None, max_seq_len=None) == 1


def test_triton_reads_no_tensor_values_with_check_values_false(monkeypatch):
    """check_values=False must not read metadata values (a device sync on a GPU; illegal
    in CUDA-graph capture): any read through item/tolist/int/bool fails here."""
    from chunked_prefill import triton_ops
    b = make_batch([3, 1], [4, 9], num_heads=6, num_kv_heads=2)
    expected = attention_reference.unified_attention(*b.args)

    def read(*_args, **_kwargs):
        raise AssertionError("a tensor value was read")
    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read)
    for splits in (1, 2):
        out = triton_ops.unified_attention(*b.args, check_values=False, max_query_len=3, max_seq_len=10,
                                           num_kv_splits=splits)
        monkeypatch.undo()
        assert_close(out, expected)
        for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, read)


# ---------------------------------------------------------------- bad input: clear errors

def _bad(field: str, value):
    b = make_batch([1, 3], [4, 2])
    args = dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache,
                query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_tables=b.block_tables)
    args[field] = value(args) if callable(value) else value
    return args


BAD_INPUTS = {
    "query_not_3d": (lambda: _bad("query", lambda a: a["query"][0]), ValueError, "query must be"),
    "head_dim_mismatch": (lambda: _bad("query", lambda a: a["query"][..., :8]), ValueError, "head_dim mismatch"),
    "heads_not_multiple": (lambda: _bad("query", lambda a: a["query"][:, :3]), ValueError, "multiple of num_kv_heads"),
    "kv_shapes_differ": (lambda: _bad("value_cache", lambda a: a["value_cache"][:-1]), ValueError, "key_cache and value_cache"),
    "dtype_mismatch": (lambda: _bad("query", lambda a: a["query"].half()), TypeError, "dtype mismatch"),
    "float_metadata": (lambda: _bad("seq_lens", lambda a: a["seq_lens"].float()), TypeError, "seq_lens must be int32"),
    "qsl_wrong_length": (lambda: _bad("query_start_loc", torch.tensor([0, 4], dtype=torch.int32)), ValueError, r"num_seqs \+ 1"),
    "qsl_not_ending_at_num_tokens": (lambda: _bad("query_start_loc", torch.tensor([0, 1, 3], dtype=torch.int32)), ValueError, "num_tokens=4"),
    "qsl_not_increasing": (lambda: _bad("query_start_loc", torch.tensor([0, 0, 4], dtype=torch.int32)), ValueError, "query_len >= 1"),
    "seq_len_below_query_len": (lambda: _bad("seq_lens", torch.tensor([5, 2], dtype=torch.int32)), ValueError, "shorter than query lens"),
    "seq_len_beyond_block_table": (lambda: _bad("seq_lens", torch.tensor([5, 40], dtype=torch.int32)), ValueError, "longer than the blocks given"),
    "block_id_out_of_range": (lambda: _bad("block_tables", lambda a: a["block_tables"].index_fill(1, torch.tensor([0]), 99)), IndexError, "cache has"),
    "block_id_negative": (lambda: _bad("block_tables", lambda a: a["block_tables"].index_fill(1, torch.tensor([0]), -1)), IndexError, "cache has"),
    "block_tables_rows": (lambda: _bad("block_tables", lambda a: a["block_tables"][:1]), ValueError, "block_tables must be"),
}


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_clear_error(backend, case):
    make_args, exc, match = BAD_INPUTS[case]
    with pytest.raises(exc, match=match):
        unified_attention(**make_args(), scale=0.25, backend=backend)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_max_lens_smaller_than_the_batch_are_rejected(backend):
    b = make_batch([1, 3], [4, 2])
    with pytest.raises(ValueError, match="max_query_len=2"):
        run(backend, b, max_query_len=2)
    with pytest.raises(ValueError, match="max_seq_len=4"):
        run(backend, b, max_seq_len=4)
    assert_close(run(backend, b, max_query_len=8, max_seq_len=64), attention_reference.unified_attention(*b.args))


def test_unknown_backend():
    b = make_batch([1], [2])
    with pytest.raises(ValueError, match=r"unknown unified_attention backend 'cuda'.*'torch', 'triton'"):
        run("cuda", b)


def test_triton_rejects_unsupported_shapes_and_dtypes():
    from chunked_prefill import triton_ops
    b = make_batch([1], [2], head_dim=264, num_heads=1, num_kv_heads=1)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        triton_ops.unified_attention(*b.args)
    b = make_batch([1], [2], dtype=torch.float64)
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        triton_ops.unified_attention(*b.args)
    assert_close(run("torch", b), attention_reference.unified_attention(*b.args), dtype=torch.float32)  # torch: any float
    with pytest.raises(ValueError, match="num_kv_splits"):
        triton_ops.unified_attention(*make_batch([1], [2]).args, num_kv_splits=3)
    with pytest.raises(ValueError, match="block_m"):
        triton_ops.unified_attention(*make_batch([1], [2]).args, block_m=24)


def test_dispatch_default_is_torch(monkeypatch):
    b = make_batch([1], [2])
    monkeypatch.setattr(ops.attention_vectorized, "unified_attention", lambda *a, **k: "torch path")
    assert unified_attention(*b.args) == "torch path"


# ---------------------------------------------------------------- views of the inputs

@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_any_view_of_the_index_tensors(backend):
    """Strided, offset and transposed seq_lens / query_start_loc / block_tables give the
    output of the contiguous tensors: the kernels read the view, not the storage behind it
    (which holds junk here: huge lengths and block ids). Non-contiguous query and caches too."""
    b = make_batch([1, 6, 1, 3], [9, 3, 0, 6], num_heads=6, num_kv_heads=2)
    want = run(backend, b)
    for field, junk in (("seq_lens", 10**6), ("query_start_loc", 10**6), ("block_tables", 10**6)):
        for name, view in index_views(getattr(b, field), junk).items():
            assert torch.equal(view, getattr(b, field))
            assert torch.equal(run(backend, replace(b, **{field: view})), want), f"{field} {name}"
    both = torch.stack([b.key_cache, b.value_cache], dim=1)            # K and V interleaved: strided caches
    out = run(backend, replace(b, query=strided_rows(b.query), key_cache=both[:, 0], value_cache=both[:, 1]))
    assert_close(out, want)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_checks_validate_the_view(backend):
    """A view whose elements are bad is refused even when the storage around it is fine."""
    b = make_batch([1, 3], [4, 2])
    bad_lens = torch.tensor([[5, 5], [40, 5]], dtype=torch.int32)[:, 0]          # 40 needs more blocks than given
    with pytest.raises(ValueError, match="longer than the blocks given"):
        run(backend, replace(b, seq_lens=bad_lens))
    bad_qsl = torch.tensor([[0, 1], [0, 2], [4, 4]], dtype=torch.int32)[:, 0]    # [0, 0, 4]: request 0 gets no token
    with pytest.raises(ValueError, match="query_len >= 1"):
        run(backend, replace(b, query_start_loc=bad_qsl))


# ---------------------------------------------------------------- the per-step attention plan (torch path)

def _metadata_batch():
    """A chunked-prefill step: decodes, a fresh prompt, a chunk after cached context."""
    return make_batch([1, 5, 1, 4], [9, 0, 20, 3], num_heads=6, num_kv_heads=2)


def test_plan_gives_the_same_result_and_is_reused_across_layers(monkeypatch):
    """A plan built once serves every layer (different caches, queries): bit-identical to
    building it inside each call, and unified_attention builds nothing when given one."""
    b = _metadata_batch()
    g = torch.Generator().manual_seed(1)
    layers = [replace(b, query=torch.randn(b.query.shape, generator=g), key_cache=b.key_cache + i,
                      value_cache=b.value_cache * (i + 2)) for i in range(3)]       # same step, other layers' data
    plan = attention_vectorized.build_plan(b.block_tables, b.seq_lens, b.query_start_loc, b.key_cache.shape[1])
    expected = [run("torch", layer) for layer in layers]
    assert all(torch.isfinite(e).all() for e in expected)
    monkeypatch.setattr(attention_vectorized, "build_plan", lambda *a, **k: pytest.fail("the plan was rebuilt"))
    for layer, want in zip(layers, expected):
        got = unified_attention(layer.query, layer.key_cache, layer.value_cache, b.block_tables, b.seq_lens,
                                b.query_start_loc, layer.scale, backend="torch", plan=plan)
        assert torch.equal(got, want)


def test_plan_through_attention_metadata():
    """The engine's path: build the plan once per step from AttentionMetadata (vLLM's
    AttentionMetadataBuilder.build), attach it, and every layer passes md.plan."""
    block_size = 4
    md = build_attention_metadata([[3, 0, 7], [5, 1], [2, 6, 4, 8]], [9, 2, 0], [1, 3, 13], block_size)
    g = torch.Generator().manual_seed(0)
    caches = torch.randn(2, 9, block_size, 2, 16, generator=g)
    query = torch.randn(md.num_tokens, 6, 16, generator=g)
    plan = build_attention_plan(md, block_size, "torch")
    assert isinstance(plan, attention_vectorized.AttentionPlan)
    md = replace(md, plan=plan)
    args = (query, caches[0], caches[1], md.block_tables, md.seq_lens, md.query_start_loc, 0.25)
    assert torch.equal(unified_attention(*args, plan=md.plan), unified_attention(*args))
    assert_close(unified_attention(*args, plan=md.plan), attention_reference.unified_attention(*args))
    for backend in ("reference", "triton"):          # they precompute nothing: no plan to carry
        assert build_attention_plan(md, block_size, backend) is None
    with pytest.raises(ValueError, match="unknown unified_attention backend 'sdpa'"):
        build_attention_plan(md, block_size, "sdpa")


def test_plan_for_other_metadata_is_refused():
    b = _metadata_batch()
    plan = attention_vectorized.build_plan(b.block_tables, b.seq_lens, b.query_start_loc, b.key_cache.shape[1])
    other = make_batch([1, 1], [3, 4])                                        # another step: 2 tokens
    with pytest.raises(ValueError, match="built for 11 tokens in blocks of 4; the call has 2 tokens"):
        run("torch", other, plan=plan)
    same_shapes = replace(b, seq_lens=b.seq_lens.clone())                     # equal values, other tensor
    with pytest.raises(ValueError, match="built from other block_tables / seq_lens / query_start_loc"):
        run("torch", same_shapes, plan=plan)
    with pytest.raises(ValueError, match="plan= is the \\('torch',\\) backends' per-step precomputation"):
        run("triton", b, plan=plan)
    with pytest.raises(ValueError, match="kv_rows_per_batch shapes a plan"):
        attention_vectorized.unified_attention(*b.args, plan=plan, kv_rows_per_batch=64)


# ---------------------------------------------------------------- native kernels on a GPU (make test-gpu)

GPU_SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}   # (num_heads, num_kv_heads, head_dim)


def gpu_mixed_batch(shape, dtype, block_size=16, seed=0):
    """One chunked-prefill step at a realistic size: 32 decodes with contexts up to ~2k,
    a 300-token chunk after 700 cached tokens (boundaries split 16-slot blocks), a fresh
    200-token prompt, and a 3-token speculative verify."""
    num_heads, num_kv_heads, head_dim = GPU_SHAPES[shape]
    ctx = [(97 * i) % 2000 + 1 for i in range(32)]
    return make_batch([1] * 32 + [300, 200, 3], ctx + [700, 0, 45], num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                      device="cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_mixed_batch_matches_reference(backend, dtype, shape):
    b = gpu_mixed_batch(shape, dtype)
    expected = attention_reference.unified_attention(*b.args)
    out = run(backend, b, max_query_len=300, max_seq_len=int(b.seq_lens.max()))
    assert out.is_cuda and torch.isfinite(out).all()
    assert_close(out, expected, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_gpu_block_sizes(block_size):
    b = gpu_mixed_batch("smollm2", torch.bfloat16, block_size=block_size)
    assert_close(run("triton", b), attention_reference.unified_attention(*b.args), dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_split_kv_decode_long_contexts(dtype):
    """Few long decodes: the heuristic picks the 3-D kernel; it must match the 2-D one too."""
    from chunked_prefill import triton_ops
    b = make_batch([1] * 4, [8000, 5000, 3000, 6100], num_heads=32, num_kv_heads=8, head_dim=128,
                   block_size=16, dtype=dtype, device="cuda")
    assert triton_ops.choose_num_kv_splits(4, 8, max_query_len=1, max_seq_len=8001) == 16
    expected = attention_reference.unified_attention(*b.args)
    split = run("triton", b, max_query_len=1, max_seq_len=8001)
    assert_close(split, expected, dtype=dtype)
    assert_close(triton_ops.unified_attention(*b.args, num_kv_splits=1), expected, dtype=dtype)


@pytest.mark.gpu
def test_gpu_poison_changes_nothing():
    q, c = [1] * 8 + [37, 5], [(13 * i) % 90 for i in range(8)] + [20, 0]
    clean = run("triton", make_batch(q, c, block_size=16, dtype=torch.bfloat16, device="cuda", poison=0.0, table_pad=0))
    poisoned = run("triton", make_batch(q, c, block_size=16, dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(poisoned, clean)


@pytest.mark.gpu
@pytest.mark.parametrize("max_query_len", [1, 300])
def test_gpu_no_sync_and_cuda_graph_capture(max_query_len):
    """check_values=False + known max lens: no host sync, so the op can live in a CUDA graph
    (max_query_len=1 takes the split-KV path: its scratch buffers come from the graph pool)."""
    q_lens = [1] * 6 if max_query_len == 1 else [1] * 5 + [300]
    b = make_batch(q_lens, [50, 400, 7, 1000, 33, 200], num_heads=9, num_kv_heads=3, head_dim=64,
                   block_size=16, dtype=torch.bfloat16, device="cuda")
    kwargs = dict(backend="triton", max_query_len=max_query_len, max_seq_len=1200, check_values=False)
    expected = attention_reference.unified_attention(*b.args)
    run_fn = lambda: unified_attention(*b.args, **kwargs)   # noqa: E731
    run_fn()                                                  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run_fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(out, expected, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_fn()
    b.query.copy_(torch.randn_like(b.query))                  # new inputs in the same buffers
    graph.replay()
    assert_close(captured, attention_reference.unified_attention(*b.args), dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30, deadline=None)
@given(b=ragged_batches())
def test_gpu_random_ragged_batches(backend, b):
    b = b.to("cuda")
    assert_close(run(backend, b), attention_reference.unified_attention(*b.args))
