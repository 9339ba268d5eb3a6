"""EAGLE-2's dynamic draft tree (eagle_tree.py) on the toy target.

Oracle: every node's head row recomputed densely — the real rows, then the node's own path of
(token, parent's predicted feature) rows, causal, no cache, no tree mask — must give the
children the paged tree proposer gave it (the top_k of that row, in order); the tree is the
top `num_speculative_tokens` nodes by cumulative log-probability, closed under parents; the
head's cache is left holding only real rows (every block freed at the end)."""
import math

import pytest
import torch

from kvcache import KVCacheManager
from spec_decode.eagle import EagleConfig, EagleHead
from spec_decode.eagle_tree import DraftTree, EagleTreeProposer
from spec_decode.proposer import DraftRequest
from spec_decode.toy_model import ToyConfig, ToyForCausalLM
from paged_attention.block_table import build_attention_metadata

V, BLOCK = 40, 4
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 9, 8, 9, 3, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def tree_proposer(target, k, depth, top_k, draft_vocab=None, num_blocks=96, seed=0):
    c = target.config
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig(hidden_size=c.hidden_size, vocab_size=V, num_attention_heads=c.num_attention_heads,
                                 num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate_size=48,
                                 max_position_embeddings=512, draft_vocab_size=draft_vocab))
    if draft_vocab:
        head.d2t.copy_(torch.arange(0, 2 * draft_vocab, 2) - torch.arange(draft_vocab))   # even tokens only
    shape = (num_blocks, BLOCK, c.num_key_value_heads, c.head_dim)
    return EagleTreeProposer(head, target.model.embed_tokens, target.compute_logits,
                             (torch.full(shape, float("nan")), torch.full(shape, float("nan"))),
                             KVCacheManager(num_blocks, BLOCK, enable_caching=False), k, c.hidden_size, V,
                             tree_depth=depth, tree_top_k=top_k)


def features(target, s):
    md = build_attention_metadata([list(range(-(-len(s) // 16)))], [0], [len(s)], 16)
    with torch.no_grad():
        return target(torch.tensor(s), torch.arange(len(s)), target.make_kv_caches(-(-len(s) // 16), 16, fill=0.0), md)


def dense_node_features(proposer, tokens, feats, tree: DraftTree):
    """Each node's predicted feature, recomputed densely along its own path."""
    head, embed = proposer.head, proposer.embed_tokens
    n = len(tokens) - 1
    real_tok, real_hid = list(tokens[1:n + 1]), [feats[i] for i in range(n)]
    with torch.no_grad():
        g_root = head.forward_dense(embed(torch.tensor(real_tok))[None], torch.stack(real_hid)[None])[0, -1]
    out = {0: g_root}                                       # index in [root] + tokens -> feature its row predicts
    for i, tok in enumerate(tree.tokens, 1):
        path, j = [], i
        while j > 0:
            path.append(j)
            j = tree.parents[j]
        path.reverse()                                      # the node's ancestors, root excluded, and itself
        row_tok = real_tok + [tree.tokens[p - 1] for p in path]
        row_hid = real_hid + [out[tree.parents[p]] for p in path]
        with torch.no_grad():
            out[i] = head.forward_dense(embed(torch.tensor(row_tok))[None], torch.stack(row_hid)[None])[0, -1]
    return out


@pytest.mark.parametrize("k,depth,top_k,draft_vocab", [(8, 3, 2, None), (12, 4, 3, None), (6, 5, 2, 16),
                                                        (3, 3, 3, None)])
def test_tree_nodes_equal_dense_paths_and_rank_by_cumulative_probability(k, depth, top_k, draft_vocab):
    target = ToyForCausalLM(ToyConfig(vocab_size=V), seed=0)
    proposer = tree_proposer(target, k, depth, top_k, draft_vocab)
    seqs = [list(p) for p in PROMPTS]
    given = [0] * len(seqs)
    for step in range(3):                                   # rounds of drafting with rolled-back verification
        feats = [features(target, s) for s in seqs]
        reqs = [DraftRequest(f"r{i}", s, feats[i][given[i]:len(s) - 1], given[i]) for i, s in enumerate(seqs)]
        trees = proposer.propose_tree(reqs)
        for i, (s, tree) in enumerate(zip(seqs, trees)):
            assert 1 <= len(tree.tokens) <= k
            depth_of = [0] * len(tree.parents)
            for j in range(1, len(tree.parents)):
                depth_of[j] = depth_of[tree.parents[j]] + 1
            assert max(depth_of) <= depth
            want = dense_node_features(proposer, s, feats[i], tree)
            score = [0.0] * len(tree.parents)
            for j in range(1, len(tree.parents)):
                parent = tree.parents[j]
                ids, logp = proposer.head.draft_top_k(want[parent][None], top_k, proposer.compute_logits)
                ids, logp = ids[0].tolist(), logp[0].tolist()
                assert tree.tokens[j - 1] in ids                    # one of its parent's top_k, recomputed densely
                score[j] = score[parent] + logp[ids.index(tree.tokens[j - 1])]
                if draft_vocab:
                    assert tree.tokens[j - 1] % 2 == 0 and tree.tokens[j - 1] < 2 * draft_vocab
            siblings = {}
            for j in range(1, len(tree.parents)):
                siblings.setdefault(tree.parents[j], []).append(tree.tokens[j - 1])
            assert all(len(set(t)) == len(t) for t in siblings.values())
            # Every depth-1 candidate the tree left out scores no higher than the worst kept node.
            ids, logp = proposer.head.draft_top_k(want[0][None], top_k, proposer.compute_logits)
            kept = set(siblings.get(0, []))
            worst = min(score[1:])
            assert all(lp <= worst + 1e-5 for t, lp in zip(ids[0].tolist(), logp[0].tolist()) if t not in kept)
            # The greedy chain's first draft is the tree's best depth-1 node.
            assert tree.tokens[0] == ids[0, 0].item() or not math.isfinite(worst)
            given[i] = len(s) - 1
            s += tree.tokens[:1] + [int(torch.randint(0, V, (1,)))]
    proposer.remove_requests([f"r{i}" for i in range(len(seqs))])
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


def test_tree_bounds_and_bad_shapes():
    target = ToyForCausalLM(ToyConfig(vocab_size=V), seed=0)
    proposer = tree_proposer(target, 10, 4, 2)
    s = PROMPTS[0]
    f = features(target, s)
    capped = proposer.propose_tree([DraftRequest("a", s, f[:len(s) - 1], 0, max_num_drafts=2)])[0]
    assert len(capped.tokens) <= 10 and max(len(p) for p in _paths(capped)) <= 2      # depth <= the request's cap
    proposer.max_model_len = len(s) + 3
    near_end = proposer.propose_tree([DraftRequest("b", s, f[:len(s) - 1], 0)])[0]
    assert len(near_end.tokens) <= 3                                              # slots up to max_model_len
    assert capped.truncated(1).parents == [-1, 0]
    with pytest.raises(ValueError):
        DraftTree([5, 6], [-1, 0])
    with pytest.raises(ValueError):
        tree_proposer(target, 4, 0, 2)
    proposer.remove_requests(["a", "b"])


def _paths(tree):
    out = []
    for j in range(1, len(tree.parents)):
        path = []
        while j > 0:
            path.append(j)
            j = tree.parents[j]
        out.append(path)
    return out
