"""The cost model and decision matrix of [vLLM 2.0 part 2, §7.4.4], checked by hand-computed numbers."""
import pytest

from global_prefix_cache.cost_model import (LLAMA_7B_FP16, SMOLLM2_135M, Link, KVShape, break_even_bandwidth_Bps, decide,
                                            prefill_seconds, printed_table, transfer_seconds)


def test_bytes_per_token_and_block():
    assert LLAMA_7B_FP16.bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert LLAMA_7B_FP16.bytes_per_block == 8_388_608          # [vLLM 2.0 part 2, §7.4.3] prints "67MB" for this block
    assert SMOLLM2_135M.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080


def test_transfer_and_prefill_formulas():
    link = Link(latency_s=5e-6, bandwidth_Bps=100e9 / 8)
    # 128 tokens = 8 blocks = 67,108,864 bytes at 12.5 GB/s = 5.3687 ms, + 5 µs.
    assert transfer_seconds(128, LLAMA_7B_FP16, link) == pytest.approx(5e-6 + 67_108_864 / 12.5e9)
    assert transfer_seconds(15, LLAMA_7B_FP16, link) == pytest.approx(5e-6)    # no full block: nothing moves
    assert prefill_seconds(1024) == pytest.approx(0.512)
    shape = KVShape("tiny", 1, 1, 1, 1, block_size=1)
    assert transfer_seconds(10, shape, Link(1.0, 2.0), num_transfers=3) == pytest.approx(3 + 20 / 2)


def test_decision_matrix():
    assert decide(local_hit=True, global_hit=True, transfer_s=0, prefill_s=1) == "local"
    assert decide(local_hit=True, global_hit=False) == "local"
    assert decide(local_hit=False, global_hit=True, transfer_s=0.1, prefill_s=1.0) == "transfer"
    assert decide(local_hit=False, global_hit=True, transfer_s=2.0, prefill_s=1.0) == "prefill"   # slow link
    assert decide(local_hit=False, global_hit=False, transfer_s=0.0, prefill_s=1.0) == "prefill"


def test_break_even_bandwidth():
    # Recompute at 0.5 ms/token beats a link slower than 524,288 B / 0.5 ms = 1.05 GB/s = 8.39 Gbit/s.
    assert break_even_bandwidth_Bps(LLAMA_7B_FP16, 0.5e-3) * 8 / 1e9 == pytest.approx(8.388608)


def test_printed_table_keeps_its_conclusion_but_not_its_transfer_numbers():
    rows = printed_table()
    assert [r["tokens"] for r in rows] == [128, 1024, 8192, 32768]
    assert all(r["decision"] == "transfer" and r["prefill_ms"] == r["printed_prefill_ms"] for r in rows)
    # The source printed transfer times ~11x below what its own formula gives.
    for r in rows:
        assert 10 < r["transfer_ms"] / r["printed_transfer_ms"] < 12
