"""One dispatch point for chapter 10's quantized matmuls, in the project's backend vocabulary:

    "reference"  reference.py   unpack, dequantize the whole matrix, one fp32 matmul: the oracle
    "torch"      torch_ops.py   the same, vectorized (unpack by shifts); runs anywhere
    "triton"     triton_ops.py  dequantize tiles in registers inside the matmul: a GPU, or CPU
                                tensors under TRITON_INTERPRET=1
    "cpu"        cpu_ops.py     C++/OpenMP kernels (kernels_cpu/quant_gemm.py) that read the packed
                                integers directly: the point of the chapter (fewer bytes per step)

    wna16_linear(x, weight_packed, weight_scale, weight_zero_point, scheme, bias=None, backend="torch")
    w8a8_linear(x, weight, weight_scale, bias=None, backend="torch")

WNA16 (weights in N = 4 or 8 bits, activations in 16/32-bit floats), compressed-tensors'
"pack-quantized" tensors as a checkpoint stores them:
    x                  [T, in]                     fp32 / bf16 / fp16
    weight_packed      int32 [out, in * b / 32]    packing.pack_int32 (along the input dim)
    weight_scale       [out, groups] float         groups = in / group_size (1: per channel)
    weight_zero_point  int8 [out, groups] or None  None: symmetric (the loader unpacks the stored
                                                   int32 zero points once)
    -> y [T, out] in x's dtype: x @ dequantize(W)^T (+ bias), fp32 accumulation, one rounding.

W8A8 (int8 weights and int8 activations quantized per token on the fly), "int-quantized":
    weight int8 [out, in], weight_scale [out, 1] float (per output channel, symmetric)
    -> y [T, out]: reference.w8a8_linear_reference's numbers (exact integer sums; the scales'
    product in another order of rounding).

vLLM: vllm/model_executor/layers/quantization/compressed_tensors/schemes/
compressed_tensors_wNa16.py (MPLinearKernel: Marlin / Machete / Exllama on GPUs, a oneDNN-based
dynamic-4bit or torch path on CPUs) and compressed_tensors_w8a8_int8.py (ScaledMMLinearKernel:
cutlass_scaled_mm on GPUs, oneDNN's int8 GEMM on CPUs), after `scaled_int8_quant`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from paged_attention.ops import check_kernel_backend

from quantization.reference import QuantScheme

__all__ = ["BACKENDS", "backend_module", "check_w8a8_args", "check_wna16_args", "w8a8_linear", "wna16_linear"]

BACKENDS = ("reference", "torch", "triton", "cpu")
_MODULES = {
    "reference": "quantization.reference_ops",
    "torch": "quantization.torch_ops",
    "triton": "quantization.triton_ops",
    "cpu": "quantization.cpu_ops",
}
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def backend_module(backend: str, device: torch.device) -> ModuleType:
    """The module implementing `backend`, imported on first use (importing this module never
    imports triton: TRITON_INTERPRET must be set before that happens)."""
    check_kernel_backend(backend, device, BACKENDS, "quantization.cpu_ops", "the quantized matmuls")
    return importlib.import_module(_MODULES[backend])


def _fail(what: str, message: str) -> None:
    raise ValueError(f"{what}: {message}")


def _check_x_bias(x: torch.Tensor, out_features: int, bias: torch.Tensor | None, what: str) -> None:
    if x.dim() != 2:
        _fail(what, f"x must be [T, in], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        _fail(what, f"x must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        _fail(what, f"bias must be [{out_features}], got shape {tuple(bias.shape)}")


def check_wna16_args(x, weight_packed, weight_scale, weight_zero_point, scheme: QuantScheme, bias=None) -> None:
    """ValueError naming the first argument that breaks the contract at the top of this file."""
    what = "wna16_linear"
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        _fail(what, f"weight_packed must be int32 [out, in * b / 32], got {weight_packed.dtype} {tuple(weight_packed.shape)}")
    out_features, words = weight_packed.shape
    in_features = words * (32 // scheme.num_bits)
    _check_x_bias(x, out_features, bias, what)
    if x.shape[1] != in_features:
        _fail(what, f"x has {x.shape[1]} columns but weight_packed holds {in_features} int{scheme.num_bits} inputs per row")
    groups = scheme.groups(in_features)
    if tuple(weight_scale.shape) != (out_features, groups) or not weight_scale.is_floating_point():
        _fail(what, f"weight_scale must be float [{out_features}, {groups}], got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if scheme.symmetric != (weight_zero_point is None):
        _fail(what, "weight_zero_point must be None exactly when the scheme is symmetric")
    if weight_zero_point is not None and (weight_zero_point.dtype != torch.int8
                                          or tuple(weight_zero_point.shape) != (out_features, groups)):
        _fail(what, f"weight_zero_point must be int8 [{out_features}, {groups}], "
                    f"got {weight_zero_point.dtype} {tuple(weight_zero_point.shape)}")


def check_w8a8_args(x, weight, weight_scale, bias=None) -> None:
    what = "w8a8_linear"
    if weight.dtype != torch.int8 or weight.dim() != 2:
        _fail(what, f"weight must be int8 [out, in], got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    _check_x_bias(x, out_features, bias, what)
    if x.shape[1] != in_features:
        _fail(what, f"x has {x.shape[1]} columns, weight has {in_features}")
    if weight_scale.numel() != out_features or not weight_scale.is_floating_point():
        _fail(what, f"weight_scale must be float [{out_features}, 1], got {weight_scale.dtype} {tuple(weight_scale.shape)}")


def wna16_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_zero_point: torch.Tensor | None, scheme: QuantScheme, bias: torch.Tensor | None = None,
                 backend: str = "torch") -> torch.Tensor:
    check_wna16_args(x, weight_packed, weight_scale, weight_zero_point, scheme, bias)
    return backend_module(backend, x.device).wna16_linear(x, weight_packed, weight_scale, weight_zero_point,
                                                          scheme, bias)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, backend: str = "torch") -> torch.Tensor:
    check_w8a8_args(x, weight, weight_scale, bias)
    return backend_module(backend, x.device).w8a8_linear(x, weight, weight_scale, bias)
