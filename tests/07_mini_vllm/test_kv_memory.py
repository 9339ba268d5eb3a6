"""KV memory sizing: exact block counts from a CPU budget, the start-up report, the refusal
when one max_model_len request cannot fit, and (GPU) sizing by profiling."""
from __future__ import annotations

import sys

import pytest
import torch

from mini_vllm import SamplingParams
from mini_vllm.engine_config import GiB
from mini_vllm.kv_memory import KVCacheReport, check_enough_kv_cache_memory


def bytes_per_block(config, block_size):
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * itemsize


def test_cpu_budget_gives_exact_block_count(tiny_engine_models, make_llm, caplog):
    model_dir, _ = tiny_engine_models["llama"]
    with caplog.at_level("INFO", logger="mini_vllm.core"):
        llm = make_llm(model_dir, block_size=8, kv_cache_memory=3_000_000, max_model_len=256)
    engine = llm.llm_engine
    per_block = bytes_per_block(engine.model_config, 8)
    assert per_block == 2 * 2 * 8 * 2 * 16 * 4 == 4096             # 2 layers, 2 KV heads, head_dim 16, fp32
    report = engine.kv_cache_report
    assert report.num_blocks == 3_000_000 // 4096 == 732 == engine.engine_core.kv_cache_manager.num_blocks
    assert report.num_tokens == 732 * 8 and report.max_concurrency == pytest.approx(732 / 32)
    k, v = engine.engine_core.model_runner.kv_caches[0]
    assert k.shape == v.shape == (732, 8, 2, 16) and len(engine.engine_core.model_runner.kv_caches) == 2
    assert "732 blocks x 8 tokens = 5,856 tokens" in caplog.text and "22.88x" in caplog.text


def test_too_little_memory_for_one_request_is_refused(tiny_engine_models):
    from mini_vllm import LLM

    model_dir, _ = tiny_engine_models["llama"]
    with pytest.raises(ValueError, match=r"max_model_len=1024 .* longest request that fits is 496 tokens"):
        LLM(str(model_dir), block_size=16, kv_cache_memory=31 * 8192, max_model_len=1024)
    with pytest.raises(ValueError, match="no memory left"):
        check_enough_kv_cache_memory(0, 16, 64, 4096, 100)


def test_report_text():
    r = KVCacheReport(num_blocks=100, block_size=16, bytes_per_block=GiB // 100, max_model_len=400,
                      num_cpu_blocks=7, how="test")
    assert str(r).startswith("KV cache: 100 blocks x 16 tokens = 1,600 tokens (1.00 GiB, test)")
    assert "maximum concurrency for 400-token requests: 4.00x" in str(r) and "CPU swap tier: 7 blocks" in str(r)


def test_swap_space_sizes_the_cpu_tier(tiny_engine_models, make_llm):
    model_dir, _ = tiny_engine_models["llama"]
    llm = make_llm(model_dir, block_size=8, num_gpu_blocks_override=64, preemption_mode="swap", swap_space=0.001)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.cpu_block_pool.num_blocks == int(0.001 * GiB) // 4096 == 262


def test_profile_run_peak_step_runs_on_any_device(tiny_engine_models, make_llm):
    """profile_run (the GPU's KV sizing pass: the largest step into a throwaway cache) only runs on
    CUDA in the engine; run it here directly so a CPU machine catches it breaking. It once raised
    UnboundLocalError after a refactor renamed its cache variables, and every GPU engine failed."""
    model_dir, _ = tiny_engine_models["llama"]
    llm = make_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    runner = llm.llm_engine.engine_core.model_runner
    runner.profile_run()
    out = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3            # the engine's own cache was untouched


def test_cpu_warm_up_runs_the_largest_step_once_and_changes_nothing(tiny_engine_models, make_llm, monkeypatch):
    """cpu_warm_up runs profile_run (a forward at max_num_batched_tokens) once at start-up, into a
    throwaway cache: afterwards every block is free, nothing is prefix-cached, and greedy tokens equal
    those of an engine that did not warm up. Without the flag it does not run (engine starts in tests
    stay cheap)."""
    from mini_vllm.model_runner import ModelRunner

    model_dir, _ = tiny_engine_models["llama"]
    calls = []
    real = ModelRunner.profile_run
    monkeypatch.setattr(ModelRunner, "profile_run", lambda self: (calls.append(self.max_num_batched_tokens), real(self)))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold = make_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    assert calls == []
    expected = [o.outputs[0].token_ids for o in cold.generate(["a b c", "d e"], params)]
    warm = make_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, cpu_warm_up=True)
    assert calls == [64]
    pool = warm.llm_engine.engine_core.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks and not pool.cached_block_hash_to_block
    assert [o.outputs[0].token_ids for o in warm.generate(["a b c", "d e"], params)] == expected


def test_serve_warms_up(monkeypatch):
    """`python -m mini_vllm serve` starts its engine with cpu_warm_up (a client's first large prompt
    must not pay the one-time costs of that step size)."""
    from mini_vllm import cli
    from mini_vllm.entrypoints import api_server

    seen = {}
    monkeypatch.setattr(api_server, "run_server", lambda args, config: seen.setdefault("config", config))
    monkeypatch.setattr(sys, "argv", ["mini_vllm", "serve", "some/model"])
    cli.main()
    assert seen["config"].cpu_warm_up is True and seen["config"].model == "some/model"


@pytest.mark.gpu
def test_gpu_profiled_size(offline_engine_models):
    """On a GPU the KV budget is what gpu_memory_utilization leaves after weights + activations:
    it must not exceed that budget, and a lower utilization must give fewer blocks. (Engines are
    made and dropped here, not registered: each holds a fraction of the GPU.)"""
    import gc

    from mini_vllm import LLM

    model_dir, _ = offline_engine_models["llama"]
    sizes = []
    for util in (0.3, 0.5):
        llm = LLM(str(model_dir), device="cuda", gpu_memory_utilization=util, max_num_seqs=8, max_model_len=512)
        report = llm.llm_engine.kv_cache_report
        total = torch.cuda.mem_get_info()[1]
        assert "of" in report.how and report.kv_cache_bytes <= util * total
        assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
        llm.llm_engine.engine_core.check_invariants()
        sizes.append(report.num_blocks)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert sizes[0] < sizes[1]
