"""Backend "cpu" of ops.py: the quantized matmuls on the C++/OpenMP kernels (kernels_cpu/quant_gemm.py,
csrc/quant_gemm.cpp), which read the packed integers directly -- the point of the chapter: a decode
step reads 4 (int8) or 8 (int4) times fewer weight bytes than fp32, and no float weight is ever
written to memory.

    from quantization import cpu_ops
    y = cpu_ops.wna16_linear(x, weight_packed, weight_scale, weight_zero_point, scheme, bias)   # as every backend
    y = cpu_ops.w8a8_linear(x, weight, weight_scale, bias)

    prepared = cpu_ops.prepare_wna16(weight_packed, weight_scale, weight_zero_point, scheme)   # once, at load
    y = cpu_ops.wna16_linear_prepared(x, prepared, bias)                                       # every step
    prepared = cpu_ops.prepare_w8a8(weight, weight_scale)
    y = cpu_ops.w8a8_linear_prepared(x, prepared, bias)

    cpu_ops.is_available()    # False (with unavailable_reason()) when no compiler / the build fails

The kernels want the weights regrouped into column panels (one packed word per SIMD lane, still 4 /
8 bits per weight), as vLLM's kernels repack a checkpoint after loading it
(`process_weights_after_loading`): `prepare_*` does that once, and the engine keeps the result. The
plain forms (same signatures and checks as every backend: ops.check_wna16_args / check_w8a8_args)
prepare on every call, so they are for tests and one-off calls, not for a step loop.

Numerics: WNA16 sums x * (q - z) exactly per product in fp32 and scales each group once, so it
equals the reference up to the order of its sums; W8A8's integer sums are exact and its scaling
is the reference's (in double), so it equals reference.w8a8_linear_reference exactly.
"""
from __future__ import annotations

import torch

from kernels_cpu import quant_gemm as cpu_quant
from quantization import ops
from quantization.reference import QuantScheme

__all__ = ["is_available", "prepare_w8a8", "prepare_wna16", "unavailable_reason", "w8a8_linear",
           "w8a8_linear_prepared", "wna16_linear", "wna16_linear_prepared"]


def is_available() -> bool:
    """True when the kernels are (or can be) built here. Builds them on the first call."""
    return cpu_quant.is_available()


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None when they can): no compiler, a failed build."""
    return cpu_quant.unavailable_reason()


def _check_cpu(what: str, *tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{what}: backend='cpu' is the C++ kernel for CPU tensors, got {t.device}")


def _check_x_and_bias(what: str, x: torch.Tensor, in_features: int, out_features: int,
                      bias: torch.Tensor | None) -> None:
    """The per-call half of the contract (the weight was checked when it was prepared). Every step
    of every layer passes here: the usual case is one expression, the messages only on failure (a
    decode step's int4 matmul takes tens of microseconds; the full checks took two)."""
    if (x.dim() == 2 and x.shape[1] == in_features and x.dtype in ops.ACTIVATION_DTYPES and x.is_cpu
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == out_features and bias.is_cpu))):
        return
    ops._check_x_bias(x, out_features, bias, what)
    if x.shape[1] != in_features:
        raise ValueError(f"{what}: x has {x.shape[1]} columns, the weight {in_features} inputs")
    _check_cpu(what, x, bias)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: contiguous rows (a strided view is copied, [T, in] is small)."""
    return x if x.is_contiguous() else x.contiguous()


# ----------------------------------------------------------------------------- WNA16

def prepare_wna16(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None,
                  scheme: QuantScheme) -> cpu_quant.WNA16Weight:
    """The checkpoint's tensors (ops.py's contract) -> the kernel's panels, once per weight."""
    what = "wna16_linear"
    per_word = 32 // scheme.num_bits
    in_features = weight_packed.shape[1] * per_word if weight_packed.dim() == 2 else 0
    ops.check_wna16_args(torch.empty(0, in_features), weight_packed, weight_scale, weight_zero_point, scheme)
    _check_cpu(what, weight_packed, weight_scale, weight_zero_point)
    if scheme.group_size is not None and scheme.group_size % per_word:
        raise ValueError(f"{what}: backend='cpu' needs group_size to be a multiple of {per_word} (the int"
                         f"{scheme.num_bits} values of one int32 word), got {scheme.group_size}")
    return cpu_quant.pack_wna16(weight_packed, weight_scale, weight_zero_point, scheme.num_bits, scheme.group_size)


def wna16_linear_prepared(x: torch.Tensor, prepared: cpu_quant.WNA16Weight,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] (fp32 / bf16 / fp16) @ dequantize(W)^T (+ bias) -> [T, out] in x's dtype, W from
    `prepare_wna16`."""
    _check_x_and_bias("wna16_linear", x, prepared.in_features, prepared.out_features, bias)
    return cpu_quant.wna16_linear(_rows(x), prepared, None if bias is None else bias.float().contiguous())


def wna16_linear(x, weight_packed, weight_scale, weight_zero_point, scheme: QuantScheme, bias=None) -> torch.Tensor:
    ops.check_wna16_args(x, weight_packed, weight_scale, weight_zero_point, scheme, bias)
    return wna16_linear_prepared(x, prepare_wna16(weight_packed, weight_scale, weight_zero_point, scheme), bias)


# ----------------------------------------------------------------------------- W8A8

def prepare_w8a8(weight: torch.Tensor, weight_scale: torch.Tensor) -> cpu_quant.W8A8Weight:
    """int8 [out, in] + per-channel scale -> the kernel's panels, once per weight."""
    in_features = weight.shape[1] if weight.dim() == 2 else 0
    ops.check_w8a8_args(torch.empty(0, in_features), weight, weight_scale)
    _check_cpu("w8a8_linear", weight, weight_scale)
    return cpu_quant.pack_w8a8(weight, weight_scale)


def w8a8_linear_prepared(x: torch.Tensor, prepared: cpu_quant.W8A8Weight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] -> int8 per token, @ W^T in exact int32 sums, scaled (+ bias) -> [T, out] in x's
    dtype, W from `prepare_w8a8`."""
    _check_x_and_bias("w8a8_linear", x, prepared.in_features, prepared.out_features, bias)
    return cpu_quant.w8a8_linear(_rows(x), prepared, None if bias is None else bias.double().contiguous())


def w8a8_linear(x, weight, weight_scale, bias=None) -> torch.Tensor:
    ops.check_w8a8_args(x, weight, weight_scale, bias)
    return w8a8_linear_prepared(x, prepare_w8a8(weight, weight_scale), bias)
