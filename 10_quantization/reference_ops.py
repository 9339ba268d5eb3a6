"""Backend "reference" of ops.py: unpack the integers, dequantize the whole matrix, one matmul
(reference.py's definitions, unchanged)."""
from __future__ import annotations

import torch

from quantization.packing import unpack_int32
from quantization.reference import QuantizedWeight, QuantScheme, linear_reference, w8a8_linear_reference


def wna16_linear(x, weight_packed, weight_scale, weight_zero_point, scheme: QuantScheme, bias=None) -> torch.Tensor:
    q = unpack_int32(weight_packed, scheme.num_bits)
    zero = weight_zero_point if weight_zero_point is not None else torch.zeros(weight_scale.shape, dtype=torch.int8)
    return linear_reference(x, QuantizedWeight(q, weight_scale, zero, scheme), bias)


def w8a8_linear(x, weight, weight_scale, bias=None) -> torch.Tensor:
    return w8a8_linear_reference(x, weight, weight_scale, bias)
