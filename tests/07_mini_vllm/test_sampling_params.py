"""SamplingParams validation: every bad value fails at construction with a message naming it."""
from __future__ import annotations

import pytest

from mini_vllm.sampling_params import SamplingParams, SamplingType


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.8).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0, seed=3).sampling_type == SamplingType.GREEDY


def test_greedy_resets_filters():
    p = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert (p.top_k, p.top_p, p.min_p) == (-1, 1.0, 0.0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature="hot"), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), "top_k must be -1 \\(disabled\\) or an integer >= 1, got 0"),
    (dict(top_k=-2), "top_k must be -1"),
    (dict(top_k=2.5), "top_k must be -1"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.01), r"min_p must be in \[0, 1\]"),
    (dict(seed=1.5), "seed must be an integer or None"),
    (dict(seed=True), "seed must be an integer or None"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=None), "max_tokens must be an integer >= 1"),
    (dict(logprobs=-2), r"logprobs must be None, -1 \(the whole vocabulary\) or an integer >= 0, got -2"),
    (dict(logprobs=1.5), r"logprobs must be None, -1"),
    (dict(stop=[""]), "stop strings must be non-empty"),
    (dict(stop=["a", 3]), "stop must be a string or a list of strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of non-negative integers"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of non-negative integers"),
    (dict(ignore_eos="yes"), "ignore_eos must be a bool"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty="high"), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0), r"repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a finite number > 0"),
    (dict(min_tokens=17), r"min_tokens must be an integer in \[0, max_tokens=16\], got 17"),
    (dict(min_tokens=-1), r"min_tokens must be an integer in \[0, max_tokens=16\]"),
    (dict(logit_bias={"3": 1.0}), r"logit_bias must be a dict \{token id \(int\): finite bias\}"),
    (dict(logit_bias={3: float("nan")}), r"logit_bias must be a dict"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(bad_words=["ok", " "]), "bad_words must be a list of non-empty strings"),
    (dict(bad_words="word"), "bad_words must be a list of non-empty strings"),
])
def test_invalid_values_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_words_are_tokenized_as_vllm_does():
    """Each word as written, and after a space when that spells a different word of the same length."""
    class Tok:
        vocab = {"Paris": [10], " Paris": [11], "New York": [20, 21], " New York": [22, 21], "ab": [30, 31],
                 " ab": [32]}

        def encode(self, text, add_special_tokens=False):
            return self.vocab[text]

    p = SamplingParams(bad_words=["Paris", " New York", "ab"], stop_token_ids=[5])
    p.update_from_model([2], Tok())
    assert p._bad_words_token_ids == ((10,), (11,), (20, 21), (22, 21), (30, 31))     # " ab" is 1 token: left out
    assert p._all_stop_token_ids == {2, 5}
    assert p.uses_logits_processors and not SamplingParams().uses_logits_processors
