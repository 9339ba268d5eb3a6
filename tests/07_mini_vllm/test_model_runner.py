"""The model runner's persistent batch and one step: exact row bookkeeping, the vectorized input
preparation against the readable list version (property), which rows reach the lm_head, the
order of block moves, and failure isolation for non-finite logits."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import CachedRequestData, NewRequestData, SchedulerOutput

from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import EngineConfig
from mini_vllm.model_inputs import prepare_inputs
from mini_vllm.model_runner import ModelRunner
from mini_vllm.input_batch import CachedRequestState, InputBatch
from mini_vllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def state(req_id, prompt, blocks, computed=0, outputs=()):
    return CachedRequestState(req_id, list(prompt), GREEDY, None, list(blocks), computed, list(outputs))


def step(new=(), cached=None, num_scheduled=None, **kw) -> SchedulerOutput:
    num_scheduled = num_scheduled or {}
    return SchedulerOutput(list(new), cached or CachedRequestData(), num_scheduled, sum(num_scheduled.values()), **kw)


# ------------------------------------------------------------------------------ persistent batch
def test_rows_holes_and_condense_exact():
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_num_blocks_per_req=4)
    for i, r in enumerate("abcd"):
        assert batch.add_request(state(r, [10 * i + 1, 10 * i + 2], [i])) == i
    batch.remove_request("a")
    batch.remove_request("c")
    assert batch.req_ids == [None, "b", None, "d"]
    assert batch.add_request(state("e", [51], [9])) == 0            # the first hole is reused
    batch.condense()                                                # "d" (the last row) moves into hole 2
    assert batch.req_ids == ["e", "b", "d"]
    assert batch.req_id_to_index == {"e": 0, "b": 1, "d": 2}
    assert batch.token_ids[2, :2].tolist() == [31, 32] and batch.block_table[2, 0] == 3
    assert batch.num_tokens[:3].tolist() == [1, 2, 2]
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request(state("b", [1], [0]))


def test_batch_limits_are_errors():
    batch = InputBatch(max_num_reqs=1, max_model_len=4, max_num_blocks_per_req=1)
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add_request(state("a", [1, 2, 3, 4, 5], [0]))
    with pytest.raises(ValueError, match="blocks"):
        batch.add_request(state("a", [1], [0, 1]))
    batch.add_request(state("a", [1], [0]))
    with pytest.raises(ValueError, match="full"):
        batch.add_request(state("b", [1], [0]))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 3, 4, 16]))
def test_prepare_inputs_equals_the_list_version(data, block_size):
    """The persistent batch's vectorized prepare_inputs == model_inputs.prepare_inputs rebuilt from
    Python lists (itself tested against a per-token loop), after random holes and a condense."""
    n = data.draw(st.integers(1, 6))
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    pool = list(range(500))
    rng.shuffle(pool)
    batch = InputBatch(max_num_reqs=8, max_model_len=64, max_num_blocks_per_req=64)
    for k in range(data.draw(st.integers(0, 2))):                  # requests that leave holes behind
        batch.add_request(state(f"gone{k}", [1, 2], [pool.pop()]))
    spec = {}
    for i in range(n):
        num_tokens = data.draw(st.integers(1, 40))
        computed = data.draw(st.integers(0, num_tokens - 1))
        new = data.draw(st.integers(1, num_tokens - computed))
        tokens = [rng.randrange(1000) for _ in range(num_tokens)]
        blocks = [pool.pop() for _ in range(-(-(computed + new) // block_size))]
        split = data.draw(st.integers(1, num_tokens))              # prompt / output boundary
        batch.add_request(state(f"r{i}", tokens[:split], blocks, computed, tokens[split:]))
        spec[f"r{i}"] = (tokens, computed, new, blocks)
    for k in range(3):
        batch.remove_request(f"gone{k}")
    batch.condense()
    order = list(batch.req_ids)
    num_scheduled = np.array([spec[r][2] for r in order])
    inputs, sample_rows = batch.prepare_inputs(num_scheduled, block_size)
    ref = prepare_inputs([spec[r][0][spec[r][1]:spec[r][1] + spec[r][2]] for r in order], [spec[r][1] for r in order],
                         [spec[r][3] for r in order], block_size)
    assert torch.equal(inputs.input_ids, ref.input_ids)
    assert torch.equal(inputs.positions, ref.positions)
    md, rmd = inputs.attn_metadata, ref.attn_metadata
    for name in ("slot_mapping", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(md, name), getattr(rmd, name)), name
    assert torch.equal(md.block_tables, rmd.block_tables)
    assert (md.max_query_len, md.max_seq_len) == (rmd.max_query_len, rmd.max_seq_len)
    expected_rows = [i for i, r in enumerate(order) if spec[r][1] + spec[r][2] == len(spec[r][0])]
    assert sample_rows.tolist() == expected_rows
    assert inputs.logits_indices.tolist() == ref.logits_indices[expected_rows].tolist()


# ------------------------------------------------------------------------------ the runner
@pytest.fixture(scope="module")
def runner(tiny_engine_models):
    model_dir, _ = tiny_engine_models["llama"]
    config = EngineConfig(model=str(model_dir), block_size=4, max_num_seqs=4)
    r = ModelRunner(config, ModelConfig.from_pretrained(model_dir, max_model_len=64))
    r.initialize_kv_cache(num_blocks=32, num_cpu_blocks=8)
    return r


def fresh(runner):
    runner.requests.clear()
    for req_id in list(runner.input_batch.req_id_to_index):
        runner.input_batch.remove_request(req_id)
    runner.input_batch.condense()
    runner._sampling_metadata = None
    return runner


def test_update_states_trace(runner):
    """New -> running (new blocks appended) -> not scheduled (row freed, state kept) -> back ->
    preempted -> resumed (block table replaced, tokens from the scheduler) -> finished (forgotten)."""
    r = fresh(runner)
    a = NewRequestData("a", [11, 12, 13, 14, 15], [3, 7], 0, GREEDY)
    b = NewRequestData("b", [21, 22, 23], [1], 0, GREEDY)
    r._update_states(step([a, b], num_scheduled={"a": 5, "b": 3}))
    assert r.input_batch.req_ids == ["a", "b"]
    r.requests["a"].output_token_ids.append(16)                      # as execute_model would have sampled
    r.input_batch.append_token(0, 16)
    r._update_states(step(cached=CachedRequestData(["a"], [False], [[9]], [5]), num_scheduled={"a": 1}))
    assert r.input_batch.req_ids == ["a"] and "b" in r.requests       # b: no row this step, state kept
    assert r.input_batch.block_table[0, :3].tolist() == [3, 7, 9] and r.input_batch.num_computed_tokens[0] == 5
    r._update_states(step(cached=CachedRequestData(["b"], [False], [[]], [3]), num_scheduled={"b": 1},
                          preempted_req_ids={"a"}))
    assert r.input_batch.req_ids == ["b"] and "a" in r.requests
    resumed = CachedRequestData(["a"], [True], [[2, 4]], [0], {"a": [11, 12, 13, 14, 15, 16, 17]})
    r._update_states(step(cached=resumed, num_scheduled={"a": 7}, finished_req_ids={"b"}))
    assert r.input_batch.req_ids == ["a"] and "b" not in r.requests
    assert r.requests["a"].output_token_ids == [16, 17] and r.requests["a"].block_ids == [2, 4]
    assert r.input_batch.token_ids[0, :7].tolist() == [11, 12, 13, 14, 15, 16, 17]
    assert r.input_batch.block_table[0, :2].tolist() == [2, 4] and r.input_batch.num_blocks[0] == 2


def test_only_rows_that_reach_their_end_are_projected_to_the_vocabulary(runner, monkeypatch):
    r = fresh(runner)
    seen = []
    compute_logits = r.model.compute_logits
    monkeypatch.setattr(r.model, "compute_logits", lambda h: seen.append(h.shape[0]) or compute_logits(h))
    a = NewRequestData("a", list(range(100, 110)), [0, 1, 2], 0, GREEDY)      # a 10-token prompt, chunk of 6
    b = NewRequestData("b", [5, 6, 7], [3], 0, GREEDY)
    out = r.execute_model(step([a, b], num_scheduled={"a": 6, "b": 3}))
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids[0] == [] and len(out.sampled_token_ids[1]) == 1
    assert seen == [1]                                                   # only b's last token
    out = r.execute_model(step(cached=CachedRequestData(["a", "b"], [False, False], [[], []], [6, 3]),
                               num_scheduled={"a": 4, "b": 1}))
    assert all(len(t) == 1 for t in out.sampled_token_ids) and seen == [1, 2]
    r.execute_model(step(num_scheduled={}, finished_req_ids={"a", "b"}))
    assert not r.requests


def test_block_moves_run_before_the_forward_in_vllm_order(runner, monkeypatch):
    r = fresh(runner)
    calls = []
    for name in ("swap_out", "swap_in", "copy"):
        monkeypatch.setattr(r.cache_engine, name, lambda pairs, name=name: calls.append((name, list(pairs))))
    forward = r.model.forward
    monkeypatch.setattr(r.model, "forward", lambda *a: calls.append(("forward", None)) or forward(*a))
    a = NewRequestData("a", [1, 2, 3], [5], 0, GREEDY)
    r.execute_model(step([a], num_scheduled={"a": 3}, blocks_to_swap_out=[(1, 0)], blocks_to_swap_in=[(2, 3)],
                         blocks_to_copy=[(4, 6)]))
    assert calls == [("swap_out", [(1, 0)]), ("swap_in", [(2, 3)]), ("copy", [(4, 6)]), ("forward", None)]
    r.execute_model(step(num_scheduled={}, finished_req_ids={"a"}))


def test_swap_round_trip_moves_the_bytes(runner):
    """blocks_to_swap_out then blocks_to_swap_in bring a block's K/V back bit for bit (chapter 02's CacheEngine)."""
    r = fresh(runner)
    k, v = r.kv_caches[1]
    k[5].normal_()
    v[5].normal_()
    saved = (k[5].clone(), v[5].clone())
    r.execute_model(step(num_scheduled={}, blocks_to_swap_out=[(5, 2)]))
    k[5].zero_()
    v[5].zero_()
    r.execute_model(step(num_scheduled={}, blocks_to_swap_in=[(2, 9)]))
    assert torch.equal(k[9], saved[0]) and torch.equal(v[9], saved[1])


def test_nonfinite_logits_fail_only_their_request(runner, monkeypatch):
    r = fresh(runner)
    compute_logits = r.model.compute_logits

    def poisoned(hidden):
        logits = compute_logits(hidden)
        logits[1] = float("nan")                  # the second sampling row: request "b"
        return logits
    monkeypatch.setattr(r.model, "compute_logits", poisoned)
    reqs = [NewRequestData(x, [1, 2, 3], [i], 0, GREEDY) for i, x in enumerate("abc")]
    out = r.execute_model(step(reqs, num_scheduled={"a": 3, "b": 3, "c": 3}))
    assert list(out.failed) == ["b"] and "non-finite" in out.failed["b"]
    assert out.sampled_token_ids[1] == [] and len(out.sampled_token_ids[0]) == len(out.sampled_token_ids[2]) == 1
    assert r.requests["b"].output_token_ids == []
    r.execute_model(step(num_scheduled={}, finished_req_ids={"a", "b", "c"}))


def test_drafts_are_refused_without_a_speculative_config(runner):
    with pytest.raises(ValueError, match="no speculative_config"):
        fresh(runner).execute_model(step(num_scheduled={"a": 2}, scheduled_spec_decode_tokens={"a": [1]}))
