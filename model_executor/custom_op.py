"""CustomOp: a layer with a readable PyTorch forward and, optionally, a faster one per platform.

Mirrors vLLM's `vllm/model_executor/custom_op.py: CustomOp`: a subclass writes `forward_native`
(plain torch: the oracle, what HF computes op for op) and may add `forward_cpu` (a fused C++ op of
kernels_cpu/layer_ops.py) or `forward_cuda` (fused Triton kernels of chapter 01's
paged_attention/model/triton_layer_ops.py). Which one runs is bound ONCE,
by `dispatch_forward`, so `forward` itself never asks which platform it is on. Every op starts on
`forward_native`; only chapter 07's loader rebinds (`loader.use_cpu_layer_ops`, by
`EngineConfig.cpu_kernels`; `loader.use_cuda_layer_ops`, by `EngineConfig.cuda_layer_ops`), so
chapter 04's EAGLE head and toy target always run the native forwards, which autograd can train through.
"""
from __future__ import annotations

from torch import nn

PLATFORMS = ("native", "cpu", "cuda")


class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.platform = "native"                   # which forward `dispatch_forward` bound
        self._forward_method = self.forward_native

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        """The CPU kernel's forward; by default the native one."""
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        """The GPU kernel's forward (Triton); by default the native one."""
        return self.forward_native(*args, **kwargs)

    def dispatch_forward(self, platform: str) -> None:
        """Bind the forward that runs from now on: "native" (forward_native), "cpu" (forward_cpu)
        or "cuda" (forward_cuda)."""
        if platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
        self.platform = platform
        self._forward_method = {"native": self.forward_native, "cpu": self.forward_cpu,
                                "cuda": self.forward_cuda}[platform]
