"""EAGLE-2's dynamic draft tree ([EAGLE-2 2024]): the head grows a tree of guesses, shaped by how
sure it is, and the target checks the whole tree in one pass (tree.py).

A chain bets on one guess per depth: one miss ends it. A tree keeps several where the head is
unsure and few where it is sure. EAGLE-2's observation: the head is calibrated — the probability
it gives a draft tracks the chance that the target agrees — so the product of probabilities
along a path (its cumulative probability) estimates the chance that the whole path is accepted,
and the tree should hold the paths with the highest such estimates. Two phases, per request:

    expand   depth 1: the top_k tokens after the last verified token (the head's row over the
             target's real features). depth d = 2..tree_depth: the top_k nodes of depth d-1 with
             the highest cumulative log-probability each get a head row — input (its token, the
             feature its parent's row predicted), position = the root's + its depth, attending to
             the real context and its own ancestors only (a tree mask over the tree rows) — and
             each one's top_k next tokens join depth d.
    rerank   of every node made, keep the `num_speculative_tokens` with the highest cumulative
             log-probability (ties: the shallower first). A child never scores above its parent,
             so every kept node's parent is kept: the result is a tree.

The head's rows for a depth are computed together with every expanded node before them (the
mask keeps branches apart), written after the request's real rows in its paged cache; like the
chain's draft rows they are overwritten once the target's real features arrive.

vLLM: `vllm/v1/spec_decode/eagle.py: EagleProposer.propose_tree` drafts a STATIC tree (its
`speculative_token_tree`: the same shape every step, verified by the tree attention backend);
the shape chosen per step from the head's confidence is EAGLE-2's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from paged_attention.block_table import build_attention_metadata
from spec_decode.eagle import EagleProposer
from spec_decode.proposer import DraftRequest
from spec_decode.tree import TreeAttentionMetadata, check_parents


@dataclass
class DraftTree:
    """tokens: the nodes' tokens, every parent before its children. parents: one more entry than
    tokens — parents[0] = -1 is the root (the last verified token), parents[i + 1] in [0, i] is
    the index of node i's parent in [root] + tokens (tree.py's convention)."""
    tokens: list[int]
    parents: list[int]

    def __post_init__(self):
        if len(self.parents) != len(self.tokens) + 1:
            raise ValueError(f"a draft tree of {len(self.tokens)} tokens needs {len(self.tokens) + 1} parents "
                             f"(the root's first), got {len(self.parents)}")
        check_parents(self.parents)

    def truncated(self, n: int) -> "DraftTree":
        """The first n nodes (parents come first, so they are a tree): the scheduler may run fewer
        drafts than were proposed."""
        return DraftTree(self.tokens[:n], self.parents[:n + 1])


class EagleTreeProposer(EagleProposer):
    """EagleProposer that drafts trees (`propose_tree`) as well as chains (`propose`).

    tree_depth: the deepest draft (tokens one verification can accept at most, plus the bonus);
    tree_top_k: branching — nodes expanded per depth and children per expanded node;
    num_speculative_tokens: the most nodes a tree keeps (the target verifies 1 + that many rows).
    """

    def __init__(self, *args, tree_depth: int, tree_top_k: int, **kwargs):
        super().__init__(*args, **kwargs)
        if tree_depth < 1 or tree_top_k < 1:
            raise ValueError(f"tree_depth and tree_top_k must be >= 1, got {tree_depth} and {tree_top_k}")
        self.tree_depth, self.tree_top_k = tree_depth, tree_top_k

    def propose_tree(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """One tree per request (no nodes where it cannot draft now). A request's own cap
        (max_num_drafts: how many tokens it may still emit, minus the bonus) bounds the depth;
        num_speculative_tokens and max_model_len bound the nodes."""
        expanded_rows = self.tree_top_k * (self.tree_depth - 1)
        b = self._prepare(requests, extra_rows=lambda budget: expanded_rows)
        trees = [DraftTree([], [-1]) for _ in requests]
        if b is None:
            return trees
        g = self._run(b.states, b.rows_tok, b.rows_hid, b.rows_start, b.offsets)         # [A, H] = g_{n-1}
        for s in b.states:
            s.num_computed_tokens = len(s.all_token_ids) - 1                             # real rows: 0 .. n-1
        for j, i in enumerate(b.active):
            num_tokens = len(requests[i].token_ids)
            max_nodes = self.num_speculative_tokens
            if self.max_model_len is not None:
                max_nodes = min(max_nodes, self.max_model_len - num_tokens)
            trees[i] = self._grow(b.states[j], b.offsets[j], g[j:j + 1], min(self.tree_depth, b.budget[j]), max_nodes)
        return trees

    def _grow(self, state, offset: int, g_root: torch.Tensor, depth: int, max_nodes: int) -> DraftTree:
        """One request's tree (the module doc's expand and rerank). g_root [1, H]: the feature the
        head predicted at the request's last real row; depth: how deep this tree may grow;
        max_nodes: how many nodes it may keep. Per node made: its token, its parent (-1: the
        root), its cumulative log-probability, its depth, and feature_in — the feature its own
        head row reads if it is expanded (what its parent's row predicted)."""
        tokens, parents, scores, depths, feature_in = [], [], [], [], []
        ### BEGIN SOLUTION
        def add_children(parent: int, feature: torch.Tensor, ids: list[int], logps: list[float]) -> list[int]:
            made = []
            for t, lp in zip(ids, logps):
                made.append(len(tokens))
                tokens.append(t)
                parents.append(parent)
                scores.append((scores[parent] if parent >= 0 else 0.0) + lp)
                depths.append(depths[parent] + 1 if parent >= 0 else 1)
                feature_in.append(feature)
            return made

        ids, logp = self.head.draft_top_k(g_root, self.tree_top_k, self.compute_logits)
        level = add_children(-1, g_root, ids[0].tolist(), logp[0].tolist())
        expanded: list[int] = []                          # nodes with a head row, in row order
        for _ in range(2, depth + 1):
            frontier = sorted(sorted(level, key=lambda n: -scores[n])[:self.tree_top_k])
            expanded += frontier
            out = self._tree_rows(state, offset, expanded, tokens, parents, depths, feature_in)[-len(frontier):]
            ids, logp = self.head.draft_top_k(out, self.tree_top_k, self.compute_logits)
            level = [c for m, node in enumerate(frontier)
                     for c in add_children(node, out[m:m + 1], ids[m].tolist(), logp[m].tolist())]
        keep = sorted(sorted(range(len(tokens)), key=lambda n: (-scores[n], depths[n], n))[:max(max_nodes, 0)])
        index = {n: m + 1 for m, n in enumerate(keep)}                 # node -> its index in [root] + kept
        ### END SOLUTION
        return DraftTree([tokens[n] for n in keep], [-1] + [index[parents[n]] if parents[n] >= 0 else 0 for n in keep])

    def _tree_rows(self, state, offset: int, expanded: list[int], tokens, parents, depths, feature_in) -> torch.Tensor:
        """The head's rows for the expanded nodes (in that order), after the request's real rows:
        row of node c = (token_c, the feature c's parent predicted), at position root + depth(c),
        seeing the real context and c's ancestors. -> predicted features [len(expanded), H]."""
        first_row = len(state.all_token_ids) - 1                        # the row of a depth-1 node
        row_of = {n: r for r, n in enumerate(expanded)}
        mask = torch.zeros(len(expanded), len(expanded), dtype=torch.bool)
        for r, n in enumerate(expanded):
            while n >= 0:                                               # itself and its ancestors
                mask[r, row_of[n]] = True
                n = parents[n]
        device = self.kv_cache[0].device
        md = build_attention_metadata([self.kv.get_block_ids(state.request_id)], [first_row], [len(expanded)],
                                      self.block_size, device=device)
        md = TreeAttentionMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)},
                                   tree_masks=(mask.to(device),))
        ids = torch.tensor([tokens[n] for n in expanded], dtype=torch.long, device=device)
        positions = offset + first_row - 1 + torch.tensor([depths[n] for n in expanded], device=device)
        with torch.no_grad():
            return self.head(self.embed_tokens(ids), torch.cat([feature_in[n] for n in expanded]), positions,
                             self.kv_cache, md)
