"""The shared-pool benchmark's quick mode: engine B loads the shared system prompt's full blocks
from the pool (hit rate = loaded / prompt tokens), gets engine C's greedy tokens (checked inside),
and reports TTFT with and without the pool."""
import json


def test_bench_global_pool_quick(tmp_path):
    from benchmarks import bench_global_pool

    result = bench_global_pool.main(["--quick", "--out-dir", str(tmp_path)])
    (layer,) = result["rows"]
    assert layer["layer"] == "scratch" and len(layer["sessions"]) == 2
    for s in layer["sessions"]:
        assert not s["failed_load"] and s["loaded_tokens"] % 16 == 0 and 0 < s["loaded_tokens"] < s["prompt_tokens"]
    assert layer["hit_rate"] == round(layer["skipped_prefill_tokens"] / layer["prompt_tokens"], 3) > 0.5
    assert layer["ttft_with_pool_s"] > 0 and layer["ttft_without_pool_s"] > 0
    assert json.loads((tmp_path / "global_pool_quick.json").read_text())["rows"][0]["layer"] == "scratch"
    assert (tmp_path / "global_pool_quick.png").exists()
