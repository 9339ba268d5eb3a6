"""Logits processors and penalties (logits_processors.py) against independent NumPy versions of
vLLM's definitions, one row at a time; and through the Sampler (greedy fast path untouched).

How each test can fail: a penalty applied over the wrong tokens (prompt vs output), with the
wrong sign rule (repetition divides positive logits, multiplies negative ones), to the wrong
row of a mixed batch, or to padding; a bad word matched against the wrong end of the output or
not at all for a draft row; min_tokens masking after it was reached; a bias or an allow-list
leaking into rows that did not ask for it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.logits_processors import (LogitsProcessorsMetadata, OutputTokens, apply_logits_processors,
                                         apply_penalties)
from mini_vllm.sampler import Sampler, SamplingMetadata
from mini_vllm.sampling_params import SamplingParams
from sampling_oracle import numpy_vllm_row

V = 24
EOS = 2


def prepared(**kwargs) -> SamplingParams:
    p = SamplingParams(temperature=0, max_tokens=64, **kwargs)
    p.update_from_model([EOS])
    return p


class WordTokenizer:
    """Bad words as token ids: "w<id> w<id>" -> [id, id]; a leading space spells the word as id + 1
    (like a BPE tokenizer's " word" vs "word")."""

    def encode(self, text, add_special_tokens=False):
        shift = 1 if text.startswith(" ") else 0
        return [int(w[1:]) + shift for w in text.split()]


params_strategy = st.builds(
    lambda pres, freq, rep, min_tokens, bias, allowed, words: _with_words(prepared(
        presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep, min_tokens=min_tokens,
        logit_bias=bias or None, allowed_token_ids=allowed or None, stop_token_ids=[5]), words),
    st.sampled_from([0.0, 0.5, -1.5, 2.0]), st.sampled_from([0.0, 0.3, -0.7]), st.sampled_from([1.0, 1.3, 0.6]),
    st.integers(0, 4), st.dictionaries(st.integers(0, V - 1), st.floats(-5, 5), max_size=3),
    st.lists(st.integers(0, V - 1), max_size=6, unique=True),
    st.lists(st.lists(st.integers(3, 10), min_size=1, max_size=3), max_size=3))


def _with_words(p: SamplingParams, words: list[list[int]]) -> SamplingParams:
    p.bad_words = [" ".join(f"w{t}" for t in w) for w in words] or None
    p.update_from_model([EOS], WordTokenizer())
    return p


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(params_strategy, st.lists(st.integers(0, V - 1), min_size=1, max_size=6),
                          st.lists(st.integers(0, V - 1), max_size=8)), min_size=1, max_size=5),
       st.integers(0, 2**31 - 1))
def test_every_processor_equals_the_numpy_definition_row_by_row(rows, seed):
    """A mixed batch (rows with and without each processor) equals the per-row NumPy version."""
    params = [p for p, _, _ in rows]
    prompts = [pr for _, pr, _ in rows]
    outputs = [o for _, _, o in rows]
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed))
    md = LogitsProcessorsMetadata.from_params(params, prompts)
    if md is None:
        assert not any(p.uses_logits_processors for p in params)
        return
    want = [numpy_vllm_row(logits[i].numpy(), p, prompt, output) for i, (p, prompt, output) in enumerate(rows)]
    if any(np.isneginf(w).all() for w in want):          # constraints that leave nothing: an error, never token 0
        with pytest.raises(ValueError, match="mask every token"):
            apply_logits_processors(logits, md, torch.arange(len(rows)), OutputTokens.from_lists(outputs))
        return
    got = apply_logits_processors(logits, md, torch.arange(len(rows)), OutputTokens.from_lists(outputs)).numpy()
    for i, p in enumerate(params):
        np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-5, err_msg=f"row {i}: {p}")


def test_draft_rows_see_the_output_plus_the_drafts_before_them():
    """Speculative decoding: several logits rows per request (req_rows repeats it), each with its
    own output history; a bad word completed by a draft is masked only in the rows after it."""
    p = _with_words(prepared(frequency_penalty=1.0), [[7, 8]])
    md = LogitsProcessorsMetadata.from_params([p], [[1]])
    histories = [[3], [3, 7], [3, 7, 8]]                  # output, then + draft 7, then + draft 8
    logits = torch.zeros(3, V)
    got = apply_logits_processors(logits, md, torch.zeros(3, dtype=torch.int64), OutputTokens.from_lists(histories))
    assert got[1, 8] == float("-inf") and torch.isfinite(got[[0, 2], 8]).all()
    assert got[0, 7] == 0 and got[1, 7] == -1 and got[2, 8] == -1       # frequency: counts the drafts
    assert got[2, 7] == -1 and got[2, 3] == -1


