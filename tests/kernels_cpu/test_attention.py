"""The CPU attention kernel (kernels_cpu/attention.py, C++/OpenMP/AVX) == the reference.

Oracle: chapter 01's `dense_attention` on the DENSE twin of each batch (the same K/V stored
contiguously per request: no paging at all), causal with the queries as the last
query_len positions — exactly chapter 05's unified-attention semantics; one test also
checks chapter 05's paged reference loop itself. Tolerances from tests/tolerances.py.

Layouts are adversarial (synthetic.make_paged_kv): physical blocks shuffled, NaN in every
slot no request owns (free blocks, tails of last blocks), junk ids in block-table padding —
a kernel that reads one position past seq_len or dereferences one padding entry returns
NaN or crashes. Kinds: tolerance (decode, prefill, mixed, spec-decode shapes; GQA ratios,
block sizes 1..256, head dims, dtypes, forced KV splits and query tiles, every instruction
set this CPU runs), exact (split or not and thread count change nothing when the plan is
fixed; a seq_len-0 decode row is zeros), property (hypothesis over random ragged batches),
views, bad input (through chapter 05's "cpu" backend, which runs the shared checks first).
Chapter 01's "cpu" rung (paged_attention.cpu_ops) has its own tests in
tests/01_paged_attention/test_cpu_backend.py.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunked_prefill.ops import cpu_unified_attention
from kernels_cpu import attention as cpu_attention
from kernels_cpu import build
from paged_attention.reference import dense_attention
from paged_attention.synthetic import make_paged_kv
from tolerances import assert_close

if build.missing_build_tool():
    pytest.skip(build.missing_build_tool(), allow_module_level=True)

SMOL = dict(num_heads=9, num_kv_heads=3, head_dim=64)       # SmolLM2-135M's attention


def make_batch(query_lens, context_lens, *, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
               dtype=torch.float32, seed=0, **layout):
    """(args for cpu_attention.unified_attention, expected output). Junk: NaN in free slots, -7
    (an invalid id) in the block-table padding plus two padding columns."""
    layout = dict(dict(pad_id=-7, extra_table_width=2), **layout)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=seed, **layout)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    scale = head_dim ** -0.5
    expected = torch.cat([dense_attention(query[qsl[i]:qsl[i + 1]], kv.keys[i], kv.values[i], scale, causal=True)
                          for i in range(len(seq_lens))])
    return (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, scale), expected


def check(query_lens, context_lens, dtype=torch.float32, **kwargs):
    knobs = {k: kwargs.pop(k) for k in ("kv_splits", "q_tile") if k in kwargs}
    args, expected = make_batch(query_lens, context_lens, dtype=dtype, **kwargs)
    out = cpu_attention.unified_attention(*args, **knobs)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert not out.isnan().any(), "junk (NaN) leaked into the output"
    assert_close(out, expected, dtype)
    return out


# ----------------------------------------------------------------------------- tolerance

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 3, 16, 64, 256])
def test_decode_block_sizes(dtype, block_size):
    # ragged contexts, partial last blocks, one request shorter than a block
    check([1] * 5, [0, 2, 37, 200, 517], dtype, block_size=block_size)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (8, 1), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_ratios(num_heads, num_kv_heads, dtype):
    # GQA ratios 1, 3, 4, 8; decode and a prefill chunk in one batch
    check([1, 1, 23], [70, 300, 41], dtype, num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 80, 72, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims(head_dim, dtype):
    # 32/64/128: the compile-time head_dim loops; 80, 72, 8: the generic masked one
    check([1, 7, 1], [90, 33, 5], dtype, num_heads=4, num_kv_heads=2, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pure_prefill(dtype):
    # fresh prompts: context 0, up to a few hundred new tokens (several query tiles each)
    check([300, 37, 1, 129], [0, 0, 0, 0], dtype, **SMOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_chunked_prefill_step(dtype):
    # one chunked-prefill step: a 200-token chunk after 333 cached tokens, a fresh prompt,
    # a prefix-cache hit (context 64) and decodes
    check([1, 200, 1, 45, 17, 1], [500, 333, 7, 0, 64, 1023], dtype, **SMOL)


def test_spec_decode_verification():
    # k + 1 = 5 new tokens per request after their contexts
    check([5] * 6, [3, 50, 128, 129, 400, 15], **SMOL)


@pytest.mark.parametrize("kv_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("q_tile", [1, 4, 64])
def test_forced_splits_and_query_tiles(kv_splits, q_tile):
    # split-KV pieces and their merge, with causal query tiles (pieces a row cannot see)
    check([1, 40, 3], [600, 100, 31], kv_splits=kv_splits, q_tile=q_tile, **SMOL)


def test_plan():
    """How a step is cut into work items (exact): one item per decode request holding all its
    KV heads; a long prefill in query tiles per KV head, each stopping at the last position
    its rows see; a lone long request split over the threads (flash-decoding)."""
    decode = cpu_attention.plan(torch.tensor([100] * 8, dtype=torch.int32), torch.arange(9, dtype=torch.int32), 9, 3,
                          num_threads=2)
    assert [(i["seq"], i["num_kv_heads"], i["kv_end"], i["split"]) for i in decode] == [(s, 3, 100, False) for s in range(8)]
    # 50 new tokens after 50 cached: tiles of 64 // 3 = 21 tokens (63 rows: one KV head each);
    # the last tile's 8 tokens are 24 rows a KV head, so two KV heads fit one item
    prefill = cpu_attention.plan(torch.tensor([100], dtype=torch.int32), torch.tensor([0, 50], dtype=torch.int32), 9, 3,
                           num_threads=2)
    assert [(i["kv_head"], i["num_kv_heads"], i["q_begin"], i["q_count"], i["kv_end"]) for i in prefill] == [
        *[(h, 1, q0, 21, 50 + q0 + 21) for q0 in (0, 21) for h in range(3)], (0, 2, 42, 8, 100), (2, 1, 42, 8, 100)]
    lone = cpu_attention.plan(torch.tensor([4000], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 9, 3,
                        num_threads=2)
    assert len(lone) > 4 and all(i["split"] for i in lone)
    assert [(i["kv_begin"], i["kv_end"]) for i in lone] == list(zip(range(0, 4000, 256), [*range(256, 4000, 256), 4000]))
    forced = cpu_attention.plan(torch.tensor([100], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 9, 3,
                          num_threads=1, kv_splits=3)
    assert [(i["kv_begin"], i["kv_end"]) for i in forced] == [(0, 64), (64, 100)]    # whole 32-position tiles


def test_split_kv_for_one_long_request():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        check([1], [4000], **SMOL)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), 1e30])
def test_junk_in_unused_slots_and_table_padding(junk):
    # junk in free slots and tails; huge block ids in the padding (a read would segfault)
    check([1, 9, 1], [14, 20, 1], junk=junk, pad_id=2**30, extra_table_width=3, block_size=8)


def test_unshuffled_and_no_padding():
    check([1, 33], [63, 31], shuffle=False, pad_id=0, extra_table_width=0, num_spare_blocks=0)


def test_matches_chapter05_reference():
    """Bit-for-bit the semantics of chapter 05's paged oracle (gather + dense), not just the twin."""
    from chunked_prefill import attention_reference
    args, _ = make_batch([1, 40, 3, 1], [100, 0, 77, 5], **SMOL)
    assert_close(cpu_attention.unified_attention(*args), attention_reference.unified_attention(*args), torch.float32)


