"""Backend "triton" of ops.py: the quantized matmuls as Triton kernels, on a GPU or on CPU tensors
under TRITON_INTERPRET=1 (tests/conftest.py sets it), the same kernels either way. Arguments are
checked by ops.py (check_wna16_args / check_w8a8_args), the one dispatch point.

WNA16 (`wna16_linear`, `_wna16_kernel`): y = x @ W^T with W never written to memory as floats.
One program per (BLOCK_M tokens, BLOCK_N output rows, K split); each step of its K loop

* loads the [BLOCK_K / PACK, BLOCK_N] int32 words of its tile of the PACKED weight, each word
  once (compressed-tensors' layout: weight_packed [out, in * b / 32], PACK = 32 / b values a
  word, value j of word w is input PACK * w + j, in bits [b j, b j + b), stored unsigned as
  q + 2^(b-1));
* unpacks them in registers (a shift by b j and a mask, broadcast to [BLOCK_K / PACK, PACK,
  BLOCK_N], then reshaped to [BLOCK_K, BLOCK_N]), subtracts the stored zero point
  (2^(b-1) + zero_point, or 2^(b-1) when symmetric) and multiplies by the group's scale: the
  tile never spans two groups (BLOCK_K divides group_size), so that is ONE scale (and zero
  point) per output row per step, a [BLOCK_N] load;
* rounds the weights to the scale's dtype, exactly as reference.dequantize does, and
  accumulates x_tile @ w_tile in fp32 with tl.dot (tensor cores for 16-bit x).
The output is rounded once to x's dtype, after the bias.

Bytes, the point of a weight-only kernel: a decode step (T = 1..16 tokens) is bound by reading
W, and this kernel reads b / 16 of a 16-bit W's bytes (int4: a quarter) plus the scales. What it
does for that:
* split-K (`choose_split_k`): at decode the (token, row) tiles are too few to keep every SM's
  loads in flight (SmolLM2's o_proj: 9 tiles of 64 rows for 132 SMs), so K is cut into splits
  that run in parallel and write fp32 partials [splits, T, out], summed afterwards
  (deterministic, unlike atomics); prefill (T > 16) has tiles enough and does not split;
* BLOCK_M = 16 at decode (tl.dot's minimum): the padding rows cost tensor-core work, which is
  idle at decode anyway, never bytes (their loads are masked off);
* the packed words are loaded as they are stored, one load per word (an earlier version loaded
  each word once per value it holds: 8x the load instructions and 255 registers at int4).
What it does NOT do (vLLM's Marlin / Machete do): reorder the weights offline into the layout
the tensor cores' fragments want (here Triton moves the unpacked tile into the dot's layout,
through shared memory), turn int4 into fp16 with bit tricks (lop3 / magic exponents; here
shift, mask, int -> float, * scale), multiply int4 on the tensor cores, or pipeline by hand
(Triton's num_stages does what it can). Not tuned on a GPU.

When the scales are in x's dtype (a loader keeps them so: vLLM's params_dtype) the weight tile is
in x's dtype and the dot runs on tensor cores; otherwise (say fp32 scales with bf16 x) the tile
is fp32 and the dot is an exact fp32 one ("ieee"): slower, and the same numbers as the reference.

W8A8 (`w8a8_linear`): two kernels, as vLLM's scaled_int8_quant + cutlass_scaled_mm.
* `_quantize_int8_kernel`, one program per token: scale = max|x_t| / 127 (1 for an all-zero
  row) and xq = round(x / scale) with round-half-to-even, as torch.round. Triton has no
  round-half-even of its own: on a GPU it is libdevice's rint (cvt.rni); under the interpreter
  (no libdevice) (v + 1.5 * 2^23) - 1.5 * 2^23, which the fp32 adder itself rounds to the
  nearest even integer for |v| < 2^22 (here |v| is at most about 127). Both divisions are
  IEEE-rounded (div_rn; Triton's `/` is an approximate division on a GPU, div.full.f32), so xq
  and the scale are the reference's bit for bit.
* `_w8a8_kernel`: int8 x int8 -> int32 tl.dot (exact: |sum| < 2^31 for in < 2^17), then
  y = acc * x_scale[t] * w_scale[n] (+ bias) in fp64, in the reference's order, rounded to fp32
  and then to x's dtype, as torch's double -> bf16 / fp16 cast does: the reference's numbers bit
  for bit (launched with enable_fp_fusion=False, so "* w_scale + bias" is not fused into an FMA).
  Its tiles are choose_tiles' and it does not split K: W8A8's gain is int8 tensor-core
  throughput at prefill; at decode it reads 1 byte a weight, int4 WNA16 half that.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from paged_attention.triton_common import dot_precision, interpreting, round_to, upcast
from quantization.reference import QuantScheme

__all__ = ["Tiles", "choose_split_k", "choose_tiles", "quantize_per_token_int8", "w8a8_linear", "wna16_linear"]

DECODE_MAX_T = 16             # up to this many tokens: BLOCK_M = 16 and split-K (a decode batch)
SPLIT_TARGET_PROGRAMS = 256   # split-K aims for about this many programs (2 per SM on an H100, 132 SMs)
MIN_GROUP_SIZE = 16           # BLOCK_K divides the group size and tl.dot needs K >= 16 on a GPU
QUANT_BLOCK = 1024            # inputs per step of the per-token quantization's loops


# ----------------------------------------------------------------------------- launch shapes

@dataclass(frozen=True)
class Tiles:
    """One launch's tile sizes and Triton launch options (not tuned on a GPU)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(T: int, in_features: int, group_size: int | None, dot_fp32: bool = False,
                 min_block_k: int = 16) -> Tiles:
    """Decode (T <= 16): 16 token rows, long K steps (more bytes in flight per program); prefill:
    64 x 64 output tiles. BLOCK_K divides group_size, so a K step is inside one group. An fp32
    dot (no tensor cores) holds its operands in registers: 16-deep K steps, 8 warps at prefill,
    or ptxas spills (tests/10_quantization/test_triton_ops.py compiles these for sm_90)."""
    decode = T <= DECODE_MAX_T
    block_k = 16 if dot_fp32 else 128 if decode else 64
    if group_size is not None:
        block_k = min(block_k, group_size)
    block_k = max(min_block_k, min(block_k, triton.next_power_of_2(max(in_features, 1))))
    return Tiles(block_m=16 if decode else 64, block_n=64, block_k=block_k,
                 num_warps=8 if dot_fp32 and not decode else 4)


