"""benchmarks/bench_kv_cache.py's code path at tiny size (--smoke): every side runs, and the blocks
a memory holds follow the stored bytes (the tiny model's head_dim is 16: 16 / (16 + 4) per-row)."""
import pytest

from benchmarks import bench_kv_cache


def test_kv_cache_benchmark_smoke():
    rows = bench_kv_cache.main(["--smoke"])
    by = {(r["dtype"], r["kv_cache_dtype"]): r for r in rows}
    assert len(rows) == 6 and all(r["output_tok_s"] > 0 for r in rows)
    assert by["float32", "fp8"]["blocks_vs_float_cache"] == pytest.approx(4.0, rel=0.01)
    assert by["bfloat16", "int8_per_token_head"]["blocks_vs_float_cache"] == pytest.approx(2 * 16 / 20, rel=0.01)
