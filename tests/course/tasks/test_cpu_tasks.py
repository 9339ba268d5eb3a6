"""Performance-track hidden tests (kernels_cpu/, optional tasks): the C++ kernels against torch's
SDPA on caches written by hand (tests/course/tasks/test_ch01_tasks.py's helpers), so no other
task's code is the oracle."""
import importlib.util
import pathlib

import pytest
import torch

_spec = importlib.util.spec_from_file_location("_ch01_tasks", pathlib.Path(__file__).with_name("test_ch01_tasks.py"))
_ch01 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ch01)
paged_cache, sdpa, GEN = _ch01.paged_cache, _ch01.sdpa, _ch01.GEN


@pytest.mark.parametrize("kv_splits", [1, 3])
def test_cpu_kernel_unified_attention_equals_sdpa(kv_splits):
    """The C++ kernel (run_item; merge_pieces when the KV of an item is split) on a
    chunked-prefill + decode batch, checked against SDPA on the same K/V."""
    from kernels_cpu import attention as cpu_ops
    try:
        cpu_ops.load()
    except RuntimeError as e:                 # no compiler / ninja: the kernel cannot be built here
        pytest.skip(str(e))
    seq_lens, query_lens = [37, 5, 64], [4, 5, 1]
    kc, vc, table, lens, keys, values = paged_cache(seq_lens)
    q = torch.randn(sum(query_lens), 4, 16, generator=GEN)
    qsl = torch.tensor([0, 4, 9, 10], dtype=torch.int32)
    out = cpu_ops.unified_attention(q, kc, vc, table, lens, qsl, 0.25, kv_splits=kv_splits)
    for i in range(3):
        a, b = int(qsl[i]), int(qsl[i + 1])
        torch.testing.assert_close(out[a:b], sdpa(q[a:b], keys[i], values[i], causal=True), atol=1e-4, rtol=1e-4)