def test_paged_decode_attention():
    args, expected = make_batch([1] * 4, [10, 0, 100, 31], **SMOL)
    query, key_cache, value_cache, block_tables, seq_lens, _, scale = args
    out = cpu_attention.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    assert_close(out, expected, torch.float32)


def test_decode_seq_len_zero_row_is_zero():
    """A padding row (seq_len 0) of a decode batch reads nothing and gets zeros, as in the reference."""
    kv = make_paged_kv([5, 0, 9], 2, 16, 4, pad_id=-7, extra_table_width=1)
    query = torch.randn(3, 4, 16)
    out = cpu_attention.paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25)
    assert torch.equal(out[1], torch.zeros(4, 16))
    from paged_attention.reference import dense_decode_attention
    assert_close(out, dense_decode_attention(query, kv.keys, kv.values, 0.25), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention(dtype):
    """Chapter 01's prefill op on the kernel: the cache write is the same scatter as the torch
    backend (bit for bit, slot -1 skipped), and the attention runs over the FRESH K/V (a token
    that is not cached is still attended), matching the torch backend; an empty prompt is fine."""
    from paged_attention import torch_ops
    g = torch.Generator().manual_seed(3)
    lens, num_kv_heads, head_dim, block_size = [37, 0, 1, 70], 2, 32, 8
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    query, key, value = (torch.randn(sum(lens), n, head_dim, generator=g).to(dtype) for n in (6, 2, 2))
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:sum(lens)]
    slots[[3, 50]] = -1                                              # padding tokens: not cached
    results = {}
    for name, prefill in (("cpu", cpu_attention.paged_prefill_attention), ("torch", torch_ops.paged_prefill_attention)):
        kc = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        vc = kc.clone()
        out = prefill(query, key, value, kc, vc, slots, qsl, 0.3)
        results[name] = (out, kc.nan_to_num(7.0), vc.nan_to_num(7.0))
    assert_close(results["cpu"][0], results["torch"][0], dtype)
    assert torch.equal(results["cpu"][1], results["torch"][1]) and torch.equal(results["cpu"][2], results["torch"][2])


