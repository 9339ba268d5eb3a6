"""Every engine benchmark's code path at tiny size (smoke / quick modes) and the roofline's cost model."""
from __future__ import annotations

import json


def test_cpu_benchmark_smoke(tmp_path):
    from benchmarks import bench_engine

    result = bench_engine.main(["--smoke", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "engine_cpu_smoke.json").read_text())
    assert (tmp_path / "engine_cpu_smoke.png").exists()
    names = {r["name"] for r in data["rows"]}
    assert {"ours (mini_vllm)", "HF generate, static batch 4", "HF continuous batching"} <= names
    assert result["summary"]["agreement_with_best_static"] == 1.0          # greedy fp32: same tokens as HF
    # What each change bought: the engine with one change undone, same tokens (greedy), a speed.
    assert {bench_engine.PLAIN, bench_engine.ONEDNN, bench_engine.TORCH_LAYERS, bench_engine.TORCH_ATTENTION,
            bench_engine.REFERENCE_SAMPLER + bench_engine.SAMPLED_SUFFIX} <= names
    assert set(result["summary"]["ablation_agreement_with_ours"].values()) == {1.0}
    for change in ("packed_linears", "cpu_gemm_kernel_over_onednn", "fused_layer_ops", "cpu_attention_kernel", "fast_sampler"):
        assert result["summary"][f"bought_by_{change}"] > 0


def test_step_breakdown_and_gemm_benchmarks_smoke(tmp_path):
    from benchmarks import bench_cpu_gemm, engine_step_breakdown

    rows = engine_step_breakdown.main(["--smoke", "--out-dir", str(tmp_path)])
    assert [r["cpu_gemm_backend"] for r in rows] == ["auto", "onednn", "torch"]
    for r in rows:                                   # 6 requests: one prefill step, then decodes
        assert r["prefill_steps"] >= 1 and r["decode_steps"] >= 1
        assert r["prefill_tokens"] + r["decode_tokens"] >= r["decode_steps"]
        assert 0 < r["decode_attention_seconds"] < r["decode_seconds"]
    assert (tmp_path / "engine_step_breakdown_smoke.json").exists()
    gemm = bench_cpu_gemm.main(["--smoke", "--out-dir", str(tmp_path)])
    assert [r["rows"] for r in gemm["rows"]] == [1, 64]
    speedups = [v for r in gemm["rows"] for k, v in r.items() if k.endswith("layer speedup vs F.linear")]
    assert len(speedups) >= 2 and all(v > 0 for v in speedups)     # oneDNN and/or ours, at both row counts
    from benchmarks import bench_cpu_layer_ops                # (it checks both sides agree before timing)
    ops = bench_cpu_layer_ops.main(["--smoke", "--out-dir", str(tmp_path)])
    assert [r["rows"] for r in ops["rows"]] == [1, 64] and all(r["speedup"] > 0 for r in ops["rows"])


def test_cpu_malloc_benchmark_smoke(tmp_path):
    from benchmarks import bench_cpu_malloc

    result = bench_cpu_malloc.main(["--smoke", "--rounds", "1", "--out-dir", str(tmp_path)])
    assert [r["cpu_keep_freed_memory"] for r in result["rows"]] == [False, True]      # each in its own process
    assert all(r["prefill_page_faults"] >= 0 and r["decode_steps"] >= 1 for r in result["rows"])
    assert result["summary"]["identical_tokens"] and result["summary"]["speedup_total_median"] > 0
    assert (tmp_path / "cpu_malloc_smoke.json").exists()


def test_gpu_benchmark_smoke(tmp_path):
    """The GPU benchmark's code path on a tiny model: every contender in its own process, the
    decode sweep finds pure full-batch decode steps, the profile names the engine's phases."""
    from benchmarks import bench_engine_gpu

    result = bench_engine_gpu.main(["--smoke", "--no-cb", "--profile-batch", "4", "--out-dir", str(tmp_path)])
    assert (tmp_path / "engine_gpu_smoke.json").exists() and (tmp_path / "engine_gpu_smoke.png").exists()
    # ours x2, ours with async scheduling, HF static
    assert [r["status"] for r in result["throughput"]] == ["ok", "ok", "ok", "ok"]
    assert result["throughput"][2]["name"] == "ours (mini_vllm, async scheduling)"
    assert result["summary"]["async_over_sync_throughput"] > 0
    assert [r["batch_size"] for r in result["decode"]] == [1, 4]
    assert all(r["decode_step_ms"] > 0 and r["bytes_read"] > r["weight_bytes"] and r["bandwidth_limit_ms"] > 0
               for r in result["decode"])
    phases = {p["phase"] for p in result["profile"]["host_phases"]}
    assert {"schedule", "prepare_inputs", "output processing"} <= phases
    assert (tmp_path / "engine_gpu_smoke_profile.json").exists()


