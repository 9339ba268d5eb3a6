"""Bad input gets a clear exception — before anything is written — on every backend."""
import re

import pytest
import torch

from paged_attention import cuda_ops, ops
from paged_attention.synthetic import make_paged_kv, random_query

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
BACKENDS = ["reference", "torch", "triton"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def case(device):
    kv = make_paged_kv([5, 9], num_kv_heads=2, head_dim=16, block_size=4, device=device)
    q = random_query(2, 4, 16, device=device)
    return q, kv


def decode(q, kv, backend, **overrides):
    args = dict(query=q, key_cache=kv.key_cache, value_cache=kv.value_cache, block_tables=kv.block_tables,
                seq_lens=kv.seq_lens, scale=0.25)
    args.update(overrides)
    return ops.paged_decode_attention(**args, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,error,message", [
    (lambda q, kv: dict(query=q[0]), ValueError, "query must be 3-D"),
    (lambda q, kv: dict(value_cache=kv.value_cache[:, :2]), ValueError, "must both be [num_blocks, block_size"),
    (lambda q, kv: dict(query=q[..., :8]), ValueError, "head_dim mismatch"),
    (lambda q, kv: dict(query=torch.cat([q, q[:, :1]], 1)), ValueError, "multiple of num_kv_heads"),
    (lambda q, kv: dict(query=q.half()), TypeError, "dtype mismatch"),
    (lambda q, kv: dict(block_tables=kv.block_tables.float()), TypeError, "block_tables must be int32 (or int64)"),
    (lambda q, kv: dict(seq_lens=kv.seq_lens.float()), TypeError, "seq_lens must be int32 (or int64)"),
    (lambda q, kv: dict(seq_lens=kv.seq_lens[:1]), ValueError, "seq_lens must be [num_seqs=2]"),
    (lambda q, kv: dict(block_tables=kv.block_tables[:1]), ValueError, "block_tables must be [num_seqs=2"),
    (lambda q, kv: dict(seq_lens=kv.seq_lens + 4), ValueError, "longer than the blocks given"),
    (lambda q, kv: dict(seq_lens=kv.seq_lens - 6), ValueError, "seq_lens must be >= 0"),
    (lambda q, kv: dict(block_tables=kv.block_tables + 100), IndexError, "but the cache has blocks [0, 7)"),
    (lambda q, kv: dict(max_seq_len=8), ValueError, "max_seq_len=8 is smaller than the longest seq_len 9"),
])
def test_decode_rejects_bad_input(case, backend, change, error, message):
    q, kv = case
    with pytest.raises(error, match=re.escape(message)):
        decode(q, kv, backend, **change(q, kv))


def test_backend_errors(case):
    q, kv = case
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        decode(q, kv, "cudnn")
    from paged_attention import cpu_ops
    if cpu_ops.is_available():                     # the C++ kernel is wired into the dispatch
        torch.testing.assert_close(decode(q, kv, "cpu"), decode(q, kv, "reference"), rtol=1e-5, atol=1e-5)
    else:
        with pytest.raises(RuntimeError, match="backend='cpu' is unavailable here"):
            decode(q, kv, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="backend='cuda' needs an NVIDIA GPU"):
            decode(q, kv, "cuda")
        with pytest.raises(RuntimeError, match="backend='cuda' needs an NVIDIA GPU"):
            ops.reshape_and_cache(kv.keys[0], kv.values[0], kv.key_cache, kv.value_cache, torch.arange(5), backend="cuda")
    for backend in ("reference", "torch"):
        with pytest.raises(ValueError, match=f"backend '{backend}' has none"):
            decode(q, kv, backend, num_kv_splits=2)
    with pytest.raises(ValueError, match="for Triton use num_kv_splits"):
        decode(q, kv, "triton", version="v2")
    with pytest.raises(ValueError, match="for CUDA use version"):
        decode(q, kv, "cuda", num_kv_splits=2)


