"""CPU matmuls on prepacked weights: the linear layers of a CPU engine — oneDNN's (what vLLM
calls) or our C++ kernel's (csrc/cpu_gemm.cpp, faster for decode-sized matmuls).

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

Beyond vLLM: at decode sizes oneDNN leaves half the memory bandwidth unused (a 1-row step's
linears read SmolLM2's 538 MB of weights at 8.3 GB/s on a 2-core EPYC, where the machine reads
~17). Our kernel (`cpu_gemm_backend="cpu"`, auto's first choice, fp32) packs each weight into
column panels that one thread streams front to back, and keeps a 4-row x 3-vector tile of the
output in registers: a decode step's linears 2.05x / 1.60x / 1.44x / 1.26x faster than oneDNN's
at 1 / 8 / 32 / 64 rows on a 2-core AVX2 EPYC, 1.47x / 1.33x / 1.20x / 1.15x on a 2-core AVX-512 one,
the same time at 2048 (`python -m benchmarks.bench_cpu_gemm`). The why and the layout: the .cpp's
top comment.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mini_vllm.models.cpu_layer_ops import build as build_extension

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
CPU_GEMMS = ("auto", "cpu", "onednn", "torch")       # EngineConfig.cpu_gemm_backend


class PanelWeight(NamedTuple):
    """A weight packed for our kernel: `panels` [ceil(N / NR), K, NR] fp32 (csrc/cpu_gemm.cpp),
    `out_features` N (the last panel is zero-padded to NR columns)."""
    panels: torch.Tensor
    out_features: int


def load_kernel(isa: str | None = None):
    """The C++ GEMM extension for `isa` (default: this CPU's best), built on first use;
    RuntimeError with the reason when it cannot be. Called on every matmul: after the first
    build it is one dict lookup (no import on the hot path). Panels packed by one variant are
    for that variant only (the panel width is 3 of its vectors)."""
    return build_extension("cpu_gemm", ("cpu_gemm.cpp",), "CPU GEMM kernel", isa=isa)


def kernel_unavailable_reason(weight: torch.Tensor) -> str | None:
    """Why our kernel cannot run this weight (None when it can): fp32 CPU weights and a C++ build."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return f"it runs fp32 CPU weights, got {weight.dtype} on {weight.device}"
    try:
        load_kernel()
    except RuntimeError as e:
        return str(e)
    return None


def pack_panels(weight: torch.Tensor) -> PanelWeight:
    """[out, in] -> the column panels our kernel streams (the last one zero-padded)."""
    return PanelWeight(load_kernel().pack_panels(weight.detach()), weight.shape[0])


def panel_linear(x: torch.Tensor, packed_weight: PanelWeight, bias: torch.Tensor | None,
                 prefetch_next_panel: bool = True) -> torch.Tensor:
    """x [T, in] @ W^T (+ b) -> [T, out] with W packed by `pack_panels`. prefetch_next_panel=False
    (benchmarks: what the prefetch buys) skips fetching each thread's next panel during this one's
    row tiles; the result is bit for bit the same."""
    return load_kernel().panel_gemm(x, packed_weight.panels, bias, packed_weight.out_features, prefetch_next_panel)


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
           packed_weight: torch.Tensor | PanelWeight | None) -> torch.Tensor:
    """The packed matmul when a packed weight exists (ours or oneDNN's), else `F.linear`."""
    if isinstance(packed_weight, PanelWeight):
        return panel_linear(x, packed_weight, bias)
    if packed_weight is not None:
        return packed_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)
