"""CPU matmuls on prepacked weights (models/cpu_gemm.py) — our C++ kernel on column panels and
oneDNN's: same results as F.linear within the dtype's tolerance, every linear of a model packed
(the tied lm_head too), the engine's switch, bad inputs refused with a message."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import EngineConfig
from mini_vllm.models import cpu_gemm
from mini_vllm.models.layers import Linear
from mini_vllm.models.loader import get_model, process_weights_after_loading
from paged_attention import cpu_ops
from cpu_isas import skip_unless_tested_here

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
def test_next_panel_prefetch_changes_no_bit():
    """Each row tile prefetches a share of its thread's next panel (csrc/cpu_gemm.cpp): a memory
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
@pytest.mark.parametrize("isa", cpu_ops.ALL_ISAS)
def test_every_instruction_set_variant_computes_f_linear(isa):
    """The kernel is compiled per instruction set (a panel is 3 of its vectors: 48, 24 or 3
    columns). The engine loads the best one this CPU runs, so the others are built here by name:
    a scalar build that did not compile once went unnoticed until someone tried it by hand."""
    skip_unless_tested_here(isa)
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


@pytest.fixture(scope="module", params=["tied", "untied"])
def tiny_model(request, tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp(f"gemm-{request.param}")
    tiny_checkpoint(path, "llama", tie_word_embeddings=request.param == "tied")
    return ModelConfig.from_pretrained(path)


def forward_logits(model, config):
    from mini_vllm.model_inputs import prepare_inputs
    from mini_vllm.kv_cache import allocate_kv_caches

    inputs = prepare_inputs([[5, 17, 99, 3, 250], [300, 2]], [0, 0], [[0, 1], [2]], 4)
    caches = allocate_kv_caches(config, 3, 4)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, caches, inputs.attn_metadata)
        return model.compute_logits(hidden[inputs.logits_indices])


@needs_onednn
def test_every_linear_and_the_lm_head_packed(tiny_model):
    config = tiny_model
    plain = get_model(config, cpu_gemm_backend="torch")
    packed = get_model(config, cpu_gemm_backend="auto")
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert all(m.packed_weight is not None for m in linears)
    assert packed.packed_lm_head is not None
    # "auto" takes our kernel where it builds (fp32), else oneDNN.
    kernel = cpu_gemm.kernel_unavailable_reason(torch.zeros(1, 1)) is None
    assert all(isinstance(m.packed_weight, cpu_gemm.PanelWeight) == kernel for m in linears)
    for backend, kind in (("cpu", cpu_gemm.PanelWeight), ("onednn", torch.Tensor)):
        if backend == "cpu" and not kernel:
            continue
        model = get_model(config, cpu_gemm_backend=backend)
        assert all(isinstance(m.packed_weight, kind) for m in model.modules() if isinstance(m, Linear))
        assert_close(forward_logits(model, config), forward_logits(plain, config), dtype=torch.float32)
    assert all(m.packed_weight is None for m in plain.modules() if isinstance(m, Linear))
    assert plain.packed_lm_head is None
    # 2 layers x (qkv, o, gate_up, down) = 8 linears, + the lm_head: its own Linear when untied,
    # else the embedding matrix packed once more.
    assert len(linears) == 8 + (not config.tie_word_embeddings)
    assert process_weights_after_loading(plain, "auto") == 9
    assert plain.packed_lm_head is not None
    assert_close(forward_logits(packed, config), forward_logits(get_model(config, cpu_gemm_backend="torch"), config),
                 dtype=torch.float32)


def test_bad_backends_are_refused(tiny_model):
    config = tiny_model
    with pytest.raises(ValueError, match="cpu_gemm_backend must be one of"):
        EngineConfig(cpu_gemm_backend="mkl")
    model = get_model(config, cpu_gemm_backend="torch")
    with pytest.raises(ValueError, match="cpu_gemm_backend must be one of"):
        process_weights_after_loading(model, "blas")
    model.half()                                           # fp16: oneDNN packs fp32 / bf16 only, ours fp32
    with pytest.raises(ValueError, match="needs CPU weights in fp32"):
        process_weights_after_loading(model, "onednn")
    with pytest.raises(ValueError, match="cpu_gemm_backend='cpu' cannot be used: it runs fp32 CPU weights"):
        process_weights_after_loading(model, "cpu")
    assert process_weights_after_loading(model, "auto") == 0   # auto: falls back to F.linear, says nothing


@needs_onednn
def test_bf16_on_a_cpu_without_onednn_bf16_falls_back_to_f_linear(tiny_model, monkeypatch):
    """On an AVX2-only CPU oneDNN refuses to reorder bf16 weights (it raised from inside model
    loading, so a bf16 engine could not start there): "auto" must keep F.linear, and "onednn"
    must say why it cannot."""
    config = tiny_model
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    model = get_model(config, cpu_gemm_backend="torch").to(torch.bfloat16)
    assert not cpu_gemm.can_pack(next(m for m in model.modules() if isinstance(m, Linear)).weight)
    with pytest.raises(ValueError, match="bf16 supported: False"):
        process_weights_after_loading(model, "onednn")
    assert process_weights_after_loading(model, "auto") == 0
    linear = next(m for m in model.modules() if isinstance(m, Linear))
    assert all(m.packed_weight is None for m in model.modules() if isinstance(m, Linear))
    x = torch.randn(3, linear.input_size, dtype=torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, linear.weight))            # and it runs, on F.linear


@needs_onednn
def test_packing_drops_the_unpacked_weights(tiny_model):
    """vLLM's remove_weight=True: once packed, a Linear's row-major weight is dead memory. Only
    the tied lm_head keeps its matrix (it is also the input embedding)."""
    config = tiny_model
    kept = get_model(config, cpu_gemm_backend="torch")
    process_weights_after_loading(kept, "auto", remove_weight=False)
    dropped = get_model(config, cpu_gemm_backend="auto")                  # the engine's default
    linears = [m for m in dropped.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.numel() == 0 and m.packed_weight is not None for m in linears)
    param_bytes = lambda model: sum(p.numel() * p.element_size() for p in model.parameters())
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in kept.modules() if isinstance(m, Linear))
    assert param_bytes(kept) - param_bytes(dropped) == linear_bytes > 0
    assert torch.equal(forward_logits(dropped, config), forward_logits(kept, config))
    assert process_weights_after_loading(dropped, "auto") == 0            # packed already: nothing to redo
    with pytest.raises(ValueError, match="no packed weight"):
        Linear(4, 4).drop_unpacked_weight()


@needs_onednn
def test_auto_falls_back_to_onednn_where_the_kernel_cannot_build(tiny_model, monkeypatch):
    """No compiler (or a failed build): "auto" packs for oneDNN instead, "cpu" says why it cannot."""
    def no_build():
        raise RuntimeError("the CPU GEMM kernel needs a C++ compiler")

    monkeypatch.setattr(cpu_gemm, "load_kernel", no_build)
    model = get_model(tiny_model, cpu_gemm_backend="auto")
    assert all(isinstance(m.packed_weight, torch.Tensor) for m in model.modules() if isinstance(m, Linear))
    with pytest.raises(ValueError, match="cpu_gemm_backend='cpu' cannot be used: the CPU GEMM kernel needs a C"):
        get_model(tiny_model, cpu_gemm_backend="cpu")
