"""reshape_and_cache: every backend writes exactly the right rows, bit for bit, and nothing else."""
import pytest
import torch

from paged_attention import cpu_ops, ops

# triton runs under the interpreter on CPU; "cpu" is the C++ row copy (built on first use)
CPU_BACKENDS = ["torch", "triton",
                pytest.param("cpu", marks=pytest.mark.skipif(not cpu_ops.is_available(),
                                                             reason=f"{cpu_ops.unavailable_reason()}"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Compare floats bit for bit (NaN == NaN, -0 != +0)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def expected_cache(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: list[int]) -> torch.Tensor:
    """The oracle: a loop over tokens, slot -> (block, offset)."""
    out = cache.clone()
    block_size = cache.shape[1]
    for t, slot in enumerate(slot_mapping):
        if slot >= 0:
            out[slot // block_size, slot % block_size] = rows[t]
    return out


def make_case(dtype, device, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)          # junk everywhere at first
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    # 7 new tokens: a padding token (-1), slots spread over shuffled blocks, partial blocks.
    slot_mapping = [9, 10, -1, 0, 23, 3, 17]
    key = torch.randn(len(slot_mapping), num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(len(slot_mapping), num_kv_heads, head_dim, generator=g).to(dtype)
    return [x.to(device) for x in (key, value, key_cache, value_cache)] + [slot_mapping]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_writes_exact_rows_and_nothing_else(backend, dtype, slot_dtype):
    key, value, key_cache, value_cache, slots = make_case(dtype, "cpu")
    want_k = expected_cache(key_cache, key, slots)
    want_v = expected_cache(value_cache, value, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(slots, dtype=slot_dtype), backend=backend)
    assert torch.equal(bits(key_cache), bits(want_k))
    assert torch.equal(bits(value_cache), bits(want_v))
    assert int(torch.isnan(key_cache.float()).logical_not().all(-1).all(-1).sum()) == 6   # exactly 6 rows written


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_strided_key_value_views(backend):
    """K and V usually arrive as views into one fused qkv projection output (vLLM passes their
    strides to the kernel rather than copying)."""
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 8
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key, value = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    key_cache = torch.zeros(3, 4, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    slots = [4, 5, 6, 0, 11]
    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(slots), backend=backend)
    assert torch.equal(key_cache, expected_cache(torch.zeros_like(key_cache), key, slots))
    assert torch.equal(value_cache, expected_cache(torch.zeros_like(value_cache), value, slots))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_all_padding_and_empty_batches_write_nothing(backend):
    key, value, key_cache, value_cache, slots = make_case(torch.float32, "cpu")
    before = key_cache.clone()
    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.full((7,), -1), backend=backend)
    ops.reshape_and_cache(key[:0], value[:0], key_cache, value_cache, torch.zeros(0, dtype=torch.long), backend=backend)
    assert torch.equal(bits(key_cache), bits(before))


@pytest.mark.skipif(not cpu_ops.is_available(), reason=f"{cpu_ops.unavailable_reason()}")
@pytest.mark.parametrize("bad", [24, -2])
def test_cpu_row_copy_checks_every_slot_before_writing(bad):
    """The C++ copy trusts nothing: with check_values=False (the engine's call) a slot past the cache
    or below -1 still raises, and the rows before it in the batch were not written either."""
    key, value, key_cache, value_cache, slots = make_case(torch.float32, "cpu")
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slots[4] = bad                                        # 6 blocks x 4 = 24 slots: 24 is one past the end
    with pytest.raises(RuntimeError, match=f"slot_mapping\\[4\\] = {bad} is outside"):
        cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(slots), check_values=False)
    assert torch.equal(bits(key_cache), bits(before_k)) and torch.equal(bits(value_cache), bits(before_v))


@pytest.mark.skipif(not cpu_ops.is_available(), reason=f"{cpu_ops.unavailable_reason()}")
def test_cpu_row_copy_splits_a_prefill_chunk_and_matches_the_torch_path():
    """Thousands of rows (the copy runs in parallel pieces), strided caches' views and a sliced
    slot_mapping: bit for bit the torch path's cache."""
    g = torch.Generator().manual_seed(3)
    num_tokens, num_blocks, block_size = 3000, 400, 16
    key = torch.randn(num_tokens, 3, 64, generator=g)
    value = torch.randn(num_tokens, 3, 64, generator=g)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=g)[:2 * num_tokens:2]     # a strided view
    slot_mapping[::7] = -1
    caches = {name: [torch.full((num_blocks, block_size, 3, 64), float("nan")) for _ in range(2)]
              for name in ("torch", "cpu")}
    for name, (k_cache, v_cache) in caches.items():
        ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, backend=name)
    for a, b in zip(caches["torch"], caches["cpu"]):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_writes_exact_rows(backend, dtype):
    key, value, key_cache, value_cache, slots = make_case(dtype, "cuda", num_blocks=64, block_size=16,
                                                          num_kv_heads=8, head_dim=128)
    slots = [s * 7 % 1024 for s in slots]      # spread over the bigger cache; -1 stays -1
    slots[2] = -1
    want_k = expected_cache(key_cache, key, slots)
    want_v = expected_cache(value_cache, value, slots)
    for slot_dtype in (torch.int64, torch.int32):
        ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(slots, dtype=slot_dtype, device="cuda"),
                              backend=backend)
        assert torch.equal(bits(key_cache), bits(want_k))
        assert torch.equal(bits(value_cache), bits(want_v))
