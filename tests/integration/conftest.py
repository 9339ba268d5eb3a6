"""Fixtures for the full-stack tests: tiny random checkpoints with SmolLM2's tokenizer, and
engines registered in engine_registry (tests/conftest.py): idle with every KV block free after each test.
For chapter 06's connector in real engines: SmolLM2 chat prompts, a reference engine, a mooncake_master."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Llama (GQA 4/2, head_dim 16) with SmolLM2's vocabulary and tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mini_vllm import default_model_path

    path = tmp_path_factory.mktemp("integration") / "tiny-llama"
    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                  initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_engine(tiny_model_dir, engine_registry):
    """make_engine(**EngineConfig fields) -> LLMEngine on the tiny model (registered)."""
    from mini_vllm import LLMEngine

    def make(**kwargs):
        kwargs = {"model": str(tiny_model_dir), "block_size": 4, "max_model_len": 256,
                  "num_gpu_blocks_override": 512, **kwargs}
        engine = LLMEngine(**kwargs)
        engine_registry.append(engine)
        return engine
    return make


# ---------------------------------------------------------------- chapter 06's connector in real engines (SmolLM2)
# The cases (kv_connector_cases.py) are shared by test_kv_connector_scratch.py and
# test_kv_connector_mooncake.py.
sys.path.append(str(pathlib.Path(__file__).parent))
from kv_connector_cases import ENGINE_KW, Prompts  # noqa: E402


@pytest.fixture(scope="session")
def prompts():
    from transformers import AutoTokenizer

    from mini_vllm import default_model_path
    return Prompts(AutoTokenizer.from_pretrained(default_model_path()))


@pytest.fixture(scope="session")
def reference(engine_registry):
    """reference(prompt_ids, max_tokens) -> greedy tokens of one SmolLM2 engine without any
    connector, recomputing everything (its prefix cache is reset before each request)."""
    from mini_vllm.engine_process import run_requests
    from mini_vllm.llm_engine import LLMEngine

    engine = LLMEngine(**ENGINE_KW)
    engine_registry.append(engine)
    counter = iter(range(10**9))

    def generate(prompt_ids, max_tokens):
        assert engine.engine_core.kv_cache_manager.reset_prefix_cache()
        result, = run_requests(engine, [{"request_id": f"ref{next(counter)}", "prompt_token_ids": prompt_ids,
                                         "max_tokens": max_tokens}])
        return result["token_ids"]
    yield generate
    engine_registry.remove(engine)


@pytest.fixture(scope="module")
def mooncake_master():
    from global_prefix_cache.mooncake_layer import MooncakeMaster
    master = MooncakeMaster()
    yield master
    master.stop()
