"""copy_blocks / swap_blocks: every backend against the torch oracle, bit for bit (a copy is
exact: compared as bytes, so NaN payloads and fp8 count too), on adversarial layouts."""
import pytest
import torch

from kvcache import reference
from kvcache.ops import BACKENDS, copy_blocks, swap_blocks

HAS_CUDA = torch.cuda.is_available()
KERNEL_BACKENDS = ["triton"] + (["cuda"] if HAS_CUDA else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def caches(n, num_blocks, block_size, heads, head_dim, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        c = torch.randn(num_blocks, block_size, heads, head_dim, generator=g)
        c[num_blocks // 2:] = float("nan")          # poison: a kernel reading the wrong block shows
        out.append(c.to(dtype).to(device))
    return out


def as_bytes(ts):
    return [t.view(torch.uint8).cpu() for t in ts]


def assert_bitwise_equal(actual, expected):
    for a, e in zip(as_bytes(actual), as_bytes(expected)):
        assert torch.equal(a, e)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,heads,head_dim", [(16, 2, 8), (1, 1, 3), (256, 1, 4), (5, 3, 7)])
def test_copy_blocks_matches_reference(backend, dtype, block_size, heads, head_dim, device):
    keys = caches(2, 8, block_size, heads, head_dim, dtype, device, seed=1)
    values = caches(2, 8, block_size, heads, head_dim, dtype, device, seed=2)
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    pairs = [(6, 1), (0, 3), (7, 2)]                # shuffled, from poisoned and clean blocks
    reference.copy_blocks(ref_k, ref_v, reference.as_block_mapping(pairs))
    copy_blocks(keys, values, pairs, backend=backend)
    assert_bitwise_equal(keys + values, ref_k + ref_v)
    assert torch.equal(as_bytes([keys[0][1]])[0], as_bytes([keys[0][6]])[0])   # it did copy
    assert not torch.equal(as_bytes([keys[0][1]])[0], as_bytes([ref_k[0][0]])[0])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=str)
def test_swap_blocks_matches_reference_both_directions(backend, dtype, device):
    if backend == "cuda" and device.type != "cuda":
        pytest.skip("cuda backend needs a GPU")
    gpu = caches(4, 10, 16, 2, 8, dtype, device, seed=3)
    pin = device.type == "cuda"
    cpu = [c.cpu().pin_memory() if pin else c.cpu() for c in caches(4, 6, 16, 2, 8, dtype, "cpu", seed=4)]
    ref_gpu, ref_cpu = [c.clone() for c in gpu], [c.clone() for c in cpu]
    out_pairs = [(9, 0), (2, 5), (4, 1)]            # (device block, cpu block)
    reference.swap_blocks(ref_gpu, ref_cpu, reference.as_block_mapping(out_pairs))
    swap_blocks(gpu, cpu, out_pairs, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert_bitwise_equal(cpu, ref_cpu)
    in_pairs = [(0, 3), (5, 7)]                     # (cpu block, device block)
    reference.swap_blocks(ref_cpu, ref_gpu, reference.as_block_mapping(in_pairs))
    swap_blocks(cpu, gpu, in_pairs, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert_bitwise_equal(gpu, ref_gpu)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_mapping_is_a_no_op(backend, device):
    if backend == "cuda" and device.type != "cuda":
        pytest.skip("cuda backend needs a GPU")
    keys, values = caches(1, 4, 2, 1, 4, torch.float32, device, 0), caches(1, 4, 2, 1, 4, torch.float32, device, 1)
    before = [t.clone() for t in keys + values]
    copy_blocks(keys, values, torch.empty(0, 2, dtype=torch.int64), backend=backend)
    assert_bitwise_equal(keys + values, before)


def test_bad_arguments_raise_clear_errors():
    k, v = caches(2, 4, 2, 1, 4, torch.float32, "cpu", 0), caches(2, 4, 2, 1, 4, torch.float32, "cpu", 1)
    with pytest.raises(ValueError, match="unknown backend 'cuda2'"):
        copy_blocks(k, v, [(0, 1)], backend="cuda2")
    with pytest.raises(ValueError, match="both a source and a destination"):
        copy_blocks(k, v, [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="appears twice"):
        copy_blocks(k, v, [(0, 1), (2, 1)])
    with pytest.raises(IndexError, match=r"destination blocks 1\.\.4 outside \[0, 4\)"):
        copy_blocks(k, v, [(0, 1), (2, 4)])
    with pytest.raises(ValueError, match=r"\[num_pairs, 2\]"):
        copy_blocks(k, v, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="2 key caches but 1 value caches"):
        copy_blocks(k, v[:1], [(0, 1)])
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(4, 2, 2, 4).transpose(1, 2)
        copy_blocks([strided], [strided.clone()], [(0, 1)])
    with pytest.raises(ValueError, match="share shape"):
        copy_blocks([k[0], k[1][:3]], v, [(0, 1)])
    with pytest.raises(ValueError, match="blocks differ"):
        swap_blocks(k, [torch.zeros(4, 2, 1, 8)] * 2, [(0, 1)])
    with pytest.raises(IndexError, match="source blocks"):
        swap_blocks(k, [torch.zeros(9, 2, 1, 4) for _ in range(2)], [(7, 1)])
    before = [t.clone() for t in k + v]
    for bad in ([(0, 1), (1, 2)], [(0, 1), (2, 1)]):       # nothing was half-done
        with pytest.raises(ValueError):
            copy_blocks(k, v, bad, backend="triton")
    assert_bitwise_equal(k + v, before)


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error")
def test_cuda_backend_without_gpu_says_so():
    k, v = caches(1, 4, 2, 1, 4, torch.float32, "cpu", 0), caches(1, 4, 2, 1, 4, torch.float32, "cpu", 1)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        copy_blocks(k, v, [(0, 1)], backend="cuda")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        swap_blocks(k, k, [(0, 1)], backend="cuda")