def test_chapter05_cpu_backend_has_the_backends_signature():
    """Chapter 05's "cpu" backend takes exactly the parameters of its other backends (the
    reference's); chapter 01's rung: tests/01_paged_attention/test_cpu_backend.py."""
    import inspect
    from chunked_prefill import attention_reference

    def params(fn):
        return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]
    assert params(cpu_unified_attention) == params(attention_reference.unified_attention)


@pytest.mark.slow
@pytest.mark.parametrize("isa", build.ALL_ISAS)
def test_other_instruction_sets(isa):
    """Every build this machine runs (each compiled on first use, the AVX-512 one emulated by
    SIMDe where the CPU lacks it) gives the same answers: fp32/bf16/fp16, a head_dim with a
    vector tail, split KV, query tiles. (conftest.py skips the variants not tested here.)"""
    ext = cpu_attention.load(isa)
    assert ext.isa() == isa
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in (64, 72):
            args, expected = make_batch([1, 30, 1], [200, 17, 3], dtype=dtype, num_heads=6, num_kv_heads=2,
                                        head_dim=head_dim, block_size=5)
            query, key_cache, value_cache, block_tables, seq_lens, qsl, scale = args
            out = torch.empty_like(query)
            ext.unified_attention_out(out, query, key_cache, value_cache, block_tables, seq_lens, qsl, scale, 3, 4)
            assert_close(out, expected, dtype, msg=f"{isa} {dtype} d={head_dim}")


# --------------------------------------------------------------------------------- exact

def test_plan_changes_nothing_when_fixed():
    """With the split and tile sizes fixed, the thread count only changes who computes an
    item, never its arithmetic: bit-identical outputs."""
    args, _ = make_batch([1, 50, 1], [700, 20, 64], **SMOL)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_attention.unified_attention(*args, kv_splits=3, q_tile=8))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_any_thread_count_is_right():
    args, expected = make_batch([1] * 3 + [64], [2000, 5, 300, 0], **SMOL)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            assert_close(cpu_attention.unified_attention(*args), expected, torch.float32, msg=f"{n} threads")
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ property

