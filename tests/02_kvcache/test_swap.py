"""The CPU swap tier: swap_out / swap_in mappings (exact), failure without state change,
prefix re-use on swap-in, and the K/V surviving a round trip through real caches."""
import pytest
import torch

from kvcache import BlockSpaceManager, RequestTooLargeError, SimpleRequest
from kvcache.cache_engine import CacheEngine, KVCacheSpec


def prefilled(m, rid, tokens):
    r = SimpleRequest(rid, tokens)
    hit, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens) - n, n, hit) is not None
    r.num_computed_tokens = len(tokens)
    m.cache_blocks(r, r.num_computed_tokens)
    return r


def queue_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_swap_out_moves_computed_blocks_and_frees_device_blocks_tail_first():
    m = BlockSpaceManager(8, 4, num_cpu_blocks=4)
    r = prefilled(m, "r", list(range(10)))             # blocks [0, 1, 2]
    m.allocate_slots(r, 0, num_lookahead_tokens=6)     # a pre-allocated, still empty block 3
    assert m.get_block_ids("r") == [0, 1, 2, 3]
    assert m.swap_out(r) == [(0, 0), (1, 1), (2, 2)]   # the empty block is just freed
    assert queue_ids(m) == [4, 5, 6, 7, 3, 2, 1, 0] and m.num_free_cpu_blocks == 1
    with pytest.raises(ValueError, match="swapped out: it has no device blocks"):
        m.get_block_ids("r")
    with pytest.raises(ValueError, match="swap_in\\(\\) it before allocating"):
        m.allocate_slots(r, 1)
    m.check_invariants()


def test_swap_in_reuses_blocks_still_cached_on_the_device():
    m = BlockSpaceManager(8, 4, num_cpu_blocks=4)
    prefilled(m, "q", [7, 7, 7])                       # holds block 0
    r = prefilled(m, "r", list(range(10)))             # blocks [1, 2, 3]; 1 and 2 cached
    assert m.swap_out(r) == [(1, 0), (2, 1), (3, 2)]
    assert queue_ids(m) == [4, 5, 6, 7, 3, 2, 1]
    x = prefilled(m, "x", list(range(100, 122)))       # pops 4, 5, 6, 7, 3, 2: evicts r's 2nd block
    m.free(x)
    assert queue_ids(m) == [1, 2, 3, 7, 6, 5, 4]
    # r's first block is still cached on the device (block 1): touched, not copied back.
    assert m.swap_in(r) == [(1, 2), (2, 3)]
    assert m.get_block_ids("r") == [1, 2, 3] and m.num_free_cpu_blocks == 4
    assert m.num_cached_block["r"] == 1                # the copied-back block is not cached before it lands...
    m.cache_blocks(r, r.num_computed_tokens)           # ... the step ran (the swap-in copy came first)
    assert m.num_cached_block["r"] == 2
    assert m.stats.evictions == 2                      # r's 2nd block, then x's block 3
    m.check_invariants()


def test_swap_failures_change_nothing():
    m = BlockSpaceManager(4, 4, num_cpu_blocks=2)
    r = prefilled(m, "r", list(range(12)))             # 3 blocks, CPU tier holds 2
    with pytest.raises(RequestTooLargeError, match="needs 3 CPU blocks, the tier has 2"):
        m.swap_out(r)
    m2 = BlockSpaceManager(4, 4, num_cpu_blocks=3, enable_caching=False)
    a = prefilled(m2, "a", list(range(6)))
    b = prefilled(m2, "b", list(range(50, 56)))
    assert m2.swap_out(a) == [(0, 0), (1, 1)]
    assert m2.swap_out(b) is None                      # only 1 CPU block left
    assert m2.get_block_ids("b") == [2, 3]
    prefilled(m2, "c", list(range(60, 66)))            # takes the device blocks a left
    assert m2.swap_in(a) is None                       # and now a does not fit back
    assert "a" in m2.swapped_out and m2.num_free_cpu_blocks == 1
    m2.free(b)
    assert m2.swap_in(a) == [(0, 3), (1, 2)]
    m2.check_invariants()


def test_free_of_a_swapped_request_releases_its_cpu_blocks():
    m = BlockSpaceManager(8, 4, num_cpu_blocks=4)
    r = prefilled(m, "r", list(range(10)))
    m.swap_out(r)
    m.free(r)
    assert m.num_free_cpu_blocks == 4 and "r" not in m.swapped_out
    with pytest.raises(ValueError, match="not swapped out"):
        m.swap_in(r)
    with pytest.raises(ValueError, match="no CPU swap tier"):
        BlockSpaceManager(8, 4).swap_out(r)
    m.check_invariants()


def test_swap_in_needs_the_same_computed_tokens():
    m = BlockSpaceManager(8, 4, num_cpu_blocks=4)
    r = prefilled(m, "r", list(range(10)))
    m.swap_out(r)
    r.num_computed_tokens = 0
    with pytest.raises(ValueError, match="swapped out at 10 computed tokens, now says 0"):
        m.swap_in(r)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_survives_a_swap_round_trip(backend):
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    eng = CacheEngine(spec, num_gpu_blocks=6, num_cpu_blocks=6, backend=backend)
    assert eng.pinned is False                         # no CUDA here: ordinary memory, and it says so
    m = BlockSpaceManager(6, 4, num_cpu_blocks=6)
    r = prefilled(m, "r", list(range(10)))
    g = torch.Generator().manual_seed(0)
    for c in eng.key_caches + eng.value_caches:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    ids = m.get_block_ids("r")
    expect = [c[ids].clone() for c in eng.key_caches + eng.value_caches]
    eng.execute(blocks_to_swap_out=m.swap_out(r))
    other = prefilled(m, "other", list(range(100, 124)))   # takes (and overwrites) every device block
    for c in eng.key_caches + eng.value_caches:
        c.fill_(float("nan"))
    m.free(other)
    eng.execute(blocks_to_swap_in=m.swap_in(r))
    ids = m.get_block_ids("r")
    for got, want in zip([c[ids] for c in eng.key_caches + eng.value_caches], expect):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_pin_memory_without_cuda_warns_and_falls_back():
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU fallback")
    spec = KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=1, head_dim=4)
    with pytest.warns(UserWarning, match="pinned memory needs CUDA"):
        eng = CacheEngine(spec, 2, 2, pin_memory=True)
    assert eng.pinned is False and not eng.cpu_key_caches[0].is_pinned()
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=0, head_dim=4)
    assert spec.bytes_per_block == 2 * 1 * 4 * 1 * 4 * 2
