"""copy_blocks / swap_blocks on a GPU: the CUDA kernels (kernels_cuda/copy_blocks.cu,
swap_blocks.cu) and native Triton against the torch oracle, bit for bit. Same code paths
as tests/02_kvcache/test_copy_swap_ops.py, with device="cuda". Run with `make test-gpu`."""
import pytest
import torch

from kvcache import BlockSpaceManager, SimpleRequest, reference
from kvcache.cache_engine import CacheEngine, KVCacheSpec
from kvcache.ops import copy_blocks, swap_blocks

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def rand_caches(n, num_blocks, shape, dtype, device, seed, offset_elems=0):
    """n caches [num_blocks, *shape]; offset_elems > 0 makes each base address unaligned."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        numel = num_blocks * shape[0] * shape[1] * shape[2]
        flat = torch.randn(numel + offset_elems, generator=g).to(dtype).to(device)
        c = flat[offset_elems:].view(num_blocks, *shape)
        c[num_blocks // 2:] = float("nan") if dtype != torch.float8_e4m3fn else 0
        out.append(c)
    return out


def as_bytes(ts):
    return [t.view(torch.uint8).cpu() for t in ts]


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,offset", [((16, 8, 128), 0), ((16, 3, 64), 0), ((1, 1, 3), 0), ((16, 8, 128), 1), ((5, 3, 7), 3)])
def test_copy_blocks_gpu(backend, dtype, shape, offset):
    keys = rand_caches(3, 64, shape, dtype, "cuda", 1, offset)
    values = rand_caches(3, 64, shape, dtype, "cuda", 2, offset)
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(64, generator=g)
    pairs = torch.stack([perm[:20], perm[20:40]], dim=1)      # 20 disjoint (src, dst) pairs
    reference.copy_blocks(ref_k, ref_v, pairs)
    copy_blocks(keys, values, pairs, backend=backend)
    torch.cuda.synchronize()
    for a, e in zip(as_bytes(keys + values), as_bytes(ref_k + ref_v)):
        assert torch.equal(a, e)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("pinned", [True, False])
def test_swap_blocks_gpu_cpu_round_trip(backend, dtype, pinned):
    if backend == "triton" and not pinned:
        pytest.skip("the zero-copy Triton path needs pinned memory (and says so: see test below)")
    gpu = rand_caches(4, 32, (16, 2, 64), dtype, "cuda", 3)
    cpu = [c.cpu() for c in rand_caches(4, 16, (16, 2, 64), dtype, "cpu", 4)]
    if pinned:
        cpu = [c.pin_memory() for c in cpu]
    ref_gpu, ref_cpu = [c.clone() for c in gpu], [c.clone() for c in cpu]
    out_pairs = [(31, 0), (2, 15), (4, 1), (0, 7)]
    reference.swap_blocks(ref_gpu, ref_cpu, reference.as_block_mapping(out_pairs))
    swap_blocks(gpu, cpu, out_pairs, backend=backend)
    torch.cuda.synchronize()
    assert all(torch.equal(a, e) for a, e in zip(as_bytes(cpu), as_bytes(ref_cpu)))
    in_pairs = [(0, 5), (15, 6), (7, 30)]
    reference.swap_blocks(ref_cpu, ref_gpu, reference.as_block_mapping(in_pairs))
    swap_blocks(cpu, gpu, in_pairs, backend=backend)
    torch.cuda.synchronize()
    assert all(torch.equal(a, e) for a, e in zip(as_bytes(gpu), as_bytes(ref_gpu)))


def test_triton_swap_refuses_pageable_memory():
    gpu = rand_caches(1, 4, (2, 1, 8), torch.float16, "cuda", 0)
    cpu = [torch.zeros(4, 2, 1, 8, dtype=torch.float16)]
    with pytest.raises(ValueError, match="pinned"):
        swap_blocks(gpu, cpu, [(0, 1)], backend="triton")


def test_cuda_swap_rejects_out_of_range_blocks_even_unchecked():
    gpu = rand_caches(1, 4, (2, 1, 8), torch.float16, "cuda", 0)
    cpu = [torch.zeros(4, 2, 1, 8, dtype=torch.float16).pin_memory()]
    with pytest.raises(RuntimeError, match="out of range"):
        swap_blocks(gpu, cpu, [(0, 9)], backend="cuda", check_values=False)


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_manager_and_cache_engine_swap_and_cow_on_gpu(backend):
    """End to end: the manager's mappings, executed on GPU caches, keep every request's K/V."""
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    eng = CacheEngine(spec, num_gpu_blocks=8, num_cpu_blocks=8, device="cuda", backend=backend)
    assert eng.pinned
    m = BlockSpaceManager(8, 4, num_cpu_blocks=8)
    r = SimpleRequest("r", list(range(10)))
    m.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    m.cache_blocks(r, 10)
    for c in eng.key_caches + eng.value_caches:
        c.copy_(torch.randn_like(c, dtype=torch.float32).to(c.dtype))
    ids = m.get_block_ids("r")
    expect = [c[ids].clone() for c in eng.key_caches + eng.value_caches]
    eng.execute(blocks_to_swap_out=m.swap_out(r))
    other = SimpleRequest("other", list(range(100, 132)))
    m.allocate_slots(other, 32)                        # takes every device block, evicting r's cached ones
    for c in eng.key_caches + eng.value_caches:        # ... and overwrites them
        c.zero_()
    m.free(other)
    mapping = m.swap_in(r)
    assert len(mapping) == 3                           # nothing left to re-use: all copied back
    eng.execute(blocks_to_swap_in=mapping)
    torch.cuda.synchronize()
    ids = m.get_block_ids("r")
    got = [c[ids] for c in eng.key_caches + eng.value_caches]
    assert all(torch.equal(a, b) for a, b in zip(got, expect))
    child = SimpleRequest("c", list(range(10)), num_computed_tokens=10)
    m.fork(r, child)
    child.append_output_token_ids(7)
    new, copies = m.append_slots(child, 1)
    eng.copy(copies)
    torch.cuda.synchronize()
    (src, dst), = copies
    assert all(torch.equal(c[src], c[dst]) for c in eng.key_caches + eng.value_caches)
