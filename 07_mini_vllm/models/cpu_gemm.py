"""CPU matmuls on prepacked weights (oneDNN): the linear layers of a CPU engine.

Mirrors vLLM's CPU backend: `vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm`
replaces each unquantized linear's matmul, after the weights are loaded, by a oneDNN matmul on
a weight reordered once into oneDNN's blocked layout (`csrc/cpu/dnnl_helper.*`, `onednn_mm`).
PyTorch's inductor does the same for frozen CPU graphs (`torch.ops.mkldnn._reorder_linear_weight`
+ `torch.ops.mkldnn._linear_pointwise`); we call those two ops directly.

Why: `F.linear` on a CPU hands the weight, row-major [out, in], to the BLAS for every call, and
the BLAS repacks tiles of it into the layout its micro-kernel streams. A prefill GEMM amortises
that over thousands of rows; a decode step (1-64 rows) does not: measured on a 2-core EPYC with
SmolLM2's shapes, the packed matmul takes ~0.5x the time of `F.linear` at 8-64 rows and ~0.75x
at 512 (`python -m benchmarks.bench_cpu_gemm`). Packing once at load time moves that work
out of the step loop.

Numerics: fp32 stays fp32 (oneDNN's default fpmath mode is strict: no implicit bf16/tf32), but
the blocked layout sums in another order than MKL, so results differ from `F.linear` in the last
bits — the same kind of difference as between two GEMM libraries, covered by the parity tests.
The packed copy is derived from `weight` once: code that changes `weight` afterwards must call
`pack_linear_weights` again (nothing in the engine does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
CPU_GEMMS = ("auto", "onednn", "torch")       # EngineConfig.cpu_gemm_backend


def onednn_available() -> bool:
    """oneDNN (mkldnn) is compiled into this torch build, with the two ops we use."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def dtype_supported(dtype: torch.dtype) -> bool:
    """oneDNN runs this dtype on THIS CPU: fp32 everywhere; bf16 only with AVX-512 (bw/vl/dq) or
    AVX-NE-CONVERT — on an AVX2-only CPU `_reorder_linear_weight` refuses bf16 weights."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype in PACKABLE_DTYPES


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2 and onednn_available()
            and dtype_supported(weight.dtype))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> an opaque oneDNN tensor in the blocked layout its matmul reads directly."""
    ### BEGIN SOLUTION
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    ### END SOLUTION


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ W^T (+ b) -> [T, out] with W packed by `pack_weight`."""
    ### BEGIN SOLUTION
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    ### END SOLUTION


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed_weight: torch.Tensor | None) -> torch.Tensor:
    """The packed matmul when a packed weight exists, else `F.linear`."""
    if packed_weight is not None:
        return packed_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)
