"""Tree verification (EAGLE-2, SpecInfer): several draft branches checked in ONE target pass.

Mirrors vLLM's tree attention (`vllm/v1/attention/backends/tree_attn.py`:
`TreeAttentionMetadata`, the tree bias built from `speculative_token_tree`) and the tree
proposer path of `vllm/v1/spec_decode/eagle.py` (`propose_tree`).

A chain of k drafts can only be right in one way; a TREE keeps several guesses per depth
([EAGLE-2 2024]; [vLLM 2.0 part 2, §9.2.3]):

        root (last verified token, at position P)
        ├── A (P+1)
        │   ├── B (P+2)
        │   │   └── C (P+3)
        │   └── B' (P+2)
        └── A' (P+1)

All nodes go through the target in one forward pass, laid out as ordinary new tokens of
the request (node i in cache slot P + i), with two differences from a chain:
* position of node i = P + depth(i) (siblings share a position: RoPE must see the
  sequence each node belongs to, not its index in the flat batch);
* attention mask: node i sees the whole context (< P) and, among the new tokens, only its
  ancestors and itself (`tree_attention_mask`). A chain is the tree whose mask is causal.
Then the logits at a node verify its children; the deepest accepted path wins, and its
nodes' K/V are moved to the slots a chain would have used (`accepted_kv_slot_moves`).

The attention here is built on chapter 01: `paged_tree_attention_reference` gathers the
request's K/V through its block table (`slot_mapping_for_request`) and runs chapter 01's
`dense_attention` for each query over exactly the keys it may see. The vectorised
`paged_tree_attention` does the whole request with one mask and is checked against it.
(The engine meets chapter 05's unified attention, which would need this mask as an extra
input — a later chapter's business.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from paged_attention.block_table import slot_mapping_for_request
from paged_attention.kv_quant import KVQuant, read_rows
from paged_attention.metadata import AttentionMetadata
from paged_attention.reference import dense_attention
from spec_decode.reference import race, recover_token


# ----------------------------------------------------------------------------- tree shape
def check_parents(parents: Sequence[int]) -> None:
    """parents[0] == -1 (the root: the last verified token); parents[i] in [0, i) otherwise
    (nodes listed parents-first, as a breadth- or depth-first walk gives them)."""
    if not parents or parents[0] != -1:
        raise ValueError(f"the tree must start with its root (parent -1), got parents={list(parents)}")
    for i, p in enumerate(parents[1:], 1):
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come before their children")


def chain_parents(num_drafts: int) -> list[int]:
    """A linear chain of drafts: root -> d1 -> d2 -> ... (its tree mask is the causal mask)."""
    return [-1] + list(range(num_drafts))


def tree_depths(parents: Sequence[int]) -> list[int]:
    check_parents(parents)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def tree_positions(parents: Sequence[int], root_position: int) -> torch.Tensor:   # [n] int64
    """Position of every node: the root's plus its depth."""
    return root_position + torch.tensor(tree_depths(parents), dtype=torch.int64)


def tree_attention_mask(parents: Sequence[int]) -> torch.Tensor:   # [n, n] bool: [query node, key node]
    """mask[i, j]: node i may attend to node j, i.e. j is i or one of its ancestors."""
    check_parents(parents)
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    ### BEGIN SOLUTION
    for i in range(n):
        j = i
        while j != -1:                 # walk up to the root
            mask[i, j] = True
            j = parents[j]
    ### END SOLUTION
    return mask


def root_to_leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every branch as the node indices from the root to a leaf."""
    check_parents(parents)
    has_child = set(parents[1:])
    paths = []
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        path, j = [], leaf
        while j != -1:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


@dataclass(frozen=True)
class TreeAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus, per request, the mask over its new tokens (None = causal).
    vLLM: TreeAttentionMetadata.tree_attn_bias."""
    tree_masks: tuple = field(default=())


# ----------------------------------------------------------------------------- attention
def _gather(cache: torch.Tensor, block_ids: Sequence[int], seq_len: int) -> torch.Tensor:
    """One request's first seq_len K (or V) rows through its block table: [seq_len, kvh, d]."""
    slots = torch.tensor(slot_mapping_for_request(list(block_ids), 0, seq_len, cache.shape[1]), dtype=torch.long)
    return cache.reshape(-1, *cache.shape[2:])[slots.to(cache.device)]


