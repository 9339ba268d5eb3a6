"""Chapter 05 tasks graded on their own: unified (chunked-prefill + decode) paged attention,
the vectorized torch path and the Triton kernels (2-D and split-KV with reduce_segments),
checked against torch's SDPA on caches written by hand — not against the chapter's reference
loop, which is another task."""
import importlib.util
import pathlib

import pytest
import torch

from chunked_prefill import attention_vectorized, triton_ops

_spec = importlib.util.spec_from_file_location("_ch01_tasks", pathlib.Path(__file__).with_name("test_ch01_tasks.py"))
_ch01 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ch01)
paged_cache, sdpa, GEN = _ch01.paged_cache, _ch01.sdpa, _ch01.GEN

SEQ_LENS, QUERY_LENS = [37, 5, 64, 20], [4, 5, 1, 20]      # chunk with context, whole prompt, decode, prompt


def batch():
    kc, vc, table, lens, keys, values = paged_cache(SEQ_LENS)
    q = torch.randn(sum(QUERY_LENS), 4, 16, generator=GEN)
    qsl = torch.tensor([0] + list(torch.tensor(QUERY_LENS).cumsum(0)), dtype=torch.int32)
    return q, kc, vc, table, lens, qsl, keys, values


def check(out, q, qsl, keys, values):
    for i in range(len(SEQ_LENS)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        torch.testing.assert_close(out[a:b].float(), sdpa(q[a:b], keys[i], values[i], causal=True), atol=1e-4, rtol=1e-4)


def test_vectorized_unified_attention_equals_sdpa():
    q, kc, vc, table, lens, qsl, keys, values = batch()
    check(attention_vectorized.unified_attention(q, kc, vc, table, lens, qsl, 0.25), q, qsl, keys, values)


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_triton_unified_attention_equals_sdpa(num_kv_splits):
    q, kc, vc, table, lens, qsl, keys, values = batch()
    out = triton_ops.unified_attention(q, kc, vc, table, lens, qsl, 0.25, num_kv_splits=num_kv_splits)
    check(out, q, qsl, keys, values)
