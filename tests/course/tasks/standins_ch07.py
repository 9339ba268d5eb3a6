"""Stand-in for the CPU-linear tasks (kernels_cpu/gemm.py: oneDNN prepacking, the C++ GEMM kernel),
used by the grader while it grades the model-runner task: the "packed" weight is the weight itself and the
matmul is F.linear — correct, just not prepacked. Patched into the functions' code so that every
reference already bound to them (`from ... import pack_weight`) sees it too."""
import torch.nn.functional as F

from kernels_cpu import gemm as cpu_gemm
from kernels_cpu.gemm import PanelWeight


def _pack_weight(weight):
    return weight.detach().contiguous()


def _packed_linear(x, packed_weight, bias):
    return F.linear(x, packed_weight, bias)


def _pack_panels(weight):
    return PanelWeight(weight.detach().contiguous(), weight.shape[0])   # cpu_gemm's own name: this code runs as its function


def _panel_linear(x, packed_weight, bias):
    return F.linear(x, packed_weight.panels, bias)


def apply(monkeypatch):
    monkeypatch.setattr(cpu_gemm.pack_weight, "__code__", _pack_weight.__code__)
    monkeypatch.setattr(cpu_gemm.packed_linear, "__code__", _packed_linear.__code__)
    monkeypatch.setattr(cpu_gemm.pack_panels, "__code__", _pack_panels.__code__)
    monkeypatch.setattr(cpu_gemm.panel_linear, "__code__", _panel_linear.__code__)
