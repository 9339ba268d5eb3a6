"""What the context-independent / context-dependent split saves, measured along a real document.

xgrammar's claim (Dong et al. 2024, §3.1 "adaptive token mask cache") is that for almost every token
the answer is known from the rule the stack's top frame is in, precomputed once per grammar; only a
small remainder needs the full stack at run time. This script measures that claim for our PDA, with
SmolLM2's 49,152-token vocabulary and JSON_GRAMMAR, along the tokenization of a sample document:

  * the share of the vocabulary decided from the precomputed classes at each step (1 - walked / V,
    where `walked` is the dependent tokens run through the full PDA at that step);
  * the time of one mask with the plain trie walk and with the split (classes already computed,
    both with the PDA's step table warm), and the one-time cost of computing the classes.

    python -m structured_output.split_savings
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from structured_output.pda import DEAD
from structured_output.token_mask import TokenMasker

SAMPLE_DOCUMENT = ('{"id": 4172, "name": "Ada Lovelace", "born": 1815, "languages": ["English", "French"], '
                   '"notes": "Wrote the first published algorithm for Babbage\'s Analytical Engine.", '
                   '"ratio": -0.25e-3, "active": false, "address": {"city": "London", "zip": null}}')


@dataclass
class SplitReport:
    vocab_size: int
    steps: int
    independent_share_mean: float      # share of the vocabulary decided by the precomputed classes
    independent_share_min: float
    walked_mean: float                 # dependent tokens walked through the full PDA per step
    stacks_mean: float
    plain_ms: float                    # mean time of one mask, plain trie walk
    split_ms: float                    # mean time of one mask, split (classes precomputed)
    precompute_s: float                # computing the classes of every node the document visits
    nodes_classified: int
    nodes_total: int
    precompute_all_s: float            # ... and of every node (xgrammar's compile-time choice)

    def __str__(self) -> str:
        return (f"{self.steps} steps, vocabulary {self.vocab_size}: decided without the stack "
                f"{100 * self.independent_share_mean:.2f}% of tokens on average (worst step "
                f"{100 * self.independent_share_min:.2f}%), {self.walked_mean:.0f} tokens walked per step, "
                f"{self.stacks_mean:.1f} stacks per state\n"
                f"mask per step: plain trie walk {self.plain_ms:.2f} ms, split {self.split_ms:.2f} ms "
                f"({self.plain_ms / max(self.split_ms, 1e-9):.0f}x)\n"
                f"one-time classes: {self.nodes_classified} of {self.nodes_total} automaton nodes, "
                f"{self.precompute_s:.2f} s (all {self.nodes_total}: {self.precompute_all_s:.2f} s)")


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_split(masker: TokenMasker, token_ids: list[int], repeats: int = 2) -> SplitReport:
    """Walk `token_ids` (which the grammar must accept) and measure both masks before each token."""
    pda = masker.pda
    states, state = [], pda.start
    for t in token_ids:
        states.append(state)
        state = pda.advance(state, masker.token_bytes[t])
        if state == DEAD:
            raise ValueError(f"token {t} ({masker.token_bytes[t]!r}) is not allowed here")
    t0 = time.perf_counter()
    for st in states:                                         # the one-time part: classes per node
        for s in pda.stacks(st):
            if pda.nodes[pda.top[s]].edges:
                masker.classify(pda.top[s])
    precompute = time.perf_counter() - t0
    plain, split, walked, stacks = [], [], [], []
    for st in states:
        plain.append(_best_of(lambda: masker.plain_mask(st), repeats))
        split.append(_best_of(lambda: masker.split_mask(st), repeats))
        walked.append(masker.last_walked)
        stacks.append(len(pda.stacks(st)))
    share = 1 - np.array(walked) / masker.trie.vocab_size
    visited = len(masker._split)
    t0 = time.perf_counter()
    masker.precompute()
    precompute_all = precompute + time.perf_counter() - t0
    return SplitReport(masker.trie.vocab_size, len(states), float(share.mean()), float(share.min()),
                       float(np.mean(walked)), float(np.mean(stacks)), 1e3 * float(np.mean(plain)),
                       1e3 * float(np.mean(split)), precompute, visited,
                       sum(1 for n in pda.nodes if n.edges), precompute_all)


def main() -> None:
    from transformers import AutoTokenizer

    from mini_vllm.default_model import default_model_path
    from structured_output.grammar import JSON_GRAMMAR
    from structured_output.pda import compile_grammar
    from structured_output.vocabulary import token_bytes

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    masker = TokenMasker(compile_grammar(JSON_GRAMMAR), token_bytes(tokenizer))
    ids = tokenizer.encode(SAMPLE_DOCUMENT, add_special_tokens=False)
    print(f"SmolLM2 tokenizer, JSON_GRAMMAR, a {len(SAMPLE_DOCUMENT)}-character document in {len(ids)} tokens")
    print(measure_split(masker, ids))
    ours, builtin = _xgrammar_ms(tokenizer, ids)
    print(f"for scale, xgrammar's C++ fill_next_token_bitmask on the same steps: {ours:.3f} ms with JSON_GRAMMAR's "
          f"text, {builtin:.4f} ms with its builtin JSON grammar (written so that string tokens stay "
          "context-independent)")


def _xgrammar_ms(tokenizer, ids: list[int]) -> tuple[float, float]:
    import xgrammar as xgr

    from structured_output.grammar import JSON_GRAMMAR
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info)
    return (_xgrammar_mean_ms(compiler.compile_grammar(xgr.Grammar.from_ebnf(JSON_GRAMMAR)), info, ids),
            _xgrammar_mean_ms(compiler.compile_builtin_json_grammar(), info, ids))


def _xgrammar_mean_ms(compiled, info, ids: list[int]) -> float:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        times.append(_best_of(lambda: matcher.fill_next_token_bitmask(bitmask), 2))
        matcher.accept_token(t)
    return 1e3 * float(np.mean(times))


if __name__ == "__main__":
    main()
