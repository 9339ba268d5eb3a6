"""Quantized checkpoints in the engine: the method found by name, each linear given its method
before the weights stream in.

vLLM: `ModelConfig._verify_quantization` (the checkpoint's `quant_method` against the user's
`quantization=`), `layers/quantization/__init__.py: get_quantization_config(name)` (a registry of
method names), and `get_quant_method(layer, prefix)` called from every linear layer's constructor.
Here the model files stay as they are: one pass over the built model (`quantize_linear_layers`)
does what vLLM's constructors do, between construction and `load_weights`.

The methods are chapter 10's (`quantization/`); this chapter reaches them only through
QUANTIZATION_METHODS, by name, as vLLM reaches its quantization methods.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch
from torch import nn

from model_executor.linear import UNQUANTIZED, Linear
from model_executor.quantization_config import QuantizationConfig
from mini_vllm.models.attention import PagedAttention
from paged_attention.kv_quant import KVQuant

__all__ = ["QUANTIZATION_METHODS", "add_kv_cache_scales", "get_quantization_config", "kv_heads_of_rank",
           "process_kv_cache_scales", "process_quantized_layers", "quant_kernel_backend",
           "quantize_linear_layers", "verify_quantization"]

# name (config.json's quant_method, LLM(quantization=...)) -> (module, class) of its QuantizationConfig
QUANTIZATION_METHODS = {
    "compressed-tensors": ("quantization.compressed_tensors", "CompressedTensorsConfig"),
    "gptq": ("quantization.gptq_awq", "GPTQConfig"),
    "awq": ("quantization.gptq_awq", "AWQConfig"),
}


def verify_quantization(checkpoint_config: dict | None, quantization: str | None, model_dir: Path) -> str | None:
    """The method this checkpoint runs with (None: unquantized). ValueError, with vLLM's words, when
    the user's `quantization` names an unknown method or another one than the checkpoint's."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"Unknown quantization method: {quantization}. Must be one of {sorted(QUANTIZATION_METHODS)}.")
    if checkpoint_config is None:
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} needs a quantized checkpoint, but {model_dir}/config.json "
                             "has no quantization_config")
        return None
    method = str(checkpoint_config.get("quant_method", "")).lower().replace("_", "-")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"{model_dir}/config.json: quantization method {method or '(none)'!r} is not supported; "
                         f"supported: {sorted(QUANTIZATION_METHODS)}")
    if quantization is not None and quantization != method:
        raise ValueError(f"Quantization method specified in the model config ({method}) does not match the "
                         f"quantization method specified in the `quantization` argument ({quantization}).")
    return method


def get_quantization_config(method: str | None, checkpoint_config: dict | None) -> QuantizationConfig | None:
    """The method's config built from the checkpoint's dict (None when unquantized)."""
    if method is None:
        return None
    module_name, class_name = QUANTIZATION_METHODS[method]
    return getattr(importlib.import_module(module_name), class_name).from_config(checkpoint_config)


def checkpoint_names(prefix: str, stacked_params_mapping) -> list[str]:
    """The checkpoint's module names a layer was merged from ("...qkv_proj" -> q/k/v_proj); itself
    when it was not merged."""
    names = [prefix[: -len(merged)] + piece for merged, piece, _ in stacked_params_mapping if prefix.endswith(merged)]
    return names or [prefix]


def quant_kernel_backend(device, cpu_gemm_backend: str, attn_backend: str) -> str:
    """The backend of chapter 10's ops that quantized layers run on: "torch" where the engine was
    asked for plain PyTorch (cpu_gemm_backend="torch" on a CPU, the torch / reference attention on
    a GPU: the readable paths), else "auto" (the method's kernel: C++ on a CPU where it builds,
    Triton on a GPU)."""
    on_cpu = torch.device(device).type == "cpu"
    plain = cpu_gemm_backend == "torch" if on_cpu else attn_backend in ("torch", "reference")
    return "torch" if plain else "auto"


