"""The chapter's demo (`python -m paged_attention`) and the benchmark's CPU smoke mode run."""
import json
import os
import subprocess
import sys

import pytest


def test_demo_runs_and_reports_equality_and_waste():
    proc = subprocess.run([sys.executable, "-m", "paged_attention"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "paged decode attention vs dense attention" in proc.stdout
    err = float(proc.stdout.split("max |diff| = ")[1].split()[0])
    assert err < 1e-5
    assert "paging (vLLM)" in proc.stdout


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_benchmark_smoke_writes_json_and_plot(tmp_path):
    from benchmarks import bench_paged_attention as bench
    path = bench.main(["--smoke", "--out-dir", str(tmp_path)])
    result = json.loads(path.read_text())
    assert result["workload"]["command"].endswith("--smoke")
    backends = {r["backend"] for r in result["rows"]}
    expected = {"sdpa", "torch"} | ({"triton"} if os.environ.get("TRITON_INTERPRET") == "1" else set())
    assert backends == expected
    assert all(r["time_us"] > 0 and r["bandwidth_gbs"] > 0 for r in result["rows"])
    assert {r["dtype"] for r in result["rows"]} == {"float16", "bfloat16"}
    assert path.with_suffix(".png").stat().st_size > 0