def test_a_bad_word_longer_than_the_output_is_not_matched():
    p = _with_words(prepared(), [[7, 7, 8], [9]])
    md = LogitsProcessorsMetadata.from_params([p], [[7, 7]])      # the prompt does not count (vLLM)
    got = apply_logits_processors(torch.zeros(3, V), md, torch.zeros(3, dtype=torch.int64),
                                  OutputTokens.from_lists([[], [7], [7, 7]]))
    assert torch.isfinite(got[:2, 8]).all() and got[2, 8] == float("-inf")
    assert torch.isinf(got[:, 9]).all()                            # a one-token word: always masked


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, 0.0]])
    out = apply_penalties(logits, torch.tensor([[0, 1]]), torch.tensor([[3, -1]]), torch.zeros(1), torch.zeros(1),
                          torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 2.0, 0.0]]          # token 2 unseen: unchanged


def test_min_tokens_masks_stop_ids_and_eos_until_reached_even_with_ignore_eos():
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5], ignore_eos=True, max_tokens=4)
    p.update_from_model([EOS])
    md = LogitsProcessorsMetadata.from_params([p], [[1]])
    logits = torch.zeros(3, V)
    out = apply_logits_processors(logits, md, torch.zeros(3, dtype=torch.int64),
                                  OutputTokens.from_lists([[], [4], [4, 4]]))
    assert torch.isinf(out[:2, [EOS, 5]]).all() and torch.isfinite(out[2]).all()
    assert torch.isfinite(out[:, [0, 1, 3, 4, 6]]).all()


def test_the_sampler_applies_them_before_greedy_and_leaves_other_rows_alone():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1)
    plain = SamplingParams(temperature=0)
    ban_top = prepared(logit_bias={int(top[1]): -100.0})
    only = prepared(allowed_token_ids=[3, 4])
    md = SamplingMetadata.from_params([plain, ban_top, only])
    out = Sampler()(logits, md).sampled_token_ids
    assert out[0] == top[0] and out[1] != top[1] and out[1] == logits[1].topk(2).indices[1]
    assert out[2] == 3 + int(logits[2, 4] > logits[2, 3])
    assert SamplingMetadata.from_params([plain, plain]).logits_processors is None      # the fast path


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(mode):
    """raw: the model's distribution; processed: after the penalties, temperature and top-k."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    p = [prepared(logprobs=3, presence_penalty=2.0), SamplingParams(temperature=0.5, top_k=4, logprobs=3, seed=1)]
    md = SamplingMetadata.from_params(p, generators=[None, torch.Generator().manual_seed(1)])
    outputs = OutputTokens.from_lists([[int(logits[0].argmax())], []])
    lp = Sampler(logprobs_mode=mode)(logits, md, outputs).logprobs_tensors
    processed = apply_logits_processors(logits, md.logits_processors, torch.arange(2), outputs)
    expected = {"raw_logprobs": logits.log_softmax(-1), "raw_logits": logits}.get(mode)
    if expected is None:
        x = processed.clone()
        x[1] = x[1] / 0.5
        x[1, x[1] < x[1].topk(4).values[-1]] = float("-inf")
        expected = x.log_softmax(-1) if mode == "processed_logprobs" else x
    torch.testing.assert_close(lp.logprobs[:, 1:], expected.topk(3).values)
    assert lp.logprob_token_ids[:, 1:].tolist() == expected.topk(3).indices.tolist()


def test_a_row_with_nothing_left_to_sample_is_an_error_not_token_0():
    p = _with_words(prepared(allowed_token_ids=[7, 8]), [[3, 7], [3, 8]])
    md = LogitsProcessorsMetadata.from_params([p], [[1]])
    with pytest.raises(ValueError, match=r"logits rows \[0\]: .* mask every token"):
        apply_logits_processors(torch.zeros(1, V), md, torch.zeros(1, dtype=torch.int64), OutputTokens.from_lists([[3]]))
