"""The paged-attention benchmark's CPU smoke mode writes its JSON and plot."""
import json
import os

import pytest


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
