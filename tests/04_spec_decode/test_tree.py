"""Tree verification: the tree mask, paged tree attention (vectorised == per-query reference
on chapter 01's dense_attention), and — on a real little transformer — one tree-masked
forward pass == verifying every branch separately."""
import copy

import pytest
import torch

from paged_attention.block_table import build_attention_metadata
from paged_attention.reference import dense_attention
from spec_decode.distribution import chi_square_test
from spec_decode.toy_model import ToyConfig, ToyForCausalLM
from spec_decode.tree import (TreeAttentionMetadata, accepted_kv_slot_moves, chain_parents, paged_tree_attention,
                              paged_tree_attention_reference, root_to_leaf_paths, tree_attention_mask, tree_depths,
                              tree_positions, verify_tree_greedy, verify_tree_random)
from tolerances import assert_close

# The tree of the module docstring: root -> A, A'; A -> B, B'; B -> C.
PARENTS = [-1, 0, 0, 1, 1, 3]          # nodes: 0 root, 1 A, 2 A', 3 B, 4 B', 5 C


def test_mask_depths_positions_paths():
    m = tree_attention_mask(PARENTS).int()
    assert m.tolist() == [[1, 0, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0, 0],
                          [1, 0, 1, 0, 0, 0],
                          [1, 1, 0, 1, 0, 0],
                          [1, 1, 0, 0, 1, 0],
                          [1, 1, 0, 1, 0, 1]]
    assert tree_depths(PARENTS) == [0, 1, 1, 2, 2, 3]
    assert tree_positions(PARENTS, 10).tolist() == [10, 11, 11, 12, 12, 13]
    assert root_to_leaf_paths(PARENTS) == [[0, 2], [0, 1, 4], [0, 1, 3, 5]]
    assert torch.equal(tree_attention_mask(chain_parents(4)), torch.ones(5, 5, dtype=torch.bool).tril())
    for bad in ([0, 0], [-1, 1], [-1, 0, 3, 1], []):
        with pytest.raises(ValueError):
            tree_attention_mask(bad)