def test_gpu_benchmark_reports_a_failed_peer_as_failed(tmp_path):
    """A peer that fails is a FAILED row with its error, never a throughput (the H200 run of
    2026-11-27 turned a crashed HF continuous batching into 354,167 tok/s)."""
    from benchmarks import bench_engine_gpu

    run = bench_engine_gpu.run_child("hf-static", ["--smoke", "--model-dir", str(tmp_path / "missing")],
                                     tmp_path / "hf.json", timeout=300)
    assert run["status"] == "failed" and "missing" in run["error"]
    workload = bench_engine_gpu.nano_vllm_workload(4, 8, 16)
    runs = {"ours": dict(status="ok", full=2.0, subset=1.0), "hf-static": run,
            "hf-cb": dict(status="ok", seconds=4.0)}
    rows, summary = bench_engine_gpu.throughput_rows(runs, workload, workload[:2], 4)
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(failed) == 1 and "output_tokens_per_s" not in failed[0] and failed[0]["error"]
    assert summary == {"ratio_vs_HF continuous batching": 4.0}


def test_roofline_step_cost_counts_causal_context_and_the_bytes_read():
    """Two decodes (contexts 10 and 5 after the step) and a 3-token prefill from scratch: the
    new tokens attend to 10 + 5 + (1 + 2 + 3) positions; K/V read = every seq_len, plus writes."""
    import torch

    from benchmarks.cpu_roofline import step_cost
    from paged_attention.metadata import AttentionMetadata

    md = AttentionMetadata(slot_mapping=torch.arange(5), block_tables=torch.zeros(3, 1, dtype=torch.int32),
                           seq_lens=torch.tensor([10, 5, 3], dtype=torch.int32),
                           query_start_loc=torch.tensor([0, 1, 2, 5], dtype=torch.int32), max_query_len=3,
                           max_seq_len=10)
    shape = dict(linear_params=100, vocab=7, hidden=4, num_layers=2, num_heads=3, num_kv_heads=1, head_dim=8,
                 bytes_per_element=4)
    flops, nbytes = step_cost(md, num_sampling_rows=3, shape=shape)
    assert flops == 2 * 100 * 5 + 2 * 7 * 4 * 3 + 4 * 3 * 8 * 21 * 2
    assert nbytes == 100 * 4 + 7 * 4 * 4 + 2 * 2 * 1 * 8 * 4 * (18 + 5)
    assert step_cost(md, num_sampling_rows=0, shape=shape)[1] == nbytes - 7 * 4 * 4   # no LM head read


def test_roofline_smoke(tmp_path):
    from benchmarks import cpu_roofline

    result = cpu_roofline.main(["--smoke", "--out-dir", str(tmp_path)])
    assert (tmp_path / "cpu_roofline_smoke.json").exists()
    assert result["machine"]["gemm_flops_per_s"]["peak"] > 0 and result["machine"]["read_bandwidth_gb_per_s"] > 0
    assert 0 < result["roofline_seconds"] and 0 < result["ours_fraction_of_roofline"] < 1


