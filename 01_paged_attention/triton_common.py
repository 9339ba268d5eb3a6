"""Triton building blocks every attention kernel of the project calls: chapter 01's decode
and prefill kernels and chapter 05's unified attention. One copy, one numerics convention.

* `online_softmax_update`: fold one tile of keys into a running softmax state (m, l, acc)
  — the heart of FlashAttention / PagedAttention; a kernel only decides WHICH keys a tile
  holds (through the block table) and which of them each query may see.
* `round_to`: fp32 -> a 16-bit dtype, rounding to nearest even as the GPU does, also under
  the Triton interpreter (whose fp32 -> bf16 cast truncates).

The split-KV reductions (chapter 01's `_split_kv_reduce_kernel`, chapter 05's
`reduce_segments`) merge partial states with weights 2^(m_s - M), in the same log2 units.

Numerics convention (every kernel follows it; the reference computes in fp32):
* scores are in log2 units: s = (q . k) * scale * log2(e), so the kernel uses exp2 (one
  instruction on a GPU; exp is exp2 plus a multiply). The running max m is in log2 units
  too, which matters wherever partial states are merged.
* scores, the running max m, the normaliser l and the accumulator are fp32.
* p = 2^(s - m) is ROUNDED to V's dtype before p @ V (as FlashAttention does, so the
  product runs on tensor cores), and l sums those same rounded p. The output
  acc / l then divides by exactly the weights the numerator used: with V == 1 every output
  is exactly 1 in fp16/bf16. (vLLM's triton_unified_attention adds the unrounded p to l;
  the two differ by less than one ulp of the 16-bit output.)
* a row that has seen no visible key yet keeps m = -inf and l = 0; subtracting 0 instead of
  -inf keeps exp2 at 0 rather than NaN (padding rows, empty split-KV ranges).
* under the interpreter 16-bit dots are done in fp32 (`UPCAST`), because the interpreter's
  bf16 `tl.dot` is wrong; the values were already rounded to the 16-bit dtype, so only the
  accumulation order differs from a GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634    # scale * LOG2E turns natural-log scores into log2 units


def interpreting() -> bool:
    """True when kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast(dtype: torch.dtype) -> bool:
    """The UPCAST constexpr: do 16-bit dots in fp32 (interpreter only; see the module doc)."""
    return interpreting() and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots must be "ieee": on a GPU fp32 tl.dot defaults to TF32 (10-bit mantissa) and
    misses the fp32 tolerance. 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def round_to(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 x -> dtype, rounding to nearest even like the GPU's cvt.rn.

    The interpreter casts fp32 -> bf16 by truncation (0.99999994 -> 0.99609375, a whole
    bf16 ulp low), so when interpreting bf16 the fp32 bits are rounded here first and the
    cast then only drops zeros.
    """
    if UPCAST:
        if dtype == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536      # keep the top 16 bits, rounded
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def online_softmax_update(
    acc, m_i, l_i,                 # running state: [M, D] fp32, [M] fp32 (log2 units), [M] fp32
    s,                             # [M, N] fp32 scores of this tile in log2 units; -inf = not visible
    v,                             # [N, D] this tile's values, in the cache dtype (masked rows: 0)
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step: rescale what was summed under the old max, add this tile.

    Returns the new (acc, m, l); the final output of a row is acc / l (0 when l == 0).
    """
    ### BEGIN SOLUTION
    m_new = tl.maximum(m_i, tl.max(s, 1))                         # [M]
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)         # no visible key yet: keep exp2 at 0
    alpha = tl.exp2(m_i - m_sub)                                  # [M] rescales the old state
    p = round_to(tl.exp2(s - m_sub[:, None]), v.dtype, UPCAST)    # [M, N] rounded to V's dtype
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)               # sums the SAME rounded p as the dot
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    ### END SOLUTION
    return acc, m_new, l_i
