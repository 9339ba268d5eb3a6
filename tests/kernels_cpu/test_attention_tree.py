"""The CPU attention kernel verifying EAGLE-2 draft trees == chapter 04's tree attention reference.

A tree step's new tokens are a request's draft nodes in an order where a parent comes before its
children; node i sees the whole context and, among the new tokens, its ancestors and itself
(`spec_decode.tree.tree_attention_mask`). The kernel takes one [q_len, q_len] mask per request
(None: causal) — vLLM's tree attention bias — and must give what the oracle gives: chapter 04's
`paged_tree_attention_reference`, chapter 01's dense attention per query over exactly the keys it
may see. Layouts are adversarial (synthetic.make_paged_kv: shuffled blocks, NaN in every slot no
request owns, junk ids in table padding). Kinds: tolerance (random trees beside causal requests,
GQA, block sizes, dtypes, forced KV splits and query tiles — a split piece may hold no key a row
sees — and an 8-bit cache), exact (a chain mask is the causal kernel, bit for bit), bad input.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernels_cpu import attention as cpu_attention
from kernels_cpu import build
from paged_attention.kv_quant import kv_quant_for, quantize_rows
from paged_attention.synthetic import make_paged_kv
from spec_decode.tree import chain_parents, paged_tree_attention_reference, tree_attention_mask
from tolerances import assert_close

if build.missing_build_tool():
    pytest.skip(build.missing_build_tool(), allow_module_level=True)


def random_parents(n: int, rng: random.Random) -> list[int]:
    """A random tree of n nodes, node 0 the root, each node's parent an earlier node."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def tree_batch(query_lens, context_lens, trees, *, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
               dtype=torch.float32, seed=0):
    """(kernel args, masks): requests with `query_lens` new tokens after `context_lens` cached ones;
    trees[i] True: a random tree mask, False: causal (None)."""
    rng = random.Random(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=seed, pad_id=-7,
                       extra_table_width=2)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    masks = [tree_attention_mask(random_parents(q, rng)) if t else None for q, t in zip(query_lens, trees)]
    return (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, head_dim ** -0.5), masks


def expected(args, masks, kv_quant=None):
    query, kc, vc, bt, seq_lens, qsl, scale = args
    if kv_quant is not None:            # the oracle reads what the 8-bit cache holds, dequantized
        from paged_attention.kv_quant import read_rows
        d = query.shape[-1]
        kc = read_rows(kc.flatten(0, 1), kv_quant, "k", d, query.dtype).view(*kc.shape[:3], d)
        vc = read_rows(vc.flatten(0, 1), kv_quant, "v", d, query.dtype).view(*vc.shape[:3], d)
    return paged_tree_attention_reference(query.float(), kc.float(), vc.float(), bt, seq_lens, qsl, masks,
                                          scale).to(query.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_trees_beside_causal_requests(dtype, block_size, seed):
    # a tree of 9 nodes after a long context, a causal chunk, a 5-node tree after a short context,
    # a decode row, a tree with no context at all
    args, masks = tree_batch([9, 6, 5, 1, 4], [300, 40, 3, 77, 0], [True, False, True, False, True],
                             block_size=block_size, dtype=dtype, seed=seed)
    out = cpu_attention.unified_attention(*args, tree_masks=masks)
    assert not out.isnan().any(), "junk (NaN) leaked into the output"
    assert_close(out, expected(args, masks), dtype)


@pytest.mark.parametrize("kv_splits,q_tile", [(2, None), (3, 1), (5, 2), (None, 1)])
def test_forced_splits_and_query_tiles(kv_splits, q_tile):
    """A split KV piece may hold only new tokens a row does not see (all masked): that piece
    must add nothing, not NaN."""
    args, masks = tree_batch([9, 8], [20, 5], [True, True], block_size=4, seed=3)
    out = cpu_attention.unified_attention(*args, tree_masks=masks, kv_splits=kv_splits, q_tile=q_tile)
    assert not out.isnan().any()
    assert_close(out, expected(args, masks), torch.float32)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 1), (16, 2)])
def test_gqa_ratios(num_heads, num_kv_heads):
    args, masks = tree_batch([7, 3], [50, 9], [True, True], num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=32, block_size=8, seed=4)
    assert_close(cpu_attention.unified_attention(*args, tree_masks=masks), expected(args, masks), torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "fp8_e4m3", "fp8_per_token_head"])
def test_eight_bit_cache(kv_cache_dtype):
    kv_quant = kv_quant_for(kv_cache_dtype)
    args, masks = tree_batch([9, 1], [120, 30], [True, False], block_size=16, seed=5)
    query, kc, vc, bt, seq_lens, qsl, scale = args
    d = query.shape[-1]
    kc8 = quantize_rows(kc.nan_to_num().flatten(0, 1), kv_quant, "k").view(*kc.shape[:3], -1)
    vc8 = quantize_rows(vc.nan_to_num().flatten(0, 1), kv_quant, "v").view(*vc.shape[:3], -1)
    args8 = (query, kc8, vc8, bt, seq_lens, qsl, scale)
    out = cpu_attention.unified_attention(*args8, tree_masks=masks, kv_quant=kv_quant)
    assert_close(out, expected(args8, masks, kv_quant), torch.float32)
    assert kc8.shape[-1] in (d, d + 4)


def test_a_chain_mask_is_the_causal_kernel_bit_for_bit():
    args, _ = tree_batch([6, 1, 9], [30, 12, 0], [False] * 3, seed=6)
    chains = [tree_attention_mask(chain_parents(q - 1)) for q in (6, 1, 9)]
    assert torch.equal(cpu_attention.unified_attention(*args, tree_masks=chains), cpu_attention.unified_attention(*args))
    assert torch.equal(cpu_attention.unified_attention(*args, tree_masks=[None] * 3),
                       cpu_attention.unified_attention(*args))


def test_bad_masks_raise_before_the_kernel_runs():
    args, masks = tree_batch([4, 3], [5, 5], [True, True], seed=7)
    with pytest.raises(ValueError, match="tree masks for 2 requests"):
        cpu_attention.unified_attention(*args, tree_masks=masks[:1])
    with pytest.raises(ValueError, match=r"must be \[3, 3\]"):
        cpu_attention.unified_attention(*args, tree_masks=[masks[0], torch.ones(4, 4, dtype=torch.bool).tril()])
    future = masks[1].clone()
    future[0, 2] = True                   # a node seeing a later one: the kernel never reads that far
    with pytest.raises(ValueError, match="nothing after it"):
        cpu_attention.unified_attention(*args, tree_masks=[masks[0], future])
    blind = masks[1].clone()
    blind[2, 2] = False
    with pytest.raises(ValueError, match="see itself"):
        cpu_attention.unified_attention(*args, tree_masks=[masks[0], blind])
