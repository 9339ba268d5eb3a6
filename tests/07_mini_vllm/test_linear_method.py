"""The engine's linear layers on the CPU GEMMs (models/linear_method.py: the seam; the kernels in
kernels_cpu/gemm.py, tested in tests/kernels_cpu/test_gemm.py): every linear of a model packed
(the tied lm_head too) for one method chosen after loading, the same logits as F.linear, the
cpu_gemm_backend switch and its fallbacks, bad backends refused with a message."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

from kernels_cpu import gemm as cpu_gemm
from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import EngineConfig
from mini_vllm.models.linear_method import UNQUANTIZED, OneDNNLinearMethod, PanelLinearMethod
from mini_vllm.models.loader import get_model, process_weights_after_loading
from model_executor.linear import Linear

needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this torch build has no oneDNN")


@pytest.fixture(scope="module", params=["tied", "untied"])
def tiny_model(request, tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp(f"gemm-{request.param}")
    tiny_checkpoint(path, "llama", tie_word_embeddings=request.param == "tied")
    return ModelConfig.from_pretrained(path)


def forward_logits(model, config):
    from mini_vllm.model_inputs import prepare_inputs

    inputs = prepare_inputs([[5, 17, 99, 3, 250], [300, 2]], [0, 0], [[0, 1], [2]], 4)
    caches = config.kv_cache_spec(4).allocate_per_layer(3, "cpu")
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
    assert packed.lm_head.packed_weight is not None
    assert all(m.linear_method is packed.lm_head.linear_method for m in linears)     # one method per model
    # "auto" takes our kernel where it builds (fp32), else oneDNN.
    kernel = cpu_gemm.kernel_unavailable_reason(torch.zeros(1, 1)) is None
    assert all(isinstance(m.packed_weight, cpu_gemm.PanelWeight) == kernel for m in linears)
    assert all(isinstance(m.linear_method, PanelLinearMethod if kernel else OneDNNLinearMethod) for m in linears)
    for backend, kind in (("cpu", cpu_gemm.PanelWeight), ("onednn", torch.Tensor)):
        if backend == "cpu" and not kernel:
            continue
        model = get_model(config, cpu_gemm_backend=backend)
        assert all(isinstance(m.packed_weight, kind) for m in model.modules() if isinstance(m, Linear))
        assert_close(forward_logits(model, config), forward_logits(plain, config), dtype=torch.float32)
    assert all(m.packed_weight is None and m.linear_method is UNQUANTIZED
               for m in plain.modules() if isinstance(m, Linear))
    assert plain.lm_head.packed_weight is None and plain.lm_head.linear_method is UNQUANTIZED
    # 2 layers x (qkv, o, gate_up, down) = 8 linears, + the lm_head: its own Linear when untied,
    # else the embedding matrix packed once more.
    assert len(linears) == 8 + (not config.tie_word_embeddings)
    assert process_weights_after_loading(plain, "auto") == 9
    assert plain.lm_head.packed_weight is not None
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
