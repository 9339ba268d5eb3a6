"""SpecDecodeMetadata (which logits rows verify which drafts) and the two counters: drafts are
just more scheduled tokens for chapter 03's scheduler, and rejection rolls num_computed_tokens
back exactly as [Kwon 2025, Table 4.1] says."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvcache import KVCacheManager
from scheduler import ModelRunnerOutput, Request, SchedulerConfig
from spec_decode import (RejectionSampler, SpecDecodeMetadata, SpecSamplingMetadata, calc_spec_decode_metadata,
                         spec_decode_metadata_from_scheduler_output)
from spec_decode.metrics import SpecDecodingStats, expected_tokens_per_step
from spec_decode.scheduler import SpecDecodeScheduler


def test_vllm_worked_example():
    num_scheduled, num_draft = [4, 100, 3, 100, 2], [3, 0, 2, 0, 1]
    cu = torch.tensor(num_scheduled).cumsum(0).tolist()
    input_ids = torch.arange(1000, 1000 + cu[-1])
    md = calc_spec_decode_metadata(num_draft, cu, input_ids)
    assert md.logits_indices.tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    assert md.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert md.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    assert md.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert md.cu_num_sampled_tokens.tolist() == [4, 5, 8, 9, 11]
    assert md.draft_token_ids.tolist() == [1001, 1002, 1003, 1105, 1106, 1208]
    assert md.max_spec_len == 3


@settings(max_examples=100, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), min_size=1, max_size=8))
def test_layout_properties(reqs):
    num_draft = [d for d, _ in reqs]
    num_scheduled = [d + 1 + extra for d, extra in reqs]                 # prefill chunks: extra tokens
    cu = torch.tensor(num_scheduled).cumsum(0).tolist()
    input_ids = torch.randint(0, 50, (cu[-1],))
    md = calc_spec_decode_metadata(num_draft, cu, input_ids)
    rows = sorted(md.target_logits_indices.tolist() + md.bonus_logits_indices.tolist())
    assert rows == list(range(sum(num_draft) + len(reqs)))             # target + bonus rows partition the logits
    li = md.logits_indices.tolist()
    assert [li[b] for b in md.bonus_logits_indices.tolist()] == [c - 1 for c in cu]   # bonus = last token
    t = md.logits_indices[md.target_logits_indices.long()].long()
    assert torch.equal(md.draft_token_ids.long(), input_ids[t + 1])      # each row verifies the next input token


def test_metadata_errors():
    with pytest.raises(ValueError, match="need at least"):
        calc_spec_decode_metadata([3], [3], torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=">= 0"):
        calc_spec_decode_metadata([-1], [3], torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="not in the batch"):
        spec_decode_metadata_from_scheduler_output(["a"], {"a": 2}, {"b": [1]}, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="do not end each request"):
        spec_decode_metadata_from_scheduler_output(["a"], {"a": 3}, {"a": [5, 6]}, torch.tensor([1, 5, 7]))


def test_drafts_ride_the_two_counters():
    """This chapter's scheduler (chapter 03's + drafts) schedules drafts as tokens; the rejection sampler's output rolls
    the counters back: num_computed += Δ - L_rejected, num_tokens += L_draft - L_rejected + 1."""
    sched = SpecDecodeScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                                KVCacheManager(32, 4, enable_caching=False))
    a, b = Request("a", [1, 2, 3, 4, 5], max_tokens=20), Request("b", [6, 7, 8], max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a", "b"], [[10], [20]]))     # prefill -> first tokens
    assert (a.num_computed_tokens, a.num_tokens) == (5, 6)

    sched.update_draft_token_ids({"a": [11, 12, 13], "b": [21]})                   # proposer output
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}                              # Δ = 1 + drafts
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13], "b": [21]}
    req_ids = list(out.num_scheduled_tokens)
    input_ids = torch.tensor([10, 11, 12, 13, 20, 21])                               # last token + drafts
    md = spec_decode_metadata_from_scheduler_output(req_ids, out.num_scheduled_tokens,
                                                    out.scheduled_spec_decode_tokens, input_ids)
    assert md.num_draft_tokens == [3, 1] and md.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]

    # Target logits: "a" wants 11 then 99 (rejects 12); "b" wants 21 (accepts) — greedy.
    V = 100
    logits = torch.zeros(6, V)
    for row, tok in enumerate([11, 99, 13, 55, 21, 77]):
        logits[row, tok] = 5.0
    target = logits[md.logits_indices.long()][md.target_logits_indices.long()]
    bonus = logits[md.logits_indices.long()][md.bonus_logits_indices.long()].argmax(-1)
    sampled = RejectionSampler.parse_output(
        RejectionSampler()(md, None, target, bonus, SpecSamplingMetadata.from_lists([0.0, 0.0])), V)
    assert sampled == [[11, 99], [21, 77]]
    stats = SpecDecodingStats.new(3)
    stats.observe_step(md.num_draft_tokens, sampled)

    sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled))
    # a: Δ = 4, L_draft = 3, L_rejected = 2 -> computed 5 + 4 - 2 = 7, tokens 6 + 3 - 2 + 1 = 8
    assert (a.num_computed_tokens, a.num_tokens) == (7, 8)
    # b: Δ = 2, L_draft = 1, L_rejected = 0 -> computed 3 + 2 = 5, tokens 4 + 1 + 1 = 6
    assert (b.num_computed_tokens, b.num_tokens) == (5, 6)
    assert a.output_token_ids[-2:] == [11, 99] and b.output_token_ids[-2:] == [21, 77]
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [2, 0, 0]
    sched.check_invariants()


def test_metrics():
    s = SpecDecodingStats.new(4)
    for drafts, accepted in [(4, 4), (4, 0), (3, 2), (0, 0), (4, 1)]:
        s.observe_draft(drafts, accepted)
    assert s.num_drafts == 4 and s.num_draft_tokens == 15 and s.num_accepted_tokens == 7
    assert s.acceptance_rate == pytest.approx(7 / 15)
    assert s.mean_acceptance_length == pytest.approx(1 + 7 / 4)
    assert s.per_position_acceptance_rate == [0.75, 0.5, 0.25, 0.25]
    assert s.merge(s).num_accepted_tokens == 14
    assert "acceptance rate 0.467" in str(s)
    with pytest.raises(ValueError):
        s.observe_draft(2, 3)
    with pytest.raises(ValueError):
        SpecDecodingStats.new(0)
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
