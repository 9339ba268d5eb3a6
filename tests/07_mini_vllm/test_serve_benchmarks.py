"""The serving benchmarks' code paths at tiny size: bench_serve (a real `python -m mini_vllm serve`
subprocess, Poisson arrivals, the SSE client, percentiles, goodput, the plot) and
bench_engine_core_ipc (both engine modes, same tokens)."""
from __future__ import annotations

import json


def test_bench_serve_smoke(tmp_path):
    from benchmarks import bench_serve

    bench_serve.main(["--smoke", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "serve_smoke.json").read_text())
    assert (tmp_path / "serve_smoke.png").exists()
    rows = data["rows"]
    assert [r["request_rate"] for r in rows] == [4.0, 16.0]
    for r in rows:
        assert r["completed"] == 8 and r["failed"] == 0
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] and 0 < r["p50_tpot_ms"] <= r["p99_tpot_ms"]
        assert r["goodput"] <= r["request_throughput"]
    assert data["workload"]["vllm_peer"] == "skipped (--skip-vllm)"


def test_bench_engine_core_ipc_smoke(tmp_path):
    from benchmarks import bench_engine_core_ipc

    rows = bench_engine_core_ipc.main(["--smoke", "--out-dir", str(tmp_path)])
    assert (tmp_path / "engine_core_ipc_smoke.json").exists()
    assert len(rows) == 2 and all(r["same_tokens_as_in_process"] for r in rows)
    split = [r for r in rows if r["mode"] == "core process (ZMQ)"]
    assert all(r["steps"] > 0 and r["message_bytes_per_step"] > 0 and r["core_cpu_ms_per_step"] > 0 for r in split)


def test_bench_serve_records_the_command_that_reproduces_it():
    """serve.json's `command` names every flag that changed what was measured (a run of one rate of
    our server alone must not read as the full comparison), and not where the files went."""
    from benchmarks.bench_serve import build_parser, command_of

    ap = build_parser()
    assert command_of(ap.parse_args([]), ap) == "python -m benchmarks.bench_serve"
    assert command_of(ap.parse_args(["--skip-vllm", "--rates", "0.5", "--out-dir", "/somewhere"]), ap) == \
        "python -m benchmarks.bench_serve --skip-vllm --rates 0.5"
    assert command_of(ap.parse_args(["--num-prompts", "80", "--seed", "3"]), ap) == \
        "python -m benchmarks.bench_serve --num-prompts 80 --seed 3"
    assert command_of(ap.parse_args(["--smoke"]), ap) == "python -m benchmarks.bench_serve --smoke"
