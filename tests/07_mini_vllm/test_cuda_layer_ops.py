"""The engine's fused GPU layer ops and their switch `EngineConfig.cuda_layer_ops` ("auto" | "triton" |
"torch"): which forward the loader binds (models/loader.py: use_cuda_layer_ops), and a tiny model's
greedy tokens with every CustomOp on platform "cuda" (the Triton kernels of
paged_attention/model/triton_layer_ops.py) == with the PyTorch forwards.

Without CUDA the kernels run under the Triton interpreter (the model on the CPU, bound by hand);
the `gpu` tests load the model on the GPU and let the loader bind them.
"""
from __future__ import annotations

import pytest
import torch

from mini_vllm.config import ModelConfig
from mini_vllm.engine_config import EngineConfig
from mini_vllm.models.loader import get_model, use_cuda_layer_ops
from model_executor.custom_op import CustomOp

PROMPTS = {"a": [5, 17, 99, 3, 250, 7, 41], "b": [300, 12, 8], "c": list(range(20, 58))}
MAX_NEW = 6


def platforms(model) -> set[str]:
    return {m.platform for m in model.modules() if isinstance(m, CustomOp)}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("tiny-cuda-layer-ops")
    tiny_checkpoint(root / "llama", "llama", seed=0)
    tiny_checkpoint(root / "qwen3", "qwen3", seed=1, head_dim=16)
    return root


def test_the_switch_and_where_it_binds(tiny_dirs):
    model = get_model(ModelConfig.from_pretrained(tiny_dirs / "llama"), attn_backend="torch")
    assert platforms(model) == {"native"}
    assert use_cuda_layer_ops(model, "auto", "triton") == 0 and platforms(model) == {"native"}   # on the CPU
    assert use_cuda_layer_ops(model, "torch") == 0
    with pytest.raises(ValueError, match="cuda_layer_ops='triton' cannot be used: the model is not on a CUDA device"):
        use_cuda_layer_ops(model, "triton")
    with pytest.raises(ValueError, match="cuda_layer_ops must be one of"):
        use_cuda_layer_ops(model, "fused")
    with pytest.raises(ValueError, match="cuda_layer_ops must be one of"):
        EngineConfig(cuda_layer_ops="fused")
    assert EngineConfig().cuda_layer_ops == "auto"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_greedy_tokens_with_the_triton_ops_equal_native(arch, tiny_dirs, paged_driver):
    """Every CustomOp bound to "cuda" by hand (the interpreter on a CPU; the compiled kernels on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = ModelConfig.from_pretrained(tiny_dirs / arch)
    model = get_model(config, device=device, attn_backend="torch")
    native = paged_driver(model, config, device=device).greedy(PROMPTS, MAX_NEW)
    for m in model.modules():
        if isinstance(m, CustomOp):
            m.dispatch_forward("cuda")
    assert platforms(model) == {"cuda"}
    fused = paged_driver(model, config, device=device).greedy(PROMPTS, MAX_NEW)
    assert fused == native


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_loader_binds_the_triton_ops_and_tokens_match(arch, dtype, tiny_dirs, paged_driver):
    """On a GPU with the triton attention backend, "auto" binds platform "cuda"; "torch" keeps native;
    the greedy tokens agree."""
    config = ModelConfig.from_pretrained(tiny_dirs / arch, dtype=dtype)
    fused = get_model(config, device="cuda", attn_backend="triton", cuda_layer_ops="auto")
    native = get_model(config, device="cuda", attn_backend="triton", cuda_layer_ops="torch")
    assert platforms(fused) == {"cuda"} and platforms(native) == {"native"}
    debug = get_model(config, device="cuda", attn_backend="torch", cuda_layer_ops="auto")
    assert platforms(debug) == {"native"}                          # a debugging attention backend: PyTorch throughout
    got = paged_driver(fused, config, device="cuda").greedy(PROMPTS, MAX_NEW)
    assert got == paged_driver(native, config, device="cuda").greedy(PROMPTS, MAX_NEW)
