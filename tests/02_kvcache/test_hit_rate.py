"""The hit-rate experiments (benchmarks/hit_rate.py) in miniature.

What is evidence here: `test_hit_tokens_equal_an_independent_prefix_oracle` — with one request
at a time and an unbounded cache, the manager's hit tokens equal, exactly, the longest
block-aligned prefix each prompt shares with everything computed before it, found by a plain
set of token prefixes that shares no code with the manager. And under cache pressure the
eviction policies rank as the orphan analysis predicts.

What is NOT evidence: the synthetic workloads' parameters (system prompt length, document
reuse, ...) were chosen so that their hit rates land in the hit-rate table of [v1 prefix caching]; the range test only
keeps them there (a calibration check for the benchmark), it cannot show the manager is right.
"""
from collections import deque

import pytest

from kvcache.simulate import SimConfig, simulate
from kvcache.workloads import chatbot, multi_turn, rag, random_prompts, summarization


def unbounded(w, block_size=16):
    return sum(len(t.prompt) + len(t.output) for c in w.conversations for t in c) // block_size + 2 * w.num_requests + 1


def oracle_hit_tokens(workload, block_size):
    """FCFS, one request at a time (so every earlier request has finished and all of its full
    blocks — prompt and output — are computed), unbounded cache: the hit of a prompt is its
    longest prefix of whole blocks, at most num_tokens - 1 tokens, that some earlier request's
    tokens also start with. Returns (query tokens, hit tokens) over all requests."""
    seen: set[tuple[int, ...]] = set()                 # every block-aligned prefix computed so far
    queue = deque((c, 0) for c in range(len(workload.conversations)))
    queries = hits = 0
    while queue:
        c, t = queue.popleft()
        turn = workload.conversations[c][t]
        prompt = list(turn.prompt)
        k = 0
        while (k + 1) * block_size <= len(prompt) - 1 and tuple(prompt[:(k + 1) * block_size]) in seen:
            k += 1
        queries, hits = queries + len(prompt), hits + k * block_size
        tokens = prompt + list(turn.output)
        seen.update(tuple(tokens[:j * block_size]) for j in range(1, len(tokens) // block_size + 1))
        if t + 1 < len(workload.conversations[c]):
            queue.append((c, t + 1))
    return queries, hits


@pytest.mark.parametrize("make", [lambda: chatbot(num_requests=30), lambda: multi_turn(num_conversations=6),
                                  lambda: rag(num_requests=30), lambda: summarization(num_requests=30),
                                  lambda: random_prompts(num_requests=20)],
                         ids=["chatbot", "multi_turn", "rag", "summarization", "random"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_hit_tokens_equal_an_independent_prefix_oracle(make, block_size):
    w = make()
    r = simulate(w, SimConfig(num_blocks=unbounded(w, block_size), block_size=block_size, max_running=1))
    assert r.preemptions == 0 and r.evictions == 0
    assert (r.query_tokens, r.hit_tokens) == oracle_hit_tokens(w, block_size)
    assert r.hit_tokens > 0 or w.name == "random"


@pytest.mark.parametrize("make,lo,hi", [
    (lambda: chatbot(num_requests=60), 0.92, 0.97),
    (lambda: multi_turn(num_conversations=12), 0.80, 0.95),
    (lambda: rag(), 0.25, 0.40),
    (lambda: summarization(num_requests=60), 0.08, 0.15),
    (lambda: random_prompts(num_requests=40), 0.0, 0.02),
], ids=["chatbot", "multi_turn", "rag", "summarization", "random"])
def test_workloads_stay_calibrated_to_the_published_hit_rates(make, lo, hi):
    """Calibration, not evidence: the workloads were tuned to land in these ranges."""
    w = make()
    r = simulate(w, SimConfig(num_blocks=unbounded(w)))
    assert r.preemptions == 0 and r.evictions == 0
    assert lo <= r.first_admission_hit_rate <= hi
    assert r.hit_rate == r.first_admission_hit_rate           # no re-admissions without pressure
    assert r.prefill_computed_tokens == r.query_tokens - r.hit_tokens


def test_no_cache_hits_nothing_and_policies_rank_under_pressure():
    w = summarization(num_requests=60)
    nb = 200                                                   # ~10% of the unbounded size
    base = simulate(w, SimConfig(nb, enable_caching=False))
    assert base.hit_tokens == 0 and base.preemptions > 0
    vllm = simulate(w, SimConfig(nb))
    vllm_chain = simulate(w, SimConfig(nb, eviction_policy="chain_aware"))
    fwd = simulate(w, SimConfig(nb, free_order="forward", orphan_sample_every=10))
    fwd_chain = simulate(w, SimConfig(nb, free_order="forward", eviction_policy="chain_aware", orphan_sample_every=10))
    # Tail-first free already evicts leaf-first: chain awareness changes nothing.
    assert (vllm_chain.hit_tokens, vllm_chain.prefill_computed_tokens, vllm_chain.chain_reorders) == \
           (vllm.hit_tokens, vllm.prefill_computed_tokens, 0)
    # Head-first free orphans chains; chain-aware eviction repairs most of the loss.
    assert fwd.mean_orphan_fraction > 0 and fwd_chain.mean_orphan_fraction == 0
    saved = {k: base.prefill_computed_tokens - r.prefill_computed_tokens
             for k, r in (("vllm", vllm), ("fwd", fwd), ("fwd_chain", fwd_chain))}
    assert saved["vllm"] >= saved["fwd_chain"] > saved["fwd"] > 0
