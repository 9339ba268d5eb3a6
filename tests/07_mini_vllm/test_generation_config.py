"""generation_config: the model creator's recommended sampling parameters (generation_config.json)
are the defaults of requests that bring no SamplingParams, as vLLM's `--generation-config auto`;
explicit SamplingParams are used as given; "vllm" ignores the file; start-up says what applied."""
from __future__ import annotations

import json
import logging

import pytest

from mini_vllm import SamplingParams
from mini_vllm.engine_config import EngineConfig


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory, tiny_engine_checkpoint):
    """A tiny Llama whose generation_config.json recommends greedy with a repetition penalty."""
    path = tmp_path_factory.mktemp("recommending")
    tiny_engine_checkpoint(path, "llama", seed=5)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, top_k=20, repetition_penalty=0.5, max_new_tokens=7, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_auto_uses_the_files_recommendations_and_says_so(recommending_model, make_llm, caplog):
    with caplog.at_level(logging.WARNING, logger="mini_vllm.llm_engine"):
        llm = make_llm(recommending_model)
    assert "repetition_penalty': 0.5" in caplog.text and "max_tokens': 7" in caplog.text
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 0.5, 7)
    prompt = "Tell me about paged attention"
    implicit = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
    explicit = llm.generate(prompt, SamplingParams(temperature=0, repetition_penalty=0.5, max_tokens=7),
                            use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0].outputs[0].token_ids
    assert implicit == explicit and len(implicit) == 7
    assert plain != implicit, "the recommended penalty changed nothing: the test proves nothing"


def test_vllm_ignores_the_file(recommending_model, make_llm, caplog):
    with caplog.at_level(logging.WARNING, logger="mini_vllm.llm_engine"):
        llm = make_llm(recommending_model, generation_config="vllm")
    assert "default sampling parameters" not in caplog.text
    assert llm.get_default_sampling_params() == SamplingParams()


def test_a_directory_without_the_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json there"):
        EngineConfig(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineConfig(logprobs_mode="raw")