def choose_split_k(num_tiles: int, k_steps: int) -> int:
    """How many K ranges each (token, row) tile is cut into: enough for about
    SPLIT_TARGET_PROGRAMS programs, at most one per K step, none when the tiles alone fill the
    GPU. Device-independent, so a CPU test runs the split a GPU would."""
    if num_tiles >= SPLIT_TARGET_PROGRAMS or k_steps <= 1:
        return 1
    return max(1, min(-(-SPLIT_TARGET_PROGRAMS // num_tiles), k_steps))


# ----------------------------------------------------------------------------- WNA16

@triton.jit
def _unpack_tile(words, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """words int32 [K / PACK, N] -> the unsigned b-bit values [K, N], 0 .. 2^b - 1: input
    k = PACK * w + j is value j of word w. The shift is arithmetic (a word with its top bit set
    is negative), so every position needs the mask, not only the lower ones."""
    PACK: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PACK) * BITS                                    # [PACK] bit of value j
    u = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [K / PACK, PACK, N]
    return tl.reshape(u, (BLOCK_K, BLOCK_N))                              # row PACK * w + j


@triton.jit
def _wna16_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,       # zero: int8 (HAS_ZERO); out: [splits, T, N]
    T, N, K, group_size, k_per_split,                           # group_size: K when per channel
    stride_xt, stride_xk, stride_wn, stride_ww, stride_sn, stride_sg, stride_zn, stride_zg, stride_b,
    stride_os, stride_ot, stride_on,
    BITS: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)                                    # which K split
    PACK: tl.constexpr = 32 // BITS                             # values per int32 word
    HALF: tl.constexpr = 1 << (BITS - 1)                        # stored = q + HALF
    ### BEGIN SOLUTION
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)            # [M] tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)            # [N] output rows of W
    in_m = offs_m < T
    in_n = offs_n < N
    k_first = pid_k * k_per_split                               # a multiple of BLOCK_K
    k_end = tl.minimum(k_first + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)                     # [K] inputs
        in_k = offs_k < K                                       # per channel, K need not be a multiple of BLOCK_K
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                     mask=in_m[:, None] & in_k[None, :], other=0.0)                       # [M, K] x's dtype
        offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)     # [K / PACK] the words holding them
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_w[:, None] * stride_ww,
                        mask=(offs_w < K // PACK)[:, None] & in_n[None, :], other=0)      # [K / PACK, N] int32
        u = _unpack_tile(words, BITS, BLOCK_K, BLOCK_N)                                   # [K, N] 0 .. 2^b - 1
        g = k0 // group_size                                    # the tile's one group
        s = tl.load(scale_ptr + offs_n * stride_sn + g * stride_sg, mask=in_n, other=0.0)  # [N] scale's dtype
        if HAS_ZERO:
            z = tl.load(zero_ptr + offs_n * stride_zn + g * stride_zg, mask=in_n, other=0).to(tl.int32)   # [N]
            q = u - (z + HALF)[None, :]                         # q - zero_point, in the stored (unsigned) terms
        else:
            q = u - HALF
        w = q.to(tl.float32) * s.to(tl.float32)[None, :]        # [K, N] = W^T's tile, fp32 as reference.dequantize
        w = round_to(w, scale_ptr.dtype.element_ty, UPCAST)     # ... rounded to the scale's dtype, as it is there
        if DOT_FP32:
            acc += tl.dot(xt.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(xt, w)                                # both in x's dtype: tensor cores, fp32 sums
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_b, mask=in_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_ot + offs_n[None, :] * stride_on,
             round_to(acc, out_ptr.dtype.element_ty, UPCAST), mask=in_m[:, None] & in_n[None, :])
    ### END SOLUTION


def _k_splits(T: int, N: int, K: int, tiles: Tiles, split_k: int | None) -> tuple[int, int]:
    """(splits, K inputs per split): every split a whole number of BLOCK_K steps and none empty.
    Only decode batches split unless the caller asks."""
    k_steps = max(1, triton.cdiv(K, tiles.block_k))
    if split_k is None:
        num_tiles = triton.cdiv(T, tiles.block_m) * triton.cdiv(N, tiles.block_n)
        split_k = choose_split_k(num_tiles, k_steps) if T <= DECODE_MAX_T else 1
    steps_per_split = triton.cdiv(k_steps, split_k)
    return triton.cdiv(k_steps, steps_per_split), steps_per_split * tiles.block_k


def wna16_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_zero_point: torch.Tensor | None, scheme: QuantScheme, bias: torch.Tensor | None = None,
                 *, split_k: int | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """x [T, in] @ dequantize(weight_packed)^T (+ bias) -> [T, out] in x's dtype (ops.py's contract).
    split_k / tiles: None chooses (choose_split_k / choose_tiles); tests pass them to reach every path."""
    T, K = x.shape
    N = weight_packed.shape[0]
    group_size = scheme.group_size or K                         # per channel: one group of K inputs
    if scheme.group_size is not None and scheme.group_size < MIN_GROUP_SIZE:
        raise ValueError(f"the Triton kernel needs group_size >= {MIN_GROUP_SIZE} (one group per K step), "
                         f"got {scheme.group_size}; use backend='torch'")
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    # The weights enter the dot in x's dtype (tensor cores) only when that is the scales' dtype,
    # since the reference's W is rounded to the scales' dtype; else both operands in fp32.
    dot_fp32 = x.dtype == torch.float32 or weight_scale.dtype != x.dtype
    tiles = tiles or choose_tiles(T, K, scheme.group_size, dot_fp32)
    if scheme.group_size is not None and scheme.group_size % tiles.block_k:
        raise ValueError(f"BLOCK_K {tiles.block_k} must divide group_size {scheme.group_size}")
    splits, k_per_split = _k_splits(T, N, K, tiles, split_k)
    # Split: fp32 partials [splits, T, N], the bias and the rounding after their sum; else y itself.
    out = y.unsqueeze(0) if splits == 1 else torch.empty(splits, T, N, dtype=torch.float32, device=x.device)
    has_bias = bias is not None and splits == 1
    zero = weight_zero_point if weight_zero_point is not None else weight_scale     # a placeholder, never read
    grid = (triton.cdiv(T, tiles.block_m), triton.cdiv(N, tiles.block_n), splits)
    _wna16_kernel[grid](
        x, weight_packed, weight_scale, zero, bias if has_bias else y, out,
        T, N, K, group_size, k_per_split,
        *x.stride(), *weight_packed.stride(), *weight_scale.stride(), *zero.stride(),
        bias.stride(0) if has_bias else 0, *out.stride(),
        BITS=scheme.num_bits, HAS_ZERO=weight_zero_point is not None, HAS_BIAS=has_bias,
        # under the interpreter 16-bit dots are done in fp32 (triton_common.upcast), with the GPU's tiles
        DOT_FP32=dot_fp32 or upcast(x.dtype), PRECISION=dot_precision(torch.float32 if dot_fp32 else x.dtype),
        UPCAST=interpreting(), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if splits == 1:
        return y
    total = out.sum(dim=0)                                      # [T, N] fp32: deterministic, unlike atomics
    if bias is not None:
        total += bias.float()
    return total.to(x.dtype)


# ----------------------------------------------------------------------------- W8A8

@triton.jit
def _round_half_even(v, GPU_MATH: tl.constexpr):
    """fp32 v (|v| < 2^22) -> the nearest integer, ties to even (torch.round), still fp32."""
    if GPU_MATH:
        r = libdevice.rint(v)                                   # cvt.rni: round to nearest even
    else:
        # In [2^23, 2^24) fp32 steps are 1: adding 1.5 * 2^23 (even) makes the adder round v to an
        # integer, to nearest even; subtracting it back is exact. (floor(v + 0.5) is wrong twice:
        # ties go up, and 0.49999997 + 0.5 rounds to 1.0.)
        r = (v + 12582912.0) - 12582912.0
    return r


@triton.jit
def _quantize_int8_kernel(
    x_ptr, xq_ptr, scale_ptr,                                   # xq int8 [T, K], scale fp32 [T]
    K, stride_xt, stride_xk, stride_qt,
    BLOCK: tl.constexpr, GPU_MATH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ### BEGIN SOLUTION
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)                 # running max|x| per lane
    for k0 in range(0, K, BLOCK):
        xv = tl.load(x_ptr + t * stride_xt + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(xv.to(tl.float32)))
    absmax = tl.max(amax, axis=0)
    scale = tl.where(absmax == 0.0, 1.0, tl.math.div_rn(absmax, 127.0))   # an all-zero row: scale 1
    for k0 in range(0, K, BLOCK):                               # second pass: the row is in cache
        xv = tl.load(x_ptr + t * stride_xt + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0)
        q = _round_half_even(tl.math.div_rn(xv.to(tl.float32), scale), GPU_MATH)
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
        tl.store(xq_ptr + t * stride_qt + k0 + offs, q.to(tl.int8), mask=k0 + offs < K)
    tl.store(scale_ptr + t, scale)
    ### END SOLUTION


@triton.jit
def _w8a8_kernel(
    xq_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr,          # xq int8 [T, K], w int8 [N, K], xs fp32 [T], ws [N]
    T, N, K,
    stride_qt, stride_qk, stride_wn, stride_wk, stride_ws, stride_b, stride_ot, stride_on,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ### BEGIN SOLUTION
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)            # [M] tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)            # [N] output rows
    in_m = offs_m < T
    in_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        a = tl.load(xq_ptr + offs_m[:, None] * stride_qt + offs_k[None, :] * stride_qk,
                    mask=in_m[:, None] & in_k[None, :], other=0)                          # [M, K] int8
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=in_k[:, None] & in_n[None, :], other=0)                          # [K, N] int8 = W^T
        acc += tl.dot(a, b)                                     # int8 x int8 -> int32: exact
    xs = tl.load(xs_ptr + offs_m, mask=in_m, other=0.0).to(tl.float64)                   # [M]
    ws = tl.load(ws_ptr + offs_n * stride_ws, mask=in_n, other=0.0).to(tl.float64)       # [N]
    y = acc.to(tl.float64) * xs[:, None] * ws[None, :]          # (acc * x_scale) * w_scale: the reference's order
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n * stride_b, mask=in_n, other=0.0).to(tl.float64)[None, :]
    out = round_to(y.to(tl.float32), out_ptr.dtype.element_ty, UPCAST)   # double -> float -> dtype, as torch
    tl.store(out_ptr + offs_m[:, None] * stride_ot + offs_n[None, :] * stride_on, out,
             mask=in_m[:, None] & in_n[None, :])
    ### END SOLUTION


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.quantize_per_token_int8 as a kernel: x [T, in] -> (xq int8 [T, in], scale fp32 [T, 1])."""
    T, K = x.shape
    xq = torch.empty(T, K, dtype=torch.int8, device=x.device)
    scale = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    if T == 0:
        return xq, scale
    _quantize_int8_kernel[(T,)](
        x, xq, scale, K, *x.stride(), xq.stride(0),
        BLOCK=min(QUANT_BLOCK, triton.next_power_of_2(max(K, 1))), GPU_MATH=not interpreting(),
    )
    return xq, scale


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, tiles: Tiles | None = None) -> torch.Tensor:
    """x [T, in] float, weight int8 [out, in], weight_scale [out, 1] -> y [T, out] in x's dtype:
    reference.w8a8_linear_reference's numbers."""
    T, K = x.shape
    N = weight.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    xq, x_scale = quantize_per_token_int8(x)                    # [T, K] int8, [T, 1] fp32
    tiles = tiles or choose_tiles(T, K, None, min_block_k=32)   # int8 dots: K >= 32 on a GPU
    ws = weight_scale.reshape(-1)                               # [N]
    grid = (triton.cdiv(T, tiles.block_m), triton.cdiv(N, tiles.block_n))
    _w8a8_kernel[grid](
        xq, weight, x_scale, ws, bias if bias is not None else y, y,
        T, N, K, *xq.stride(), *weight.stride(), ws.stride(0), bias.stride(0) if bias is not None else 0, *y.stride(),
        HAS_BIAS=bias is not None, UPCAST=interpreting(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        enable_fp_fusion=False,                                 # (acc * xs * ws) + bias: two roundings, as torch
    )
    return y
