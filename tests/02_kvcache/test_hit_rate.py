"""The hit-rate experiments (benchmarks/hit_rate.py) in miniature: the synthetic workloads
reproduce seed 001's hit-rate ranges with an unbounded cache, and under cache pressure the
eviction policies rank as the orphan analysis predicts."""
import pytest

from kvcache.simulate import SimConfig, simulate
from kvcache.workloads import chatbot, multi_turn, rag, random_prompts, summarization


def unbounded(w, block_size=16):
    return sum(len(t.prompt) + len(t.output) for c in w.conversations for t in c) // block_size + 2 * w.num_requests + 1


@pytest.mark.parametrize("make,lo,hi", [
    (lambda: chatbot(num_requests=60), 0.92, 0.97),
    (lambda: multi_turn(num_conversations=12), 0.80, 0.95),
    (lambda: rag(), 0.25, 0.40),
    (lambda: summarization(num_requests=60), 0.08, 0.15),
    (lambda: random_prompts(num_requests=40), 0.0, 0.02),
], ids=["chatbot", "multi_turn", "rag", "summarization", "random"])
def test_unbounded_cache_hit_rates_match_seed_001_table(make, lo, hi):
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
