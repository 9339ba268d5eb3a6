"""The decoder's small per-layer ops as fused Triton kernels: RMSNorm (+ the residual add),
SiLU-and-mul, and RoPE on q and k (with v's copy) in one launch. The `forward_cuda` of the layers
in layers.py / llama.py (CustomOp: bound to platform "cuda" by chapter 07's loader on a GPU).

Why: written as PyTorch (forward_native, HF's math op for op) each of these is 3-8 kernels: casts,
pow, mean, rsqrt, mul, chunk, cat... each a full read and write of the activations and a launch.
Fused, each is one pass: the activations are read once and written once. vLLM has the same three
(csrc/layernorm_kernels.cu: `rms_norm`, `fused_add_rms_norm`; csrc/activation_kernels.cu:
`silu_and_mul`; csrc/pos_encoding_kernels.cu: `rotary_embedding`), reached through
`CustomOp.forward_cuda` of `RMSNorm`, `SiluAndMul` and `RotaryEmbedding` (ours: `QKRotation`).

Numerics: every kernel computes in fp32 and rounds to the model dtype exactly where the PyTorch
forward rounds (the comments say where), so the result is forward_native's bit for bit except:
  * RMSNorm's mean(x^2): a different summation order, so the fp32 variance (and through it the
    output) may differ in the last bits (fp32: ~1e-7 relative; bf16/fp16: now and then 1 ulp);
  * on a GPU, rsqrt and exp are libdevice's __nv_rsqrtf / __nv_expf, which torch's CUDA kernels
    call too; under the interpreter they are numpy's, and torch's CPU exp may differ by an ulp.
Kernels are launched with `enable_fp_fusion=False`: torch runs x*c and +y as separate kernels,
each rounded, so fusing them into one FMA would round differently (RoPE is then bit-exact).

CUDA graphs: no host reads (.item()), no data-dependent shapes; every launch's grid depends only
on the input shapes, and outputs are allocated as torch would (same shapes, same dtype).

Under the Triton interpreter (CPU tests) the fp32 -> bf16 cast truncates, so bf16 rounding goes
through triton_common.round_to, as in the attention kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from paged_attention.triton_common import interpreting, round_to

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
SILU_BLOCK = 1024                      # elements of I per SiLU-and-mul program (4 warps)


def _launch_options() -> dict:
    """Keyword options of every launch: no FMA contraction (the interpreter ignores the option)."""
    return {"enable_fp_fusion": False}


def _warps(num_elements: int) -> int:
    """4 warps per 1024 fp32 values held, 1..8: each thread keeps ~8 values in registers."""
    return max(1, min(8, num_elements // 256))


# ----------------------------------------------------------------------------- RMSNorm

@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    rows_per_group,                                 # x viewed as [groups, rows_per_group, N]
    stride_x_g, stride_x_r, stride_res_row, stride_out_g, stride_out_r,
    eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    UPCAST: tl.constexpr, GPU_MATH: tl.constexpr,
):
    """One program per row: (residual += x), out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)."""
    row = tl.program_id(0)
    g = row // rows_per_group
    r = row % rows_per_group
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x_row = x_ptr + g.to(tl.int64) * stride_x_g + r.to(tl.int64) * stride_x_r
    out_row = out_ptr + g.to(tl.int64) * stride_out_g + r.to(tl.int64) * stride_out_r
    ### BEGIN SOLUTION
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    dtype = x.dtype
    h = x.to(tl.float32)
    if HAS_RESIDUAL:                                            # residual.add_(x), rounded to the model dtype
        res_row = residual_ptr + row.to(tl.int64) * stride_res_row
        res = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
        s = round_to(res + h, dtype, UPCAST)
        tl.store(res_row + offs, s, mask=mask)
        h = s.to(tl.float32)
    variance = tl.sum(h * h, axis=0) * (1.0 / N)               # mean(x^2) in fp32 (torch CUDA: sum * (1/N))
    if GPU_MATH:
        rstd = libdevice.rsqrt(variance + eps)                  # __nv_rsqrtf, torch.rsqrt's on CUDA
    else:
        rstd = tl.math.rsqrt(variance + eps)
    normed = round_to(h * rstd, dtype, UPCAST).to(tl.float32)   # (h * rsqrt(...)).to(dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = round_to(w * normed, out_ptr.dtype.element_ty, UPCAST)  # weight * normed, in the promoted dtype
    tl.store(out_row + offs, out, mask=mask)
    ### END SOLUTION


def _as_groups(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x [rows, N] or [A, B, N] (last dim contiguous) -> (groups, rows_per_group, stride_g, stride_r)."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, N] or [T, heads, N] (any strides but the last) -> RMSNorm(x), a new contiguous tensor
    of dtype promote(weight, x). With residual ([T, N] like x, rows contiguous): residual += x in
    place first, and the norm is of the sum (RMSNorm.forward_native's fused add)."""
    N = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != (N,) or weight.stride(0) != 1:
        raise ValueError(f"rms_norm takes x [rows, N] or [A, B, N] with a contiguous last dim and weight [N]; "
                         f"got x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or x.dim() != 2
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [rows, N] like x with x's dtype, got {tuple(residual.shape)} "
                         f"{residual.dtype} for x {tuple(x.shape)} {x.dtype}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    groups, per_group, stride_g, stride_r = _as_groups(x)
    _, _, stride_og, stride_or = _as_groups(out)
    rows = groups * per_group
    if rows == 0:
        return out
    block_n = triton.next_power_of_2(N)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, per_group, stride_g, stride_r,
        residual.stride(0) if residual is not None else 0, stride_og, stride_or, eps,
        N=N, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None, UPCAST=interpreting(),
        GPU_MATH=not interpreting(), num_warps=_warps(block_n), **_launch_options())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), the sum written into `residual` in place and
    returned as that same tensor (RMSNorm.forward_native's contract; vLLM: fused_add_rms_norm)."""
    return rms_norm(x, weight, eps, residual), residual


# ----------------------------------------------------------------------------- SiLU and mul

@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x_row, stride_out_row,
    I,                                               # x [T, 2I] = [gate | up], out [T, I]
    BLOCK: tl.constexpr, UPCAST: tl.constexpr, GPU_MATH: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    x_row = x_ptr + row.to(tl.int64) * stride_x_row
    ### BEGIN SOLUTION
    gate = tl.load(x_row + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    up = tl.load(x_row + I + offs, mask=mask, other=0.0).to(tl.float32)
    if GPU_MATH:
        e = libdevice.exp(-g)                                    # __nv_expf, as torch's CUDA silu
    else:
        e = tl.exp(-g)
    silu = round_to(tl.math.div_rn(g, 1.0 + e), dtype, UPCAST).to(tl.float32)   # F.silu(gate): x / (1 + exp(-x))
    out = round_to(silu * up, dtype, UPCAST)                     # * up, in the model dtype
    tl.store(out_ptr + row.to(tl.int64) * stride_out_row + offs, out, mask=mask)
    ### END SOLUTION


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up, [T, I] (a new tensor)."""
    if x.dim() != 2 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul takes x [T, 2I] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    T, I = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, I, dtype=x.dtype, device=x.device)
    if T == 0 or I == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(I))
    _silu_and_mul_kernel[(T, triton.cdiv(I, block))](
        x, out, x.stride(0), out.stride(0), I, BLOCK=block, UPCAST=interpreting(), GPU_MATH=not interpreting(),
        num_warps=_warps(block), **_launch_options())
    return out


# ----------------------------------------------------------------------------- RoPE

@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, cos_row, sin_row, stride_x_t, stride_x_h, t, offs_h, offs_d,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[t, h] = x * cos + cat(-x2, x1) * sin for every head h of token t (apply_rotary_emb)."""
    ### BEGIN SOLUTION
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)           # [BLOCK_H, BLOCK_HALF]
    x1_ptrs = x_ptr + t.to(tl.int64) * stride_x_t + offs_h[:, None] * stride_x_h + offs_d[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    dmask = offs_d < HALF
    c1 = tl.load(cos_row + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    # Each product rounded to the model dtype, then the sum: torch's x * cos + rotate_half(x) * sin.
    o1 = round_to(round_to(x1 * c1, dtype, UPCAST).to(tl.float32)
                  + round_to(-x2 * s1, dtype, UPCAST).to(tl.float32), dtype, UPCAST)
    o2 = round_to(round_to(x2 * c2, dtype, UPCAST).to(tl.float32)
                  + round_to(x1 * s2, dtype, UPCAST).to(tl.float32), dtype, UPCAST)
    out_ptrs = out_ptr + t.to(tl.int64) * (NUM_HEADS * 2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(out_ptrs, o1, mask=mask)
    tl.store(out_ptrs + HALF, o2, mask=mask)
    ### END SOLUTION


@triton.jit
def _rotary_embedding_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_cos_t, stride_sin_t,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_V: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program per token: rotate all its q heads and k heads (and copy its v heads)."""
    t = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_HALF)
    cos_row = cos_ptr + t.to(tl.int64) * stride_cos_t
    sin_row = sin_ptr + t.to(tl.int64) * stride_sin_t
    _rotate_heads(q_ptr, q_out_ptr, cos_row, sin_row, stride_q_t, stride_q_h, t, tl.arange(0, BLOCK_HQ), offs_d,
                  NUM_HEADS, HALF, UPCAST)
    _rotate_heads(k_ptr, k_out_ptr, cos_row, sin_row, stride_k_t, stride_k_h, t, tl.arange(0, BLOCK_HK), offs_d,
                  NUM_KV_HEADS, HALF, UPCAST)
    if HAS_V:                                                    # v.contiguous(), in the same pass
        offs_h = tl.arange(0, BLOCK_HK)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HALF)
        src = v_ptr + t.to(tl.int64) * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :]
        dst = v_out_ptr + t.to(tl.int64) * (NUM_KV_HEADS * 2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
        tl.store(dst + HALF, tl.load(src + HALF, mask=mask), mask=mask)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     v: torch.Tensor | None = None):
    """q [T, H, D], k [T, KVH, D] (any strides but the last), cos/sin [T, D] or [T, 1, D] (the
    model's `RotaryEmbedding.cos_sin(positions)`) -> (apply_rotary_emb(q, cos, sin),
    apply_rotary_emb(k, cos, sin)) as new contiguous tensors, in one launch; with v [T, KVH, D]
    also v.contiguous() -> (q, k, v). Neox layout: dims (i, i + D/2) are a pair. Every element is
    computed as apply_rotary_emb computes it, cos[i] and sin[i] read at each i (no assumption that
    the two halves of cos/sin are equal), so any table RotaryEmbedding builds (default, linear,
    llama3 scaling) is covered. D must be even."""
    T, H, D = q.shape
    KVH = k.shape[1]
    cos2, sin2 = cos.reshape(T, cos.shape[-1]), sin.reshape(T, sin.shape[-1])
    tensors = (q, k) + ((v,) if v is not None else ())
    if (D % 2 or k.shape != (T, KVH, D) or (v is not None and v.shape != k.shape)
            or any(x.stride(-1) != 1 or x.dtype != q.dtype for x in tensors)
            or cos2.shape != (T, D) or sin2.shape != (T, D) or cos2.stride(1) != 1 or sin2.stride(1) != 1
            or cos2.dtype != q.dtype or sin2.dtype != q.dtype):
        raise ValueError(f"rotary_embedding takes q [T, H, D], k (and v) [T, KVH, D] and cos/sin [T, D] of one dtype "
                         f"with contiguous last dims, D even; got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}")
    q_out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, KVH, D, dtype=k.dtype, device=k.device)
    v_out = torch.empty(T, KVH, D, dtype=k.dtype, device=k.device) if v is not None else None
    if T > 0:
        half = D // 2
        block_hq, block_hk, block_half = (triton.next_power_of_2(n) for n in (H, KVH, half))
        vv = v if v is not None else k
        _rotary_embedding_kernel[(T,)](
            q, k, vv, cos2, sin2, q_out, k_out, v_out if v_out is not None else k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
            cos2.stride(0), sin2.stride(0),
            NUM_HEADS=H, NUM_KV_HEADS=KVH, HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
            HAS_V=v is not None, UPCAST=interpreting(), num_warps=_warps(block_hq * block_half * 2),
            **_launch_options())
    return (q_out, k_out) if v is None else (q_out, k_out, v_out)
