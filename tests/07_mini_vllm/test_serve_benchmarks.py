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
    assert [(r["request_rate"], r["repeat"]) for r in rows] == [(4.0, 0), (4.0, 1), (16.0, 0), (16.0, 1)]
    for r in rows:
        assert r["completed"] == 8 and r["failed"] == 0
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] and 0 < r["p50_tpot_ms"] <= r["p99_tpot_ms"]
        assert r["goodput"] <= r["request_throughput"]
        # The timeline: every request, in the order sent, its TTFT within its latency.
        sent = [q[0] for q in r["requests"]]
        assert len(sent) == 8 and sent == sorted(sent) and sent[0] < 0.05
        assert all(0 < q[1] <= q[2] and q[4] >= 4 for q in r["requests"])
    summary = data["median_over_repeats"]
    assert [(s["request_rate"], s["repeats"]) for s in summary] == [(4.0, 2), (16.0, 2)]
    for s, runs in zip(summary, (rows[:2], rows[2:])):
        p99s = sorted(r["p99_ttft_ms"] for r in runs)
        assert s["p99_ttft_ms_range"] == p99s and s["p99_ttft_ms"] == round((p99s[0] + p99s[1]) / 2, 3)
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
    assert command_of(ap.parse_args(["--num-prompts", "80", "--seed", "3", "--repeats", "1"]), ap) == \
        "python -m benchmarks.bench_serve --num-prompts 80 --repeats 1 --seed 3"
    assert command_of(ap.parse_args(["--smoke"]), ap) == "python -m benchmarks.bench_serve --smoke"


def test_bench_serve_pairs_requests_across_servers():
    """The paired TTFT comparison: request i of a run against request i of the same run on the other
    server (same prompt, same offset); a failed request on either side drops the pair."""
    from benchmarks.bench_serve import paired_ttft

    def run(server, rep, ttfts):
        return dict(server=server, request_rate=2.0, repeat=rep,
                    requests=[None if t is None else [0.1 * i, t, t + 50, 16, 8] for i, t in enumerate(ttfts)])
    rows = [run("mini_vllm", 0, [100, 300, 80, None]), run("vllm", 0, [200, 200, 100, 90]),
            run("vllm", 1, [100, 100, 100]), run("mini_vllm", 1, [50, 200, 100])]
    (row,) = paired_ttft(rows, "mini_vllm", "vllm")
    # run 0: ratios 0.5, 1.5, 0.8 -> median 0.8, ours first 2 of 3; run 1: 0.5, 2.0, 1.0 -> 1.0, 1 of 3
    assert row["median_ttft_ratio_per_run"] == [0.8, 1.0]
    assert row["median_ttft_ratio"] == 0.9 and row["ours_first_fraction"] == 0.5 and row["runs"] == 2
    assert paired_ttft(rows[:1], "mini_vllm", "vllm") == []
