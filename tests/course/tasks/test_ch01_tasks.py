"""Chapter 01 tasks graded on their own (see tests/course/tasks/conftest.py): paged attention
checked against torch's SDPA on caches written by hand, so no other task's code is needed."""
import math

import pytest
import torch
import torch.nn.functional as F

from paged_attention import reference, torch_ops, triton_ops

GEN = torch.Generator().manual_seed(7)


def sdpa(q, k, v, causal):       # q [q_len, H, D], k/v [kv_len, KVH, D] -> [q_len, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q_len, kv_len = q.shape[0], k.shape[0]
    mask = None
    if causal:                   # the queries are the LAST q_len positions
        mask = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                         v.transpose(0, 1).float(), attn_mask=mask, scale=q.shape[-1] ** -0.5)
    return out.transpose(0, 1)


def paged_cache(seq_lens, num_kv_heads=2, head_dim=16, block_size=4):
    """K/V of every request written by hand into shuffled blocks; NaN everywhere else."""
    blocks_per = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=GEN).tolist()
    kc = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    table = torch.zeros(len(seq_lens), max(blocks_per + [1]), dtype=torch.int32)
    keys, values, used = [], [], 0
    for i, n in enumerate(seq_lens):
        k, v = torch.randn(n, num_kv_heads, head_dim, generator=GEN), torch.randn(n, num_kv_heads, head_dim, generator=GEN)
        ids = perm[used:used + blocks_per[i]]
        used += blocks_per[i]
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for t in range(n):
            kc[ids[t // block_size], t % block_size], vc[ids[t // block_size], t % block_size] = k[t], v[t]
        keys.append(k)
        values.append(v)
    return kc, vc, table, torch.tensor(seq_lens, dtype=torch.int32), keys, values


def stand_in_slot_mapping(block_ids, start_pos, num_tokens, block_size):     # another task's region
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start_pos, start_pos + num_tokens)]


@pytest.mark.parametrize("seq_lens", [[5, 1, 9], [16]])
def test_reference_paged_decode_equals_sdpa(seq_lens, monkeypatch):
    monkeypatch.setattr(reference, "slot_mapping_for_request", stand_in_slot_mapping)
    kc, vc, table, lens, keys, values = paged_cache(seq_lens)
    q = torch.randn(len(seq_lens), 4, 16, generator=GEN)
    out = reference.paged_decode_attention(q, kc, vc, table, lens, 0.25)
    for i in range(len(seq_lens)):
        torch.testing.assert_close(out[i], sdpa(q[i:i + 1], keys[i], values[i], causal=False)[0], atol=1e-5, rtol=1e-5)


def prompts(lens, num_heads=4, num_kv_heads=2, head_dim=16):
    q = torch.randn(sum(lens), num_heads, head_dim, generator=GEN)
    k = torch.randn(sum(lens), num_kv_heads, head_dim, generator=GEN)
    v = torch.randn(sum(lens), num_kv_heads, head_dim, generator=GEN)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return q, k, v, qsl


def check_prefill(out, q, k, v, qsl):
    for i in range(len(qsl) - 1):
        a, b = int(qsl[i]), int(qsl[i + 1])
        torch.testing.assert_close(out[a:b].float(), sdpa(q[a:b], k[a:b], v[a:b], causal=True), atol=1e-4, rtol=1e-4)


def test_torch_prefill_equals_sdpa(monkeypatch):
    """torch_ops.paged_prefill_attention; the cache write (another task) is stood in for."""
    def stand_in_cache_write(key, value, key_cache, value_cache, slot_mapping, check_values=True, *, kv_quant=None):
        for t, s in enumerate(slot_mapping.tolist()):
            if s >= 0:
                key_cache[s // key_cache.shape[1], s % key_cache.shape[1]] = key[t]
                value_cache[s // key_cache.shape[1], s % key_cache.shape[1]] = value[t]
    monkeypatch.setattr(torch_ops, "reshape_and_cache", stand_in_cache_write)
    q, k, v, qsl = prompts([7, 1, 12])
    kc, vc = torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16)
    slots = torch.randperm(32, generator=GEN)[:20]
    out = torch_ops.paged_prefill_attention(q, k, v, kc, vc, slots, qsl, 16 ** -0.5)
    check_prefill(out, q, k, v, qsl)


def test_triton_prefill_equals_sdpa_and_writes_the_cache():
    q, k, v, qsl = prompts([9, 3, 17])
    kc, vc = torch.zeros(10, 4, 2, 16), torch.zeros(10, 4, 2, 16)
    slots = torch.randperm(40, generator=GEN)[:29]
    out = triton_ops.paged_prefill_attention(q, k, v, kc, vc, slots, qsl, 16 ** -0.5)
    check_prefill(out, q, k, v, qsl)
    torch.testing.assert_close(kc.reshape(40, 2, 16)[slots], k)
    torch.testing.assert_close(vc.reshape(40, 2, 16)[slots], v)
