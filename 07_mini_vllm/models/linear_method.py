"""How a linear layer computes x @ W^T (+ b): the one seam between the model code and the CPU GEMMs.

Mirrors vLLM: a linear layer's forward calls `self.quant_method.apply(self, x, bias)`
(`vllm/model_executor/layers/linear.py: LinearMethodBase`), whose unquantized method is plain
`F.linear` (`UnquantizedLinearMethod`); on a CPU, once the weights are loaded,
`vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm` packs each weight once for
oneDNN's matmul. Here `model_executor/linear.py`'s `Linear` (with the base class
and the unquantized default) calls `self.linear_method.apply(self, x)`; this file adds the CPU
methods, and the method is chosen once per model after loading (`loader.process_weights_after_loading`,
by `EngineConfig.cpu_gemm_backend`):

    "torch"   UnquantizedLinearMethod   F.linear on the row-major weight (the readable path; HF's)
    "onednn"  OneDNNLinearMethod        oneDNN's matmul on its blocked layout (vLLM's CPU choice)
    "cpu"     PanelLinearMethod         our C++ kernel on column panels (fp32; faster at decode sizes)
    "auto"    the first of cpu, onednn that runs every weight of the model, else torch

The kernels and why each is faster: kernels_cpu/gemm.py.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels_cpu import gemm
from model_executor.linear import UNQUANTIZED, LinearMethodBase, UnquantizedLinearMethod

__all__ = ["CPU_GEMMS", "LinearMethodBase", "OneDNNLinearMethod", "PanelLinearMethod", "UNQUANTIZED",
           "UnquantizedLinearMethod", "dispatch_cpu_unquantized_gemm", "select_cpu_linear_method"]

CPU_GEMMS = ("auto", "cpu", "onednn", "torch")       # EngineConfig.cpu_gemm_backend


class OneDNNLinearMethod(LinearMethodBase):
    def pack(self, weight):
        return gemm.pack_weight(weight)

    def apply(self, layer, x):
        return gemm.packed_linear(x, layer.packed_weight, layer.bias)


class PanelLinearMethod(LinearMethodBase):
    def pack(self, weight):
        return gemm.pack_panels(weight)

    def apply(self, layer, x):
        return gemm.panel_linear(x, layer.packed_weight, layer.bias)


def select_cpu_linear_method(cpu_gemm_backend: str, weights: list[torch.Tensor]) -> LinearMethodBase:
    """The method that runs all `weights` for `cpu_gemm_backend` (see the top); ValueError saying
    why when an explicitly requested one cannot."""
    if cpu_gemm_backend not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm_backend must be one of {CPU_GEMMS}, got {cpu_gemm_backend!r}")
    if cpu_gemm_backend == "torch" or not weights:
        return UNQUANTIZED
    if cpu_gemm_backend in ("auto", "cpu"):
        reason = next((r for r in map(gemm.kernel_unavailable_reason, weights) if r), None)
        if reason is None:
            return PanelLinearMethod()
        if cpu_gemm_backend == "cpu":
            raise ValueError(f"cpu_gemm_backend='cpu' cannot be used: {reason}")
    if all(gemm.can_pack(w) for w in weights):
        return OneDNNLinearMethod()
    if cpu_gemm_backend == "onednn":
        raise ValueError("cpu_gemm_backend='onednn' needs CPU weights in fp32 (or bf16 on a CPU with "
                         "AVX-512 bw/vl/dq or AVX-NE-CONVERT) and a torch built with oneDNN (mkldnn "
                         f"available: {torch.backends.mkldnn.is_available()}, bf16 supported: "
                         f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()})")
    return UNQUANTIZED


def dispatch_cpu_unquantized_gemm(layer: nn.Module, method: LinearMethodBase) -> None:
    """Pack `layer.weight` for `method` (once) and make `method` what the layer's forward calls."""
    layer.packed_weight = method.pack(layer.weight)
    layer.linear_method = method