def _new_token_mask(q_len: int, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return torch.ones(q_len, q_len, dtype=torch.bool).tril()
    if mask.shape != (q_len, q_len):
        raise ValueError(f"tree mask must be [{q_len}, {q_len}] (one row and column per new token), "
                         f"got {tuple(mask.shape)}")
    return mask.bool().cpu()


def _requests(block_tables, seq_lens, query_start_loc, tree_masks):
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    masks = list(tree_masks) if tree_masks else [None] * len(lens)
    if len(masks) != len(lens):
        raise ValueError(f"{len(masks)} tree masks for {len(lens)} requests")
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if q_len > seq_len:
            raise ValueError(f"request {i}: {q_len} new tokens but seq_len {seq_len}")
        blocks = block_tables[i].tolist()
        yield starts[i], starts[i + 1], seq_len, seq_len - q_len, blocks, _new_token_mask(q_len, masks[i])


def paged_tree_attention_reference(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim] the new tokens, requests back to back
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (new K/V already written)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,         # [num_seqs] context + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    tree_masks: Sequence[torch.Tensor | None] | None,   # per request [q_len, q_len] bool, None = causal
    scale: float,
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    """Per query: chapter 01's dense_attention over exactly the keys it may see
    (the whole context + its own ancestors)."""
    out = torch.empty_like(query)
    for s, e, seq_len, ctx, blocks, mask in _requests(block_tables, seq_lens, query_start_loc, tree_masks):
        k = _gather(key_cache, blocks, seq_len)                                   # [seq_len, kvh, d]
        v = _gather(value_cache, blocks, seq_len)
        ### BEGIN SOLUTION
        for i in range(e - s):
            visible = torch.cat((torch.arange(ctx), ctx + mask[i].nonzero()[:, 0]))   # context + ancestors + self
            out[s + i] = dense_attention(query[s + i:s + i + 1], k[visible], v[visible], scale, causal=False)[0]
        ### END SOLUTION
    return out


def paged_tree_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, tree_masks,
                         scale, *, kv_quant: KVQuant | None = None) -> torch.Tensor:
    """Vectorised per request: its K/V gathered by whole blocks through the block table, one
    [q_len, seq_len] mask, one SDPA call (the engine verifies trees with this on every layer).
    An 8-bit cache (`kv_quant`, chapter 01's kv_quant.py) is dequantized as it is gathered."""
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1:]
    kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    masks = list(tree_masks) if tree_masks else [None] * len(lens)
    if len(masks) != len(lens):
        raise ValueError(f"{len(masks)} tree masks for {len(lens)} requests")
    for i, seq_len in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        q_len = e - s
        if q_len > seq_len:
            raise ValueError(f"request {i}: {q_len} new tokens but seq_len {seq_len}")
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        row = key_cache.shape[3]                                                    # head_dim (+ 4: a row's scale)
        k = read_rows(key_cache[blocks].reshape(-1, kv_heads, row)[:seq_len], kv_quant, "k", head_dim, query.dtype)
        v = read_rows(value_cache[blocks].reshape(-1, kv_heads, row)[:seq_len], kv_quant, "v", head_dim, query.dtype)
        # k, v: [L, kvh, d]
        mask = _new_token_mask(q_len, masks[i]).to(query.device)
        visible = torch.cat((torch.ones(q_len, seq_len - q_len, dtype=torch.bool, device=query.device), mask), 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            query[s:e].transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            attn_mask=visible, scale=scale, enable_gqa=num_heads != kv_heads)            # [H, q, d]
        out[s:e] = o.transpose(0, 1).to(query.dtype)
    return out


# ----------------------------------------------------------------------------- verification
def verify_tree_greedy(tokens: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]
                       ) -> tuple[list[int], list[int]]:
    """Greedy verification of a token tree (temperature 0).

    tokens[i]: node i's token (tokens[0], the root, is the last verified token);
    target_argmax[i]: the target's argmax at node i (what should follow node i).
    Walk from the root: while some child carries the token the target wants next, move to
    it. Returns (accepted node indices, root excluded; emitted tokens = the accepted nodes'
    tokens + the target's token after the last one — 1 .. depth + 1 tokens).
    """
    check_parents(parents)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], 1):
        children.setdefault(p, []).append(i)
    accepted, node = [], 0
    ### BEGIN SOLUTION
    while True:
        want = int(target_argmax[node])
        nxt = next((c for c in children.get(node, ()) if int(tokens[c]) == want), None)
        if nxt is None:
            return accepted, [int(tokens[a]) for a in accepted] + [want]
        accepted.append(nxt)
        node = nxt
    ### END SOLUTION


def verify_tree_random(tokens: Sequence[int], parents: Sequence[int], target_probs: torch.Tensor,
                       uniform: torch.Tensor, inv_exponential: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sampling verification of a tree whose siblings carry DISTINCT tokens and were drafted
    deterministically (top-k children, as EAGLE-2's tree): q is one-hot at each child.

    At a node with target distribution p, try its children in order: accept child c with
    probability r(c) / sum(r), where r starts as p; on rejection zero r(c) and try the next
    (the residual of a one-hot q, renormalised). If every child is rejected, emit the recovered
    token of the last rejection — chapter 04's single-draft rule (`reference.recover_token`, q
    one-hot at that child) applied to r — and stop; a node without children emits a sample of p
    (the bonus token). Each step is a single-draft rejection step on the residual, so the emitted
    token is distributed exactly as p (SpecInfer's multi-step speculative sampling with
    deterministic candidates).
    target_probs [n, V] (node i: the distribution after it), uniform [n] (one per node, used
    when that node is tested), inv_exponential [V]. Returns (accepted nodes, emitted tokens).
    """
    check_parents(parents)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], 1):
        children.setdefault(p, []).append(i)
    accepted, node = [], 0
    while True:
        residual = target_probs[node].clone()
        nxt, rejected = None, None
        for c in children.get(node, ()):
            if rejected is not None:
                residual[rejected] = 0.0                  # the residual of the children rejected so far
            tok = int(tokens[c])
            if uniform[c] * residual.sum() < residual[tok]:
                nxt = c
                break
            rejected = tok
        if nxt is None:
            last = (recover_token(residual, None, rejected, inv_exponential) if rejected is not None
                    else race(residual, inv_exponential))
            return accepted, [int(tokens[a]) for a in accepted] + [last]
        accepted.append(nxt)
        node = nxt


def accepted_kv_slot_moves(accepted_nodes: Sequence[int], root_position: int, block_ids: Sequence[int],
                           block_size: int) -> tuple[list[int], list[int]]:
    """After tree verification: node i's K/V sits in slot(root_position + i); the accepted
    node at depth d must end up where a chain would have put it, slot(root_position + d).
    Returns (src_slots, dst_slots) to copy in every layer's cache, in this order (depth
    order: dst <= src always, so moving front to back never overwrites a pending source)."""
    src, dst = [], []
    for depth, node in enumerate(accepted_nodes, 1):
        if node != depth:
            src += slot_mapping_for_request(list(block_ids), root_position + node, 1, block_size)
            dst += slot_mapping_for_request(list(block_ids), root_position + depth, 1, block_size)
    return src, dst
