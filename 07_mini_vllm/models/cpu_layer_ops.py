"""The decoder's small ops as fused CPU kernels: RMSNorm (+ residual add), SiLU-and-mul, and RoPE
applied while q/k/v are split out of the qkv projection (csrc/cpu_layer_ops.cpp).

vLLM's CPU build calls its own C++ for these (`csrc/cpu/layernorm.cpp`, `activation.cpp`,
`pos_encoding.cpp`), chosen by `CustomOp.forward_cpu` where other platforms take `forward_native`
or `forward_cuda`. Here the layers in `models/layers.py` keep their readable PyTorch forward (the
oracle: it is HF's math op for op) and switch to these kernels when `use_cpu_layer_ops(model)` has
set them up after loading — the same moment the linears get their packed weights (`loader.py`).

Why: in PyTorch each of these is 3-8 ops, each a pass over the activations and a dispatch;
`python -m benchmarks.bench_cpu_layer_ops` times both per op and through a SmolLM2 forward.

Numerics (see the .cpp): RoPE and the residual add are bit for bit the PyTorch result;
the RMSNorm row sum and SiLU's exp() differ from torch's in the last bits (tolerance tests).

Build: like chapter 01's CPU attention kernel (`paged_attention.cpu_ops`, whose instruction-set
choice and build-tool checks this reuses), compiled on first use into torch's extension cache.
"""
from __future__ import annotations

import pathlib

import torch

from paged_attention import cpu_ops as attention_cpu_ops

# Resolved to its real path, as chapter 01's: copies of the tree linking csrc/ share one build.
CSRC = (pathlib.Path(__file__).resolve().parent.parent / "csrc").resolve()
SOURCES = ("cpu_layer_ops.cpp",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_modules: dict[str, object] = {}
_failures: dict[str, str] = {}


def build(stem: str, sources: tuple[str, ...], what: str, extra_cflags: tuple[str, ...] = (),
          isa: str | None = None):
    """Build (first call on this machine, ~15 s) or load the extension `vfs_<stem>_<isa>` from
    csrc/`sources` for `isa` (default: the best instruction set of this CPU, chapter 01's
    `cpu_isa()`); RuntimeError naming `what` and the reason when it cannot be built (no compiler,
    no ninja, a compile error). Shared by the engine's C++ kernels (these layer ops,
    models/cpu_gemm.py's GEMM); tests build the other variants this CPU runs by name."""
    if isa is None and stem in _modules:     # the hot path: the default variant, already loaded
        return _modules[stem]
    requested, isa = isa, isa or attention_cpu_ops.cpu_isa()
    name = f"vfs_{stem}_{isa}"
    if name not in _modules:
        _modules[name] = _build(name, sources, what, extra_cflags, isa)
    if requested is None:
        _modules[stem] = _modules[name]
    return _modules[name]


def _build(name: str, sources: tuple[str, ...], what: str, extra_cflags: tuple[str, ...], isa: str):
    if name in _failures:                    # don't retry a failing build on every call
        raise RuntimeError(_failures[name])
    try:
        return attention_cpu_ops.build_extension(name, [CSRC / s for s in sources], isa, what, extra_cflags)
    except RuntimeError as e:
        _failures[name] = str(e)
        raise


def load(isa: str | None = None):
    """The layer ops' extension for `isa` (default: this CPU's best; built on first use, see `build`)."""
    # -ffp-contract=off: no fused multiply-adds, so RoPE rounds exactly as the torch ops do.
    return build("cpu_layer_ops", SOURCES, "CPU layer ops", ("-ffp-contract=off",), isa)


def is_available() -> bool:
    """True when the kernels are (or can be) built here. Builds them on the first call."""
    try:
        load()
        return True
    except RuntimeError:
        return False


def unavailable_reason() -> str | None:
    """Why `load` fails here (None when it works)."""
    try:
        load()
        return None
    except RuntimeError as e:
        return str(e)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] -> RMSNorm(x); with residual: residual += x (in place), returns RMSNorm(residual)."""
    return load().rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    return load().silu_and_mul(x)


def rope_split_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) * D], cos/sin [T, D] -> (q [T, H, D] rotated, k [T, KVH, D] rotated, v [T, KVH, D])."""
    return load().rope_split_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
