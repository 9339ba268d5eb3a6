"""One dispatch point for chapter 01's ops, one vocabulary for every chapter's backends:

    "reference"  reference.py   the readable per-request loops: the oracle
    "torch"      torch_ops.py   the same maths vectorized in PyTorch (runs anywhere)
    "triton"     triton_ops.py  Triton kernels: a GPU, or CPU tensors under TRITON_INTERPRET=1
    "cuda"       cuda_ops.py    CUDA C++ kernels (kernels_cuda/): a GPU only
    "cpu"        cpu_ops.py     a C++/OpenMP kernel reading K/V in place, as vLLM's csrc/cpu
                                (kernels_cpu/): CPU tensors, built on first use (needs a C++
                                compiler and ninja)

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values, backend, *, kv_quant)
    paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, backend, ...)
    paged_prefill_attention(query, key, value, key_cache, value_cache, slot_mapping,
                            query_start_loc, scale, backend, ...)

Every backend module has the same three functions with the same signatures and gives the
same answer (to the dtype's rounding; cache writes bit for bit). "cuda" prefill writes the
cache with the CUDA kernel and runs the attention with the Triton kernel, as vLLM's V0
XFormers backend paired its CUDA paged_attention (decode) with a Triton prefill kernel.
Backend-specific knobs are keyword-only: num_kv_splits (Triton's split-KV, vLLM's name),
version (CUDA's v1/v2).
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from paged_attention.kv_quant import KVQuant

BACKENDS = ("reference", "torch", "triton", "cuda", "cpu")
_MODULES = {
    "reference": "paged_attention.reference",
    "torch": "paged_attention.torch_ops",
    "triton": "paged_attention.triton_ops",
    "cuda": "paged_attention.cuda_ops",
    "cpu": "paged_attention.cpu_ops",
}


def check_backend(backend: str, device: torch.device) -> None:
    """Fail loudly for a backend this machine (or these tensors) cannot run."""
    if backend == "cuda" and backend in BACKENDS:
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda' needs an NVIDIA GPU and a CUDA build of torch; "
                               "use backend='torch' (or 'triton' with TRITON_INTERPRET=1) on CPU")
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' needs tensors on the GPU, got {device}")
    check_kernel_backend(backend, device, BACKENDS, "paged_attention.cpu_ops", "paged attention")


def check_kernel_backend(backend: str, device: torch.device, backends: tuple[str, ...], cpu_ops: str,
                         what: str) -> None:
    """The backend checks every chapter's op dispatch shares (chapters 08 and 09 call it too): a
    known name, the C++ kernel only for CPU tensors and only where it builds (`cpu_ops`: the module
    with is_available / unavailable_reason), Triton on CPU tensors only under the interpreter."""
    if backend not in backends:
        if backend == "cuda":
            raise ValueError(f"{what} has no CUDA C++ rung: on a GPU use backend='triton' (or 'torch')")
        raise ValueError(f"unknown backend {backend!r}; choose one of {backends}")
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' is the C++/OpenMP kernel for CPU tensors, got {device}")
        module = importlib.import_module(cpu_ops)
        if not module.is_available():
            raise RuntimeError(f"backend='cpu' is unavailable here: {module.unavailable_reason()}; use backend='torch'")
    if backend == "triton" and device.type != "cuda":
        from paged_attention.triton_common import interpreting
        if not interpreting():
            raise RuntimeError(f"backend='triton' on {device} tensors needs TRITON_INTERPRET=1 set before triton "
                               "is imported (the Triton interpreter); on a GPU pass CUDA tensors")


def _quant_kwargs(kv_quant: KVQuant | None) -> dict:
    """{"kv_quant": ...} for an 8-bit cache, {} for a float cache. Every backend writes an 8-bit cache
    (kv_quant.py) and every decode reads one, CUDA's v1 / v2 / v3 too (kernels_cuda/
    paged_attention_common.cuh: KVQuantArgs); the engine reads its cache through chapter 05's
    unified attention, whose backends all read it as well."""
    return {} if kv_quant is None else {"kv_quant": kv_quant}


def backend_module(backend: str, device: torch.device) -> ModuleType:
    """The module implementing `backend`, imported on first use (importing this package
    never imports triton: TRITON_INTERPRET must be set before that happens)."""
    check_backend(backend, device)
    return importlib.import_module(_MODULES[backend])


def reshape_and_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,   # (written)
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
    check_values: bool = True,
    backend: str = "torch",
    *,
    kv_quant: KVQuant | None = None,   # an 8-bit cache (kv_quant.py): rows are quantized as written
) -> None:
    backend_module(backend, key.device).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                                          check_values, **_quant_kwargs(kv_quant))


def paged_decode_attention(
    query: torch.Tensor,         # [num_seqs, num_heads, head_dim]: one new token per request
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,      # [num_seqs] int32: KV tokens per request, the new one included
    scale: float,
    backend: str = "torch",
    *,
    check_values: bool = True,
    max_seq_len: int | None = None,     # AttentionMetadata.max_seq_len (saves a device read)
    num_kv_splits: int | None = None,   # triton: split-KV factor (None = heuristic)
    version: str | None = None,         # cuda: "v1" | "v2" | "v3" (None = vLLM's v1/v2 rule)
    kv_quant: KVQuant | None = None,    # an 8-bit cache: rows are dequantized as read
) -> torch.Tensor:                      # [num_seqs, num_heads, head_dim]
    variant = _quant_kwargs(kv_quant)
    if num_kv_splits is not None:
        if backend != "triton":
            raise ValueError(f"num_kv_splits= selects the Triton split-KV variant; backend {backend!r} has none"
                             + (" (for CUDA use version='v1'|'v2')" if backend == "cuda" else ""))
        variant["num_kv_splits"] = num_kv_splits
    if version is not None:
        if backend != "cuda":
            raise ValueError(f"version= selects the CUDA kernel (v1/v2); backend {backend!r} has none"
                             + (" (for Triton use num_kv_splits=)" if backend == "triton" else ""))
        variant["version"] = version
    return backend_module(backend, query.device).paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, check_values, max_seq_len=max_seq_len, **variant)


def paged_prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]: the prompts back to back
    key: torch.Tensor,              # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim] (written)
    value_cache: torch.Tensor,      # (written)
    slot_mapping: torch.Tensor,     # [num_tokens] int, -1 = don't cache
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cu_seqlens of the prompts
    scale: float,
    backend: str = "torch",
    *,
    check_values: bool = True,
    max_query_len: int | None = None,
    kv_quant: KVQuant | None = None,    # an 8-bit cache: the write quantizes (the attention uses fresh K/V)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    return backend_module(backend, query.device).paged_prefill_attention(
        query, key, value, key_cache, value_cache, slot_mapping, query_start_loc, scale, check_values,
        max_query_len=max_query_len, **_quant_kwargs(kv_quant))