@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    num_seqs=st.integers(1, 5),
    group=st.sampled_from([1, 2, 3, 4]),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([8, 16, 32, 64, 80]),
    block_size=st.sampled_from([1, 2, 3, 7, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    shuffle=st.booleans(),
    kv_splits=st.sampled_from([None, 1, 2, 5]),
    q_tile=st.sampled_from([None, 1, 3]),
)
def test_random_batches(data, num_seqs, group, num_kv_heads, head_dim, block_size, dtype, shuffle,
                        kv_splits, q_tile):
    query_lens = data.draw(st.lists(st.integers(1, 40), min_size=num_seqs, max_size=num_seqs), label="query_lens")
    context_lens = data.draw(st.lists(st.integers(0, 150), min_size=num_seqs, max_size=num_seqs), label="context")
    check(query_lens, context_lens, dtype, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
          head_dim=head_dim, block_size=block_size, shuffle=shuffle, kv_splits=kv_splits, q_tile=q_tile,
          seed=data.draw(st.integers(0, 2**16), label="seed"))


# --------------------------------------------------------------------------------- views

def _views(t: torch.Tensor, junk: int) -> dict[str, torch.Tensor]:
    """Views equal to t whose storage between/around the elements holds junk."""
    views = {"strided": torch.stack([t, torch.full_like(t, junk)], dim=-1)[..., 0],
             "offset": torch.cat([torch.full((3,), junk, dtype=t.dtype), t.reshape(-1)])[3:].view(t.shape),
             "int64": t.long()}
    if t.dim() == 2:
        views["transposed"] = t.t().contiguous().t()
        views["row_slice"] = torch.cat([t, torch.full_like(t, junk)], dim=1)[:, :t.shape[1]]
    return views


def test_index_tensor_views():
    args, expected = make_batch([1, 12, 1], [30, 9, 0], block_size=4, **SMOL)
    query, key_cache, value_cache, block_tables, seq_lens, qsl, scale = args
    for name, view in _views(block_tables, junk=10**6).items():
        assert_close(cpu_attention.unified_attention(query, key_cache, value_cache, view, seq_lens, qsl, scale),
                     expected, torch.float32, msg=f"block_tables {name}")
    for name, view in _views(seq_lens, junk=10**6).items():
        assert_close(cpu_attention.unified_attention(query, key_cache, value_cache, block_tables, view, qsl, scale),
                     expected, torch.float32, msg=f"seq_lens {name}")
    for name, view in _views(qsl, junk=-5).items():
        assert_close(cpu_attention.unified_attention(query, key_cache, value_cache, block_tables, seq_lens, view, scale),
                     expected, torch.float32, msg=f"query_start_loc {name}")


def test_strided_query_and_interleaved_caches():
    """A query whose head_dim is not contiguous (copied), and K/V caches that are views of
    one [num_blocks, 2, block_size, kvh, d] tensor (read in place with their strides)."""
    args, expected = make_batch([1, 12, 1], [30, 9, 0], block_size=4, **SMOL)
    query, key_cache, value_cache, block_tables, seq_lens, qsl, scale = args
    strided_query = query.transpose(1, 2).contiguous().transpose(1, 2)
    both = torch.stack([key_cache, value_cache], dim=1)                  # [N, 2, B, kvh, d]
    out = cpu_attention.unified_attention(strided_query, both[:, 0], both[:, 1], block_tables, seq_lens, qsl, scale)
    assert_close(out, expected, torch.float32)
    heads_view = torch.cat([key_cache, key_cache], dim=2)[:, :, :key_cache.shape[2]]   # gap between rows
    out = cpu_attention.unified_attention(query, heads_view, value_cache, block_tables, seq_lens, qsl, scale)
    assert_close(out, expected, torch.float32)


# ----------------------------------------------------------------------------- bad input

def _small():
    args, _ = make_batch([1, 3], [4, 2], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    return list(args)


@pytest.mark.parametrize("mutate,error,match", [
    (lambda a: a.__setitem__(0, a[0][..., :12].contiguous()), ValueError, "head_dim mismatch"),
    (lambda a: a.__setitem__(0, a[0].double()), TypeError, "dtype"),
    (lambda a: a.__setitem__(1, a[1].transpose(1, 3).contiguous().transpose(1, 3)), ValueError, "unit stride"),
    (lambda a: a.__setitem__(3, a[3].float()), TypeError, "int32"),
    (lambda a: a.__setitem__(4, a[4] + 100), ValueError, "longer than the blocks"),
    (lambda a: a.__setitem__(5, torch.tensor([0, 2, 5], dtype=torch.int32)), ValueError, "run from 0 to num_tokens"),
    (lambda a: a.__setitem__(5, torch.tensor([0, 0, 4], dtype=torch.int32)), ValueError, "query_len >= 1"),
    (lambda a: a.__setitem__(4, torch.tensor([0, 5], dtype=torch.int32)), ValueError, "shorter than query lens"),
    (lambda a: a[3].__setitem__((0, 0), 999), IndexError, "blocks"),
])
def test_bad_input(mutate, error, match):
    """As the engine calls it (chapter 05's "cpu" backend: the shared checks, then the kernel's)."""
    args = _small()
    mutate(args)
    with pytest.raises(error, match=match):
        cpu_unified_attention(*args)


def test_bad_input_kernel_specific():
    args, _ = make_batch([1], [9], num_heads=2, num_kv_heads=1, head_dim=12, block_size=4)
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_attention.unified_attention(*args)
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_unified_attention(*args)
    args = _small()
    with pytest.raises(ValueError, match="kv_splits must be >= 1"):
        cpu_attention.unified_attention(*args, kv_splits=0)
    with pytest.raises(ValueError, match="max_query_len"):
        cpu_unified_attention(*args, max_query_len=2)


def test_refuses_non_cpu_tensors():
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in _small()]
    with pytest.raises(ValueError, match="CPU tensors"):
        cpu_unified_attention(*args, check_values=False)
    with pytest.raises(ValueError, match="CPU tensors"):
        cpu_attention.unified_attention(*args)


# ----------------------------------------------------------------------------- benchmark

def test_benchmark_smoke(tmp_path):
    """The benchmark runs, checks every peer against the kernel before timing, and writes
    its JSON (with the bandwidth limit) and plot."""
    from benchmarks import bench_cpu_attention as bench
    path = bench.main(["--smoke", "--out-dir", str(tmp_path)])
    result = json.loads(path.read_text())
    assert {r["impl"] for r in result["rows"]} == {"cpu", "torch", "sdpa_dense"}
    assert result["workload"]["memory_bandwidth_gb_s"] > 0
    assert all(r["ms"] > 0 and r["dram_limit_ms"] > 0 for r in result["rows"])
    assert path.with_suffix(".png").stat().st_size > 0


# ------------------------------------------------------------------- address sanitizer

ASAN_HARNESS = r"""
// 60 random batches (shapes, block sizes, splits, query tiles, thread counts) on caches
// sized EXACTLY to the blocks in use, with 1<<29 in every block-table padding entry: any
// read past a request's blocks or past the cache is an AddressSanitizer error. V = 1
// everywhere, so every output must be 1.
""" + r"""#include "attention.h"
#include <vector>
#include <random>
#include <cstdio>
#include <algorithm>
using namespace vfs_cpu;
int main(){
  std::mt19937 g(1);
  auto R=[&](int a,int b){ return std::uniform_int_distribution<int>(a,b)(g); };
  for(int it=0; it<60; ++it){
    int S=R(1,5), KVH=R(1,3), G=R(1,4), H=KVH*G; int Ds[]={8,16,24,32,64,72,128}; int D=Ds[R(0,6)];
    int Bs[]={1,2,3,5,16,64}; int B=Bs[R(0,5)];
    std::vector<int32_t> ql(S), sl(S), qsl(S+1,0);
    for(int s=0;s<S;s++){ ql[s]=R(1,40); sl[s]=ql[s]+R(0,200); qsl[s+1]=qsl[s]+ql[s]; }
    int W=0; int NB=0; for(int s=0;s<S;s++){ int nb=(sl[s]+B-1)/B; W=std::max(W,nb); NB+=nb; }
    W += 2;
    std::vector<int32_t> bt((size_t)S*W, 1<<29);   // junk padding (huge ids)
    std::vector<int> perm(NB); for(int i=0;i<NB;i++) perm[i]=i; std::shuffle(perm.begin(),perm.end(),g);
    int c=0; for(int s=0;s<S;s++){ int nb=(sl[s]+B-1)/B; for(int j=0;j<nb;j++) bt[s*W+j]=perm[c++]; }
    std::vector<float> k((size_t)NB*B*KVH*D, 1.0f), v(k.size(), 1.0f);
    int T=qsl[S]; std::vector<float> q((size_t)T*H*D, 0.5f), o(q.size());
    AttentionParams p{}; p.query=q.data(); p.q_stride_token=H*D; p.q_stride_head=D; p.out=o.data(); p.o_stride_token=H*D; p.o_stride_head=D;
    p.key_cache=k.data(); p.value_cache=v.data(); p.k_stride_block=p.v_stride_block=(int64_t)B*KVH*D; p.k_stride_token=p.v_stride_token=KVH*D; p.k_stride_head=p.v_stride_head=D;
    p.block_tables=bt.data(); p.bt_stride=W; p.seq_lens=sl.data(); p.query_start_loc=qsl.data();
    p.num_seqs=S; p.num_heads=H; p.num_kv_heads=KVH; p.head_dim=D; p.block_size=B; p.scale=0.1f; p.dtype=DType::F32;
    p.num_threads=R(1,2); p.kv_splits=R(0,4); p.q_tile=R(0,5);
    unified_attention(p);
    for(float x: o) if (std::abs(x-1.0f)>1e-5f){ printf("bad value %f at it %d\n", x, it); return 1; }
  }
  printf("asan ok\n");
}
"""


@pytest.mark.slow
def test_kernel_under_address_sanitizer(tmp_path):
    """The kernel compiled with -fsanitize=address,undefined (no torch: its C++ interface
    only) never reads outside the blocks a request uses."""
    cxx = build.compiler()
    src = tmp_path / "asan.cpp"
    src.write_text(ASAN_HARNESS)
    exe = tmp_path / "asan"
    flags = ["-O0", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-std=c++17", "-fopenmp",
             *build.isa_flags(build.cpu_isa()), f"-I{build.CSRC}"]
    compiled = subprocess.run([cxx, *flags, str(src), str(build.CSRC / "attention_kernel.cpp"), "-o", str(exe)],
                              capture_output=True, text=True)
    if compiled.returncode and "asan" in compiled.stderr.lower():
        pytest.skip(f"no AddressSanitizer runtime: {compiled.stderr[-300:]}")
    assert compiled.returncode == 0, compiled.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600,
                         env={"PATH": "/usr/bin:/bin", "ASAN_OPTIONS": "detect_leaks=0"})
    assert run.returncode == 0 and "asan ok" in run.stdout, run.stdout + run.stderr