def quantize_linear_layers(model: nn.Module, quant_config: QuantizationConfig | None, backend: str = "auto") -> int:
    """Before loading: every Linear the config quantizes gets its method (running on `backend`) and
    the method's parameters (`create_weights`); returns how many. The others stay unquantized."""
    if quant_config is None:
        return 0
    mapping = getattr(model, "stacked_params_mapping", [])
    count = 0
    for prefix, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        method = quant_config.get_quant_method(layer, prefix, checkpoint_names(prefix, mapping), backend)
        if method is None:
            continue
        method.create_weights(layer)
        layer.linear_method = method
        count += 1
    return count


def add_kv_cache_scales(model: nn.Module, quant_config: QuantizationConfig | None) -> int:
    """A checkpoint with KV-cache scales: every attention layer gets `k_scale` / `v_scale`
    parameters for them, -1 until loaded (vLLM: BaseKVCacheMethod.create_weights; the checkpoint's
    `self_attn.k_scale` loads into `self_attn.attn.k_scale`, loader.remap_kv_scale_name): one number,
    or one per KV head of this rank (strategy "attn_head")."""
    if quant_config is None or not quant_config.has_kv_cache_scales():
        return 0
    per_head = quant_config.kv_cache_scales_per_head()
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for layer in layers:
        for name in ("k_scale", "v_scale"):
            shape = (layer.num_kv_heads,) if per_head else ()
            param = nn.Parameter(torch.full(shape, -1.0, dtype=torch.float32), requires_grad=False)
            param.optional_in_checkpoint = True          # a checkpoint may lack them: 1.0 then
            param.weight_loader = _load_per_head if per_head else _load_scalar
            layer.register_parameter(name, param)
    return len(layers)


def _load_scalar(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """One scale, stored as [] or [1] (compressed-tensors' per-tensor shape)."""
    if loaded.numel() != 1:
        raise ValueError(f"a per-tensor KV-cache scale holds one number, got shape {tuple(loaded.shape)}")
    param.data.copy_(loaded.reshape(()))


def kv_heads_of_rank(total: int, tp_size: int, rank: int) -> list[int]:
    """The KV heads tensor-parallel rank `rank` holds: a slice of them, or one replicated head when
    there are fewer heads than ranks (vLLM's attention-head partitioning)."""
    if total >= tp_size:
        n = total // tp_size
        return list(range(rank * n, (rank + 1) * n))
    return [rank * total // tp_size]


def _load_per_head(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """One scale per KV head, stored [heads, 1, 1] (llmcompressor's "attn_head"): this rank's heads."""
    from model_executor.parallel_state import get_tp_group
    tp = get_tp_group()
    flat = loaded.flatten()
    heads = kv_heads_of_rank(flat.numel(), tp.world_size, tp.rank_in_group)
    if len(heads) != param.numel():
        raise ValueError(f"a per-head KV-cache scale of {flat.numel()} heads gives this rank {len(heads)}, "
                         f"its attention layer holds {param.numel()} KV heads")
    param.data.copy_(flat[heads])


def process_kv_cache_scales(model: nn.Module) -> int:
    """After loading (vLLM: BaseKVCacheMethod.process_weights_after_loading): an fp8 cache with
    per-tensor scales takes the checkpoint's (a lone k_scale serves V too); any other cache ignores
    them — a float cache has no scale, per-token-head modes compute their own. Per-head scales
    become their largest (vLLM's `_k_scale_float`, what its CPU and FlashInfer attention read; only
    its FlashAttention path reads a scale per head): no head's numbers then exceed fp8's range.
    Returns the layers whose scales were set."""
    count = 0
    for layer in (m for m in model.modules() if isinstance(m, PagedAttention) and hasattr(m, "k_scale")):
        k, v = float(layer.k_scale.max()), float(layer.v_scale.max())
        del layer._parameters["k_scale"], layer._parameters["v_scale"]
        quant = layer.kv_quant
        if quant is None or quant.per_token_head or k <= 0:
            continue
        layer.kv_quant = KVQuant(quant.kv_cache_dtype, k_scale=k, v_scale=v if v > 0 else k)
        count += 1
    return count


def process_quantized_layers(model: nn.Module) -> int:
    """After loading: each quantized layer's method repacks what it loaded for its kernel."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.linear_method is not UNQUANTIZED]
    for layer in layers:
        layer.linear_method.process_weights_after_loading(layer)
    return len(layers)