def paged_layout(context_lens, q_lens, num_kv_heads=2, head_dim=16, block_size=4, seed=0):
    """Random K/V for every request's context + new tokens, in shuffled blocks, NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, q_lens)]
    need = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    block_ids, i = [], 0
    for n in need:
        block_ids.append(perm[i:i + n])
        i += n
    kc = torch.full((len(perm), block_size, num_kv_heads, head_dim), float("nan"))
    vc = kc.clone()
    md = build_attention_metadata(block_ids, [0] * len(seq_lens), seq_lens, block_size)
    total = sum(seq_lens)
    kc.view(-1, num_kv_heads, head_dim)[md.slot_mapping] = torch.randn(total, num_kv_heads, head_dim, generator=g)
    vc.view(-1, num_kv_heads, head_dim)[md.slot_mapping] = torch.randn(total, num_kv_heads, head_dim, generator=g)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return kc, vc, md.block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


def test_vectorised_equals_reference_and_chain_is_causal():
    kc, vc, bt, seq_lens, qsl = paged_layout([5, 0, 9], [6, 3, 4])
    q = torch.randn(13, 4, 16)
    masks = [tree_attention_mask(PARENTS), None, tree_attention_mask([-1, 0, 0, 2])]
    ref = paged_tree_attention_reference(q, kc, vc, bt, seq_lens, qsl, masks, 0.25)
    assert not torch.isnan(ref).any()
    assert_close(paged_tree_attention(q, kc, vc, bt, seq_lens, qsl, masks, 0.25), ref)
    # No context and a chain mask: exactly chapter 01's causal prefill attention.
    from spec_decode.tree import _gather
    k = _gather(kc, bt[1].tolist(), 3)
    v = _gather(vc, bt[1].tolist(), 3)
    assert_close(ref[6:9], dense_attention(q[6:9], k, v, 0.25, causal=True))


def test_bad_masks():
    kc, vc, bt, seq_lens, qsl = paged_layout([2], [3])
    with pytest.raises(ValueError, match="tree mask must be"):
        paged_tree_attention(torch.randn(3, 4, 16), kc, vc, bt, seq_lens, qsl, [torch.ones(2, 2)], 1.0)
    with pytest.raises(ValueError, match="tree masks for"):
        paged_tree_attention(torch.randn(3, 4, 16), kc, vc, bt, seq_lens, qsl, [None, None], 1.0)


BLOCK = 4


def prefill(model, prompt, num_blocks=16):
    """Run the prompt minus its last token into a fresh cache (the verified context)."""
    caches = model.make_kv_caches(num_blocks, BLOCK)
    blocks = list(range(num_blocks))
    n = len(prompt) - 1
    md = build_attention_metadata([blocks], [0], [n], BLOCK)
    with torch.no_grad():
        model(torch.tensor(prompt[:-1]), torch.arange(n), caches, md)
    return caches, blocks


def forward_tree(model, caches, blocks, ctx, tokens, parents):
    """One target pass over the tree nodes (node 0 = the last verified token at position ctx)."""
    md = build_attention_metadata([blocks], [ctx], [len(tokens)], BLOCK)
    md = TreeAttentionMetadata(**{f: getattr(md, f) for f in md.__dataclass_fields__},
                               tree_masks=(tree_attention_mask(parents),))
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), tree_positions(parents, ctx), caches, md)
    return model.compute_logits(hidden)


def forward_chain(model, caches, blocks, ctx, tokens):
    md = build_attention_metadata([blocks], [ctx], [len(tokens)], BLOCK)
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), ctx + torch.arange(len(tokens)), caches, md)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_tree_pass_equals_every_branch_separately(seed):
    model = ToyForCausalLM(ToyConfig(vocab_size=48), seed=seed)
    prompt = torch.randint(0, 48, (11,), generator=torch.Generator().manual_seed(seed)).tolist()
    ctx = len(prompt) - 1
    caches, blocks = prefill(model, prompt)
    # A tree whose first branch follows the target's own greedy choices (so it gets accepted).
    greedy, tok = [], prompt[-1]
    c2, b2 = copy.deepcopy(caches), blocks
    logits = forward_chain(model, c2, b2, ctx, [tok])
    for i in range(3):
        greedy.append(int(logits[-1].argmax()))
        logits = forward_chain(model, c2, b2, ctx, [prompt[-1]] + greedy)
    tokens = [prompt[-1], greedy[0], (greedy[0] + 1) % 48, greedy[1], (greedy[1] + 7) % 48, greedy[2]]
    tree_caches = copy.deepcopy(caches)
    tree_logits = forward_tree(model, tree_caches, blocks, ctx, tokens, PARENTS)

    best = None
    for path in root_to_leaf_paths(PARENTS):
        branch_caches = copy.deepcopy(caches)
        chain_logits = forward_chain(model, branch_caches, blocks, ctx, [tokens[i] for i in path])
        assert_close(tree_logits[path], chain_logits)                   # same logits, node by node
        n = 0
        while n + 1 < len(path) and tokens[path[n + 1]] == int(chain_logits[n].argmax()):
            n += 1
        emitted = [tokens[i] for i in path[1:n + 1]] + [int(chain_logits[n].argmax())]
        if best is None or len(emitted) > len(best[1]):
            best = (path[1:n + 1], emitted, branch_caches)

    accepted, emitted = verify_tree_greedy(tokens, PARENTS, tree_logits.argmax(-1).tolist())
    assert (accepted, emitted) == (best[0], best[1])
    assert accepted == [1, 3, 5] and emitted[:3] == greedy            # the greedy branch, all accepted

    # Move the accepted nodes' K/V to chain order: the cache then equals the branch's own.
    src, dst = accepted_kv_slot_moves(accepted, ctx, blocks, BLOCK)
    for kc, vc in tree_caches:
        for cache in (kc, vc):
            flat = cache.view(-1, *cache.shape[2:])
            flat[dst] = flat[src]
    valid = ctx + 1 + len(accepted)
    for (kc, vc), (kb, vb) in zip(tree_caches, best[2]):
        assert_close(kc.view(-1, *kc.shape[2:])[:valid], kb.view(-1, *kb.shape[2:])[:valid])
        assert_close(vc.view(-1, *vc.shape[2:])[:valid], vb.view(-1, *vb.shape[2:])[:valid])


def test_greedy_tree_worked_example():
    tokens = [7, 1, 2, 3, 4, 5]
    # argmax after root = 2 -> node 2 (A'); node 2 is a leaf -> emit argmax[2] = 9.
    assert verify_tree_greedy(tokens, PARENTS, [2, 0, 9, 0, 0, 0]) == ([2], [2, 9])
    # argmax after root = 1 -> A; after A = 3 -> B; after B = 5 -> C; after C = 8 (bonus).
    assert verify_tree_greedy(tokens, PARENTS, [1, 3, 0, 5, 0, 8]) == ([1, 3, 5], [1, 3, 5, 8])
    assert verify_tree_greedy(tokens, PARENTS, [6, 0, 0, 0, 0, 0]) == ([], [6])


def test_random_tree_verification_emits_p():
    """Three distinct candidate children of the root, q one-hot on each: the first emitted
    token is distributed as p (chi-square, 6 000 samples, significance 1e-4)."""
    V = 5
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    parents, tokens = [-1, 0, 0, 0], [0, 3, 2, 4]
    probs = torch.stack([p, torch.full((V,), 0.2), torch.full((V,), 0.2), torch.full((V,), 0.2)])
    g = torch.Generator().manual_seed(0)
    firsts = []
    for _ in range(6000):
        u = torch.rand(4, generator=g)
        inv_exp = 1 / torch.empty(V).exponential_(generator=g)
        firsts.append(verify_tree_random(tokens, parents, probs, u, inv_exp)[1][0])
    res = chi_square_test(torch.tensor(firsts)[:, None], p.double())
    assert res.p_value > 1e-4, res
