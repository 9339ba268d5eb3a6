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

__all__ = ["QUANTIZATION_METHODS", "get_quantization_config", "process_quantized_layers", "quant_kernel_backend",
           "quantize_linear_layers", "verify_quantization"]

# name (config.json's quant_method, LLM(quantization=...)) -> (module, class) of its QuantizationConfig
QUANTIZATION_METHODS = {
    "compressed-tensors": ("quantization.compressed_tensors", "CompressedTensorsConfig"),
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


def process_quantized_layers(model: nn.Module) -> int:
    """After loading: each quantized layer's method repacks what it loaded for its kernel."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.linear_method is not UNQUANTIZED]
    for layer in layers:
        layer.linear_method.process_weights_after_loading(layer)
    return len(layers)