def test_roofline_counts_the_models_linear_weights(tiny_engine_models, make_llm):
    """The cost model's P_linear is every projection's weight count (HF's nn.Linear layers but
    the LM head), read from the config because the packed model no longer holds them as tensors."""
    import torch

    from benchmarks.cpu_roofline import model_shape

    model_dir, hf_model = tiny_engine_models["qwen3"]
    linear = sum(m.weight.numel() for name, m in hf_model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    assert model_shape(make_llm(model_dir))["linear_params"] == linear


def test_spec_decode_benchmark_quick(tmp_path):
    """The end-to-end speculation benchmark's plumbing on a tiny model: every drafter's greedy
    tokens equal the engine's without speculation, and the drafting statistics are reported."""
    from benchmarks import bench_spec_decode

    result = bench_spec_decode.main(["--quick", "--out-dir", str(tmp_path)])
    assert (tmp_path / "spec_decode_engine_quick.png").exists()
    rows = result["rows"]
    assert {(r["prompts"], r["method"]) for r in rows} == {(p, m) for p in ("grounded", "open")
                                                           for m in ("none", "ngram", "layer_skip")}
    assert all(r["agreement_with_none"] == 1.0 for r in rows)
    for r in rows:
        if r["method"] != "none":
            assert r["num_draft_tokens"] > 0 and 0 <= r["num_accepted_tokens"] <= r["num_draft_tokens"]
            assert 1.0 <= r["mean_acceptance_length"] <= 1 + r["config"]["num_speculative_tokens"]


def test_parallel_sampling_memory_quick(tmp_path):
    """Sharing the prompt among n samples holds fewer KV blocks than n independent requests with
    the same tokens (the benchmark asserts the tokens are identical); beams hold fewer than a
    private copy each."""
    from benchmarks import bench_parallel_sampling_memory

    result = bench_parallel_sampling_memory.main(["--quick", "--out-dir", str(tmp_path)])
    assert [r.get("n", r.get("beam_width")) for r in result["rows"]] == [2, 4, 6, 8, 2, 4, 6]
    assert [r["kind"] for r in result["rows"]] == ["parallel_sampling"] * 4 + ["beam_search"] * 3
    for r in result["rows"]:
        assert r["block_steps_shared"] < r["block_steps_unshared"] and 0 < r["memory_saving"] < 1
    assert (tmp_path / "parallel_sampling_memory_quick.json").exists()


def test_host_overhead_benchmark_smoke(tmp_path):
    """Per-phase host time of pure decode steps: every phase is found and timed, the steps
    really are full-batch decodes, and the greedy tokens are hashed for before/after checks."""
    from benchmarks import bench_host_overhead

    result = bench_host_overhead.main(["--smoke", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "host_overhead_cpu_smoke.json").read_text())
    assert [r["batch_size"] for r in data["rows"]] == [1, 8] and len(data["workload"]["load_average"]) == 3
    for row in result["rows"]:
        phases = row["phases_ms"]
        assert {"schedule", "execute_model", "  update_states", "  prepare_inputs", "  forward", "  sample",
                "update_from_output", "output processing", "graph buffer fill (CPU copy)"} <= set(phases)
        assert all(v > 0 for v in phases.values())
        assert phases["step"] >= phases["execute_model"] >= phases["  forward"]     # (each step contains them)
        assert len(row["tokens_sha1"]) == 40


def test_host_overhead_async_ab_smoke(tmp_path):
    """Async scheduling off vs on in one process: both modes timed per batch size and round, and the
    run raises unless the greedy tokens of the two engines are identical request by request."""
    from benchmarks import bench_host_overhead

    result = bench_host_overhead.main(["--async-ab", "--smoke", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "host_overhead_async_cpu_smoke.json").read_text())
    assert [r["batch_size"] for r in data["rows"]] == [1, 8] and data["workload"]["rounds"] == 2
    for row in result["rows"]:
        assert row["tokens_identical"] and len(row["per_round"]["sync"]) == len(row["per_round"]["async"]) == 2
        assert row["sync"]["step_ms"] > 0 and row["async_"]["step_ms"] > 0
        assert row["async_over_sync_step_ms"] == round(row["async_"]["step_ms"] / row["sync"]["step_ms"], 3)


def test_structured_output_benchmark_quick(tmp_path):
    """Chapter 08's mask-time plumbing on one small schema: ours, xgrammar and outlines-core each walk
    the same token path (every token allowed by its mask and accepted), cold and warm, and the
    ratio to xgrammar is reported."""
    from benchmarks import bench_structured_output

    result = bench_structured_output.main(["--quick", "--out-dir", str(tmp_path)])
    assert (tmp_path / "structured_output_quick.json").exists() and (tmp_path / "structured_output_quick.png").exists()
    [row] = result["rows"]
    assert row["part"] == "mask" and row["spec"] == "json flat" and row["path_tokens"] > 5
    for impl in ("ours", "xgrammar", "outlines"):
        assert "error" not in row[impl] and "skipped" not in row[impl], row[impl]
        assert row[impl]["per_token_median_warm_us"] > 0 and row[impl]["compile_cold_ms"] > 0
    assert result["summary"]["mask"]["ours_over_xgrammar_per_token_warm_median"]["json flat"] > 0
    assert "engine" not in result["summary"]
