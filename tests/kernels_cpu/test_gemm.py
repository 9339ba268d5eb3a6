"""CPU matmuls on prepacked weights (kernels_cpu/gemm.py) — our C++ kernel on column panels and
oneDNN's: same results as F.linear within the dtype's tolerance, every instruction-set build, the
panel layout, bad inputs refused with a message. The engine's use of them (every linear of a
model packed, the tied lm_head too, the cpu_gemm_backend switch):
tests/07_mini_vllm/test_linear_method.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

from kernels_cpu import build
from kernels_cpu import gemm as cpu_gemm

needs_kernel = pytest.mark.skipif(cpu_gemm.kernel_unavailable_reason(torch.zeros(1, 1)) is not None,
                                  reason="the C++ GEMM kernel does not build here")
needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this torch build has no oneDNN")
bf16_if_supported = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu_gemm.dtype_supported(torch.bfloat16), reason="oneDNN bf16 needs AVX-512 bw/vl/dq or AVX-NE-CONVERT"))


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, bf16_if_supported])
@pytest.mark.parametrize("rows", [1, 7, 64, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias, dtype):
    torch.manual_seed(rows)
    w = torch.randn(96, 80, dtype=dtype)
    b = torch.randn(96, dtype=dtype) if bias else None
    x = torch.randn(rows, 80, dtype=dtype)
    packed = cpu_gemm.pack_weight(w)
    out = cpu_gemm.packed_linear(x, packed, b)
    assert out.shape == (rows, 96) and out.dtype == dtype
    assert_close(out, F.linear(x, w, b), dtype=dtype)
    # The same packed weight serves any number of rows (decode steps of every batch size).
    assert_close(cpu_gemm.packed_linear(x[:1], packed, b), F.linear(x[:1], w, b), dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 64, 97, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_equals_f_linear(rows, bias):
    """Every row-tile size (1-4 rows, and the 4 + remainder split), a row count past one row block
    (96), an output count that leaves the last panel partly padding (100) and an odd K (83)."""
    torch.manual_seed(rows)
    w, x = torch.randn(100, 83), torch.randn(rows, 83)
    b = torch.randn(100) if bias else None
    packed = cpu_gemm.pack_panels(w)
    out = cpu_gemm.panel_linear(x, packed, b)
    assert out.shape == (rows, 100) and out.dtype == torch.float32
    assert_close(out, F.linear(x, w, b), dtype=torch.float32)
    # Any view of x: a transposed (non-contiguous) one gives the same rows.
    xt = x.t().contiguous().t()
    assert torch.equal(cpu_gemm.panel_linear(xt, packed, b), out)
    # Row r's result does not depend on the other rows (a decode batch of any size).
    assert torch.equal(cpu_gemm.panel_linear(x[-1:], packed, b), out[-1:])


@needs_kernel
@pytest.mark.parametrize("rows", [171, 513])
def test_prefill_row_passes_change_no_bit(rows):
    """Rows go through a thread's panels 96 at a time (csrc/gemm.cpp kRowBlock): 171 rows make 2
    passes (96 + 75), 513 make 6 (96 x 5 + 33), at SmolLM2's widest K (1536). Each output is the same
    FMA chain over k whatever pass its row falls in, so every row equals that row computed alone,
    bit for bit."""
    torch.manual_seed(rows)
    w, x = torch.randn(100, 1536) / 1536 ** 0.5, torch.randn(rows, 1536)      # outputs O(1), like a layer
    packed = cpu_gemm.pack_panels(w)
    out = cpu_gemm.panel_linear(x, packed, None)
    assert_close(out, F.linear(x, w), dtype=torch.float32)
    for r in (0, 95, 96, 191, 192, 480, rows - 1):
        if r < rows:
            assert torch.equal(cpu_gemm.panel_linear(x[r:r + 1], packed, None), out[r:r + 1]), r


@needs_kernel
def test_next_panel_prefetch_changes_no_bit():
    """Each row tile prefetches a share of its thread's next panel (csrc/gemm.cpp): a memory
    hint, so with it or without it, on one thread or two (each with its own run of panels), and
    for one row, a remainder tile, one row block and past it, every output is bit for bit the same."""
    torch.manual_seed(0)
    w, b = torch.randn(1000, 300) / 300 ** 0.5, torch.randn(1000)   # 42 panels on AVX2: split between threads
    packed = cpu_gemm.pack_panels(w)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (1, 5, 64, 200):
                x = torch.randn(rows, 300)
                out = cpu_gemm.panel_linear(x, packed, b)
                assert torch.equal(out, cpu_gemm.panel_linear(x, packed, b, prefetch_next_panel=False))
                assert_close(out, F.linear(x, w, b), dtype=torch.float32)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("isa", build.ALL_ISAS)
def test_every_instruction_set_variant_computes_f_linear(isa):
    """The kernel is compiled per instruction set (a panel is 3 of its vectors: 48, 24 or 3
    columns). The engine loads the best one this CPU runs, so the others are built here by name:
    a scalar build that did not compile once went unnoticed until someone tried it by hand.
    (conftest.py skips the variants not tested here.)"""
    kernel = cpu_gemm.load_kernel(isa)
    assert kernel.isa() == isa and kernel.panel_width == {"avx512": 48, "avx512_simde": 48, "avx2": 24, "scalar": 3}[isa]
    torch.manual_seed(0)
    w, b = torch.randn(100, 83), torch.randn(100)
    panels = kernel.pack_panels(w)
    for rows in (1, 3, 5, 97):
        x = torch.randn(rows, 83)
        assert_close(kernel.panel_gemm(x, panels, b, 100), F.linear(x, w, b), dtype=torch.float32)


@needs_kernel
def test_panels_hold_the_weight_columns_and_zero_padding():
    """The layout the kernel streams: panel p, row k = W[p*NR : p*NR + NR, k], zeros past N."""
    w = torch.arange(50 * 7, dtype=torch.float32).reshape(50, 7) + 1
    packed = cpu_gemm.pack_panels(w)
    nr = cpu_gemm.load_kernel().panel_width
    assert packed.out_features == 50 and packed.panels.shape == (-(-50 // nr), 7, nr)
    columns = packed.panels.permute(0, 2, 1).reshape(-1, 7)        # [P * NR, K]: W's rows, then padding
    assert torch.equal(columns[:50], w) and not columns[50:].any()


@needs_kernel
def test_panel_linear_refuses_bad_inputs_with_a_message():
    packed = cpu_gemm.pack_panels(torch.randn(10, 8))
    with pytest.raises(RuntimeError, match="x has 9 input features, the weight 8"):
        cpu_gemm.panel_linear(torch.randn(2, 9), packed, None)
    with pytest.raises(RuntimeError, match="x must be a 2-D fp32 CPU tensor"):
        cpu_gemm.panel_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        cpu_gemm.panel_linear(torch.randn(2, 8), packed, torch.randn(11))
    with pytest.raises(RuntimeError, match="not a pack_panels"):
        cpu_gemm.panel_linear(torch.randn(2, 8), cpu_gemm.PanelWeight(torch.randn(10, 8), 10), None)
    with pytest.raises(RuntimeError, match="the weight must be a 2-D fp32"):
        cpu_gemm.pack_panels(torch.randn(10, 8, dtype=torch.float16))
    assert cpu_gemm.panel_linear(torch.randn(0, 8), packed, None).shape == (0, 10)
