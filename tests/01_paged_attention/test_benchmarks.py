"""The paged-attention benchmark's CPU smoke modes write their JSON (and plot)."""
import json
import os

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_benchmark_smoke_writes_json_and_plot(tmp_path):
    from benchmarks import bench_paged_attention as bench
    path = bench.main(["--smoke", "--out-dir", str(tmp_path)])
    result = json.loads(path.read_text())
    assert result["workload"]["command"].endswith("--smoke")
    backends = {r["backend"] for r in result["rows"]}
    expected = {"sdpa", "torch"} | (set(bench.TRITON_RUNGS) if INTERPRETING else set())
    assert backends == expected
    assert all(r["status"] == "ok" for r in result["rows"]), [r for r in result["rows"] if r["status"] != "ok"]
    assert all(r["time_us"] > 0 and r["bandwidth_gbs"] > 0 for r in result["rows"])
    assert {r["dtype"] for r in result["rows"]} == {"float16", "bfloat16"}
    configs = {r["backend"]: r["config"] for r in result["rows"] if r["backend"].startswith("triton")}
    if INTERPRETING:
        assert configs["triton:v1-tile16"]["tile"] == 16 and configs["triton:v1-tile16"]["version"] == "v1"
        assert configs["triton:v2"]["version"] == "v2"
    assert path.with_suffix(".png").stat().st_size > 0


def test_a_failing_rung_is_recorded_not_timed(monkeypatch):
    """A rung that raises (missing, fails to build, wrong answer) becomes a FAILED row with its
    error; the other rungs are still timed."""
    from benchmarks import bench_paged_attention as bench
    monkeypatch.setattr(bench, "rungs_for", lambda device: ["torch", "cuda:v3"])
    rows = bench.run(dict(dtypes=("float16",), batches=(1,), contexts=(8,), max_tokens=64), "cpu", 1, 0, 1)
    by = {r["backend"]: r for r in rows}
    assert by["cuda:v3"]["status"] == "FAILED" and "time_us" not in by["cuda:v3"] and by["cuda:v3"]["error"]
    assert by["torch"]["status"] == "ok" and by["torch"]["time_us"] > 0


@pytest.mark.skipif(not INTERPRETING, reason="the sweep times Triton configs: a GPU or the interpreter")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_config_sweep_smoke_writes_best_config(tmp_path):
    from benchmarks import bench_paged_attention as bench
    path = bench.main(["--smoke", "--sweep", "--out-dir", str(tmp_path)])
    result = json.loads(path.read_text())
    assert result["workload"]["command"].endswith("--smoke --sweep")
    assert result["workload"]["shapes"] == [dict(batch=b, context=c) for b, c in bench.SMOKE_CONFIG_SHAPES]
    kinds = {r["kind"] for r in result["rows"]}
    assert kinds == {"chooser", "v1-tile16", "grid"}
    assert all(r["status"] == "ok" and r["time_us"] > 0 for r in result["rows"])
    (best,) = result["best"].values()
    assert best["config"]["version"] in ("v1", "v2") and best["time_us"] == min(r["time_us"] for r in result["rows"])
    assert {"device", "torch", "date"} <= set(result["environment"])
