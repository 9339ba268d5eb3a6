"""Backend "torch" of ops.py: the quantized matmuls in vectorized PyTorch, on any device.

It dequantizes the whole weight before multiplying, so it reads MORE bytes than the unquantized
matmul (the packed weight, then a float copy of it): correct everywhere, fast nowhere. The
kernels (Triton, C++) exist because the saving only comes when the integers are turned into
floats in registers, inside the matmul, and never written back to memory.

W8A8 multiplies the int8 matrices as they are: torch's `_int_mm` where it runs (CUDA; int32
sums), else the integers as fp64, whose 53-bit mantissa holds every partial sum of int8
products exactly for in < 2^38.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quantization.packing import unpack_int32
from quantization.reference import QuantScheme, quantize_per_token_int8

__all__ = ["dequantize_packed", "w8a8_linear", "wna16_linear"]


def dequantize_packed(weight_packed, weight_scale, weight_zero_point, scheme: QuantScheme,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int32 [out, in * b / 32] -> W [out, in] in `dtype` (computed in fp32)."""
    q = unpack_int32(weight_packed, scheme.num_bits).float()            # [out, in]
    out_features, in_features = q.shape
    groups = weight_scale.shape[1]
    q = q.reshape(out_features, groups, in_features // groups)
    if weight_zero_point is not None:
        q = q - weight_zero_point.float().unsqueeze(-1)
    return (q * weight_scale.float().unsqueeze(-1)).reshape(out_features, in_features).to(dtype)


def wna16_linear(x, weight_packed, weight_scale, weight_zero_point, scheme: QuantScheme, bias=None) -> torch.Tensor:
    w = dequantize_packed(weight_packed, weight_scale, weight_zero_point, scheme)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def w8a8_linear(x, weight, weight_scale, bias=None) -> torch.Tensor:
    xq, x_scale = quantize_per_token_int8(x)                              # [T, in] int8, [T, 1]
    if x.is_cuda and x.shape[0] > 16:                                     # _int_mm needs T > 16
        acc = torch._int_mm(xq, weight.t()).double()
    else:
        acc = xq.double() @ weight.double().t()
    y = acc * x_scale.double() * weight_scale.reshape(1, -1).double()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
