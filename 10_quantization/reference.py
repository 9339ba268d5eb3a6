"""Integer weights (and activations) in plain PyTorch: the oracle every quantizer and kernel of
chapter 10 is checked against (backend "reference").

A decode step reads every weight once to make one token per request: at batch 1 the matmuls are
bound by the bytes they read, not by the flops. Storing W in b bits instead of 32 divides those
bytes by 32 / b (int8: 4x fewer than fp32, int4: 8x), and a kernel that multiplies straight from
the small integers (dequantizing in registers) runs that much closer to the memory's limit.

The scheme, in compressed-tensors' words (the format llmcompressor writes and vLLM reads,
`compressed_tensors/quantization/quant_args.py: QuantizationArgs`):

    num_bits   b = 4 or 8, type "int": q in [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1]
    strategy   "channel": one scale per output row            scale [out, 1]
               "group":   one per row per group_size inputs    scale [out, in / group_size]
    symmetric  zero_point = 0;  otherwise an integer zero_point of the scale's shape

    q = clamp(round(w / scale) + zero_point, qmin, qmax)         quantize
    w ~ (q - zero_point) * scale                                  dequantize

and the scale of a group g (its weights w_g, min / max taken with 0 so that 0 is exact):
    symmetric    scale = max|w_g| / ((qmax - qmin) / 2)           int4: max / 7.5,  int8: max / 127.5
    asymmetric   scale = (max(w_g, 0) - min(w_g, 0)) / (qmax - qmin),
                 zero_point = qmin - round(min(w_g, 0) / scale)
(compressed_tensors/quantization/utils/helpers.py: calculate_qparams; GPTQ's `Quantizer` uses
the same symmetric grid). This is round-to-nearest (RTN), the baseline GPTQ and AWQ improve on:
they change WHICH integers are stored (gptq.py, awq.py), not what the integers mean.

Activations (W8A8): each token's row of x quantized on the fly to int8 with its own scale
(vLLM: `_custom_ops.scaled_int8_quant(x)`, dynamic per-token, symmetric, scale = max|x_t| / 127),
the product accumulated in int32 and scaled back once:

    y[t, n] = (sum_k xq[t, k] * wq[n, k]) * x_scale[t] * w_scale[n]  (+ bias[n])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantScheme", "QuantizedWeight", "compute_qparams", "dequantize", "linear_reference",
           "quantize", "quantize_per_token_int8", "quantize_rtn", "w8a8_linear_reference"]

SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class QuantScheme:
    """How one weight matrix is quantized. group_size None: per channel (one scale per row)."""
    num_bits: int = 4
    symmetric: bool = True
    group_size: int | None = 128

    def __post_init__(self):
        if self.num_bits not in SUPPORTED_BITS:
            raise ValueError(f"num_bits {self.num_bits} is not supported (int{'/int'.join(map(str, SUPPORTED_BITS))} only)")
        if self.group_size is not None and (self.group_size <= 0 or self.group_size & (self.group_size - 1)):
            raise ValueError(f"group_size {self.group_size} must be a positive power of two (or None: per channel)")

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    @property
    def strategy(self) -> str:
        return "channel" if self.group_size is None else "group"

    def groups(self, in_features: int) -> int:
        """Scales per row for a weight with `in_features` columns."""
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {self.group_size}")
        return in_features // self.group_size


@dataclass
class QuantizedWeight:
    """q int8 [out, in] (the integers, unpacked), scale [out, groups] float, zero_point int8
    [out, groups] (all zeros when symmetric)."""
    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    scheme: QuantScheme

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero_point, self.scheme)


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """w [out, in] -> [out, groups, columns per group] (a view)."""
    out_features, in_features = w.shape
    groups = scheme.groups(in_features)
    return w.reshape(out_features, groups, in_features // groups)


def compute_qparams(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN's scale [out, groups] (w's dtype) and zero_point int8 [out, groups] for w [out, in]."""
    ### BEGIN SOLUTION
    g = _grouped(w.float(), scheme)
    lo = g.amin(dim=-1).clamp(max=0)                     # 0 must stay exactly representable
    hi = g.amax(dim=-1).clamp(min=0)
    span = float(scheme.qmax - scheme.qmin)              # 15 for int4, 255 for int8
    if scheme.symmetric:
        scale = torch.maximum(lo.abs(), hi) / (span / 2)
        zero = torch.zeros_like(scale)
    else:
        scale = (hi - lo) / span
    empty = scale == 0                                   # an all-zero group: q = 0 on any grid is exact
    scale = torch.where(empty, torch.ones_like(scale), scale)
    if not scheme.symmetric:
        zero = (scheme.qmin - torch.round(lo / scale)).clamp(scheme.qmin, scheme.qmax)
        zero = torch.where(empty, torch.zeros_like(zero), zero)
    ### END SOLUTION
    return scale.to(w.dtype), zero.to(torch.int8)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """w [out, in] -> q int8 [out, in]: clamp(round(w / scale) + zero_point, qmin, qmax), each group
    with its own scale and zero point. Divides in fp32 (the scale is rounded to w's dtype first, as
    stored)."""
    g = _grouped(w.float(), scheme)
    q = torch.round(g / scale.float().unsqueeze(-1)) + zero_point.float().unsqueeze(-1)
    return q.clamp(scheme.qmin, scheme.qmax).to(torch.int8).reshape(w.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, scheme: QuantScheme,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """q int8 [out, in] -> (q - zero_point) * scale [out, in] in `dtype` (default: scale's)."""
    ### BEGIN SOLUTION
    g = _grouped(q.float(), scheme)
    w = (g - zero_point.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    ### END SOLUTION
    return w.reshape(q.shape).to(dtype or scale.dtype)


def quantize_rtn(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest: every weight to its nearest grid point, each group on its own grid."""
    scale, zero = compute_qparams(w, scheme)
    return QuantizedWeight(quantize(w, scale, zero, scheme), scale, zero, scheme)


def linear_reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only quantization (WNA16): y = x @ dequantize(W)^T (+ bias), x [T, in] -> [T, out],
    computed in fp32 and rounded once to x's dtype. What every dequantize-and-matmul kernel
    computes, up to the order of its sums."""
    w = weight.dequantize().float()
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] -> (xq int8 [T, in], scale float32 [T, 1]): each row on its own symmetric grid,
    scale = max|x_t| / 127 (an all-zero row gets scale 1). vLLM: scaled_int8_quant, dynamic."""
    ### BEGIN SOLUTION
    absmax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(absmax == 0, torch.ones_like(absmax), absmax / 127.0)
    xq = torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8)
    ### END SOLUTION
    return xq, scale


def w8a8_linear_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: x [T, in] float, wq int8 [out, in], w_scale [out] or [out, 1] float -> y [T, out] in
    x's dtype. The activations are quantized per token, the integer products summed exactly (in
    int64 here; int32 in a kernel, which cannot overflow for in < 2^17), and scaled once."""
    xq, x_scale = quantize_per_token_int8(x)
    acc = xq.to(torch.int64) @ wq.to(torch.int64).t()                       # [T, out], exact
    y = acc.double() * x_scale.double() * w_scale.reshape(1, -1).double()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
