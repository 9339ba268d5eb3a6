"""CPU matmuls on prepacked weights: the linear layers of a CPU engine — oneDNN's (what vLLM
calls) or our C++ kernel's (csrc/gemm.cpp, faster for decode-sized matmuls).

    from kernels_cpu import gemm
    packed = gemm.pack_panels(weight)                 # ours: [out, in] -> column panels, once
    y = gemm.panel_linear(x, packed, bias)            # x [T, in] -> [T, out]
    packed = gemm.pack_weight(weight)                 # oneDNN's blocked layout, once
    y = gemm.packed_linear(x, packed, bias)

The engine picks one per model after loading (mini_vllm.models.linear_method: its linear methods
call these).

Mirrors vLLM's CPU backend: `vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm`
replaces each unquantized linear's matmul, after the weights are loaded, by a oneDNN matmul on
a weight reordered once into oneDNN's blocked layout (`csrc/cpu/dnnl_helper.*`, `onednn_mm`).
PyTorch's inductor does the same for frozen CPU graphs (`torch.ops.mkldnn._reorder_linear_weight`
+ `torch.ops.mkldnn._linear_pointwise`); we call those two ops directly.

Why: `F.linear` on a CPU hands the weight, row-major [out, in], to the BLAS for every call, and
the BLAS repacks tiles of it into the layout its micro-kernel streams. A prefill GEMM amortises
that over thousands of rows; a decode step (1-64 rows) does not. Packing once at load time moves
that work out of the step loop (`python -m benchmarks.bench_cpu_gemm` times both).

Numerics: fp32 stays fp32 (oneDNN's default fpmath mode is strict: no implicit bf16/tf32), but
the blocked layout sums in another order than MKL, so results differ from `F.linear` in the last
bits — the same kind of difference as between two GEMM libraries, covered by the parity tests.
The packed copy is derived from `weight` once: code that changes `weight` afterwards must call
the packing again (nothing in the engine does).

Beyond vLLM: at decode sizes oneDNN reads the weights well below the machine's memory bandwidth.
Our kernel (the engine's `cpu_gemm_backend="cpu"`, auto's first choice, fp32) packs each weight
into column panels that one thread streams front to back, and keeps a 4-row x 3-vector tile of
the output in registers; `python -m benchmarks.bench_cpu_gemm` times it against oneDNN and
`F.linear` (kernels_cpu/README.md has the results). The why and the layout: the .cpp's top
comment (`python -m kernels_cpu.dev.gemm` rebuilds it without its next-panel prefetch and times
both).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels_cpu import build

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
SOURCES = ("gemm.cpp",)                              # + vec.h
WHAT = "CPU GEMM kernel"


class PanelWeight(NamedTuple):
    """A weight packed for our kernel: `panels` [ceil(N / NR), K, NR] fp32 (csrc/gemm.cpp),
    `out_features` N (the last panel is zero-padded to NR columns)."""
    panels: torch.Tensor
    out_features: int


def load_kernel(isa: str | None = None):
    """The C++ GEMM extension for `isa` (default: this CPU's best), built on first use;
    RuntimeError with the reason when it cannot be. Called on every matmul: after the first
    build it is one dict lookup (no import on the hot path). Panels packed by one variant are
    for that variant only (the panel width is 3 of its vectors)."""
    return build.load_extension("cpu_gemm", SOURCES, WHAT, isa)


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
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ W^T (+ b) -> [T, out] with W packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