def test_cuda_wrapper_refuses_int64_indices_and_strided_caches(case, monkeypatch):
    """The CUDA kernels read int32 index tensors and contiguous cache rows through raw
    pointers; the wrapper refuses anything else with a clear message before any build
    (these checks run on the CPU: _load is never reached)."""
    q, kv = case
    monkeypatch.setattr(cuda_ops, "_load", lambda name: pytest.fail("must be refused before loading the kernel"))
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.25)
    with pytest.raises(TypeError, match="backend='cuda' reads block_tables as int32, got torch.int64"):
        cuda_ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables.long(), kv.seq_lens, 0.25)
    with pytest.raises(TypeError, match="reads seq_lens as int32"):
        cuda_ops.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens.long(), 0.25)
    strided = kv.key_cache.transpose(2, 3).contiguous().transpose(2, 3)     # head_dim not contiguous
    with pytest.raises(ValueError, match="key_cache's head_dim must be contiguous"):
        cuda_ops.paged_decode_attention(q, strided, kv.value_cache, *args[3:])
    with pytest.raises(ValueError, match="value_cache's head_dim must be contiguous"):
        cuda_ops.reshape_and_cache(kv.keys[0], kv.values[0], kv.key_cache, strided, torch.arange(5))


def test_cuda_config_is_checked_before_any_build():
    with pytest.raises(ValueError, match=r"head sizes \(64, 128, 256\), got 80"):
        cuda_ops.check_cuda_config(80, 16)
    with pytest.raises(ValueError, match=r"block sizes \(8, 16, 32\), got 1 \(use backend='triton'"):
        cuda_ops.check_cuda_config(128, 1)
    cuda_ops.check_cuda_config(128, 16)


def test_cuda_version_rule_matches_vllm():
    assert cuda_ops.use_v1(max_seq_len=512, num_seqs=1, num_heads=8)          # one partition
    assert not cuda_ops.use_v1(max_seq_len=4096, num_seqs=4, num_heads=32)    # 128 (seq, head) pairs: split
    assert cuda_ops.use_v1(max_seq_len=4096, num_seqs=64, num_heads=32)       # 2048 pairs fill the GPU
    assert not cuda_ops.use_v1(max_seq_len=8193, num_seqs=64, num_heads=32)   # logits no longer fit


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_write_rejects_bad_slots_and_writes_nothing(device, backend):
    kv = make_paged_kv([5], 2, 16, 4, device=device, junk=0.0, num_spare_blocks=1)   # 3 blocks x 4 = 12 slots
    before = kv.key_cache.clone()
    key, value = kv.keys[0], kv.values[0]
    with pytest.raises(IndexError, match=re.escape("slots in [-1, 12] but the cache has slots [0, 12)")):
        ops.reshape_and_cache(key, value, kv.key_cache, kv.value_cache,
                              torch.tensor([0, 1, -1, 12, 3], device=device), backend=backend)
    with pytest.raises(TypeError, match="dtype mismatch"):
        ops.reshape_and_cache(key.half(), value.half(), kv.key_cache, kv.value_cache,
                              torch.arange(5, device=device), backend=backend)
    with pytest.raises(ValueError, match="slot_mapping must be \\[num_tokens=5\\]"):
        ops.reshape_and_cache(key, value, kv.key_cache, kv.value_cache, torch.arange(4, device=device), backend=backend)
    assert torch.equal(kv.key_cache, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_rejects_bad_input(device, backend):
    kv = make_paged_kv([0], 2, 16, 4, device=device, num_spare_blocks=3)
    q = random_query(6, 4, 16, device=device)[:, :, :]                         # 6 tokens
    k = random_query(6, 2, 16, device=device)
    qsl = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    slots = torch.arange(6, device=device)
    args = (kv.key_cache, kv.value_cache)
    with pytest.raises(ValueError, match=re.escape("must run from 0 to num_tokens=6")):
        ops.paged_prefill_attention(q, k, k, *args, slots, qsl[:2], 0.25, backend=backend)
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.paged_prefill_attention(q, k, k, *args, slots, torch.tensor([0, 4, 2, 6], device=device), 0.25,
                                    backend=backend)
    with pytest.raises(IndexError, match="slot_mapping holds slots"):
        ops.paged_prefill_attention(q, k, k, *args, slots + 7, qsl, 0.25, backend=backend)
    with pytest.raises(ValueError, match="query has 5 tokens but key/value have 6"):
        ops.paged_prefill_attention(q[:5], k, k, *args, slots, qsl, 0.25, backend=backend)
