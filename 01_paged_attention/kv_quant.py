"""An 8-bit KV cache: what a cache row holds when K/V are stored in int8 or fp8, and the
reference quantize / dequantize every backend's write and read is checked against.

Why: a decode step reads every cached K/V row of every request; at long contexts that is
most of the step's bytes. One byte per element instead of two (bf16) or four (fp32) halves
or quarters those bytes, and the same memory holds twice (four times) the blocks.

vLLM's names (vllm/config/cache.py: CacheDType; vllm/v1/kv_cache_interface.py: KVQuantMode):

    kv_cache_dtype          stored as        scale                         vLLM mode
    "auto"                  the model dtype  none                          NONE
    "fp8" / "fp8_e4m3"      float8_e4m3fn    one per layer for K, one for  FP8_PER_TENSOR
                                             V (k_scale / v_scale: from
                                             the checkpoint, else 1.0)
    "int8_per_token_head"   int8             one per (token, KV head),     INT8_PER_TOKEN_HEAD
    "fp8_per_token_head"    float8_e4m3fn    computed as the row is        FP8_PER_TOKEN_HEAD
                                             written: absmax / qmax

Per-token-head scales live INSIDE the page, as vLLM's Triton backend packs them
(TritonAttentionBackend.customize_spec): each (slot, KV head) row is `head_dim` bytes of
data followed by the 4 bytes of its float32 scale,

    cache [num_blocks, block_size, num_kv_heads, head_dim + 4]  (int8 or fp8)
           row = [ q_0 ... q_{head_dim-1} | scale (fp32, 4 bytes) ]

so a block still is one slice of one tensor: copy-on-write, swapping, tree-branch moves and
the KV connectors move blocks without knowing they are quantized. Per-tensor fp8 rows are
plain `head_dim` bytes; the scale is the layer's.

The rounding (vLLM's triton_reshape_and_cache_flash._reshape_cache_per_token_head):
`scale = max(absmax / qmax, 1e-6)`, `y = x * (1 / scale)` in fp32; int8 rounds half away from
zero and clamps to [-128, 127]; fp8 clamps to ±448 and rounds to nearest even. Every backend
writes exactly these bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # torch.finfo(torch.float8_e4m3fn).max: a cast above it gives NaN, so clamp
INT8_MAX = 127.0
SCALE_PAD = 4                   # bytes (= 1-byte elements) of the fp32 scale after each row's data
MIN_SCALE = 1e-6                # an all-zero row still gets a usable scale

# kv_cache_dtype -> (storage dtype, per-token-head scales inline)
KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, bool]] = {
    "fp8": (FP8, False),
    "fp8_e4m3": (FP8, False),
    "int8_per_token_head": (torch.int8, True),
    "fp8_per_token_head": (FP8, True),
}
# vLLM 0.32 names this project does not build, so that asking for one says so.
VLLM_ONLY_KV_CACHE_DTYPES = ("fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4", "nvfp4_4over6", "nvfp4_ds_mla",
                             "int4_per_token_head", "ultraquant_4bit", "turboquant_k8v4", "turboquant_4bit_nc",
                             "turboquant_k3v4_nc", "turboquant_3bit_nc")


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """vLLM's name, checked: "auto", "bfloat16"/"float16" (a float cache) or an 8-bit one."""
    supported = ("auto", "float16", "bfloat16", *KV_CACHE_DTYPES)
    if kv_cache_dtype in supported:
        return kv_cache_dtype
    if kv_cache_dtype in VLLM_ONLY_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is a vLLM format this engine does not implement; "
                         f"supported: {', '.join(supported)}")
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; supported: {', '.join(supported)}")


@dataclass(frozen=True)
class KVQuant:
    """How one attention layer's cache is quantized: the mode and, for per-tensor fp8, the
    layer's K and V scales (vLLM: Attention._k_scale / _v_scale). Ops take `kv_quant=None`
    for a float cache."""
    kv_cache_dtype: str
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KVQuant is for an 8-bit cache; kv_cache_dtype must be one of "
                             f"{', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"KVQuant.{name} must be > 0, got {value!r}")
        if self.per_token_head and (self.k_scale, self.v_scale) != (1.0, 1.0):
            raise ValueError(f"{self.kv_cache_dtype} computes a scale per row as it writes; k_scale / v_scale "
                             "are per-tensor fp8's")

    @property
    def storage_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype][0]

    @property
    def per_token_head(self) -> bool:
        return KV_CACHE_DTYPES[self.kv_cache_dtype][1]

    @property
    def qmax(self) -> float:
        return INT8_MAX if self.storage_dtype == torch.int8 else FP8_MAX

    def cache_head_dim(self, head_dim: int) -> int:
        """The cache's last dimension: the data, plus the inline scale for per-token-head."""
        return head_dim + SCALE_PAD if self.per_token_head else head_dim

    def tensor_scale(self, which: str) -> float:
        return self.k_scale if which == "k" else self.v_scale


def kv_quant_for(kv_cache_dtype: str) -> KVQuant | None:
    """The KVQuant an engine's kv_cache_dtype asks for (None: a float cache); per-tensor scales 1.0
    until a checkpoint's replace them (mini_vllm/models/quantization.py: process_kv_cache_scales)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return KVQuant(kv_cache_dtype) if kv_cache_dtype in KV_CACHE_DTYPES else None


def inline_scales(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., head_dim + 4] int8/fp8 rows -> [...] float32: a view of each row's scale bytes
    (the row length must keep them 4-byte aligned: head_dim a multiple of 4)."""
    return cache[..., head_dim:head_dim + SCALE_PAD].view(torch.float32)[..., 0]


def scale_views(key_cache: torch.Tensor, value_cache: torch.Tensor, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(K scales, V scales, their shared strides): the inline fp32 scales of a per-token-head cache
    as [num_blocks, block_size, num_kv_heads] views, what a kernel indexes with one offset for both."""
    k_scales, v_scales = inline_scales(key_cache, head_dim), inline_scales(value_cache, head_dim)
    if k_scales.stride() != v_scales.stride():
        raise ValueError("key_cache and value_cache must have the same strides (one scale offset for both)")
    return k_scales, v_scales, k_scales.stride()


def kernel_scale_args(key_cache: torch.Tensor, value_cache: torch.Tensor, head_dim: int,
                      kv_quant: KVQuant | None) -> tuple:
    """(K scale views, V scale views, their 3 strides, k_scale, v_scale): what the Triton kernels of
    chapters 01 and 05 take for a cache, to write or to read it. Per-token-head: the rows' fp32 scale
    views (the per-tensor scales unused, 1.0); per-tensor fp8: the layer's scales (the views are
    placeholders, never read); a float cache: placeholders throughout."""
    if kv_quant is None or not kv_quant.per_token_head:
        k, v = (1.0, 1.0) if kv_quant is None else (kv_quant.k_scale, kv_quant.v_scale)
        return (key_cache, value_cache, 0, 0, 0, k, v)
    k_scales, v_scales, strides = scale_views(key_cache, value_cache, head_dim)
    return (k_scales, v_scales, *strides, 1.0, 1.0)


def kv_quant_mode(kv_quant: KVQuant | None) -> int:
    """The Triton kernels' KV_QUANT constexpr: 0 a float cache, 1 per-tensor scales, 2 per-row scales."""
    return 0 if kv_quant is None else 2 if kv_quant.per_token_head else 1


def quantize_rows(x: torch.Tensor, kv_quant: KVQuant, which: str) -> torch.Tensor:
    """K (which="k") or V rows [..., head_dim] float -> the cache's rows [..., cache_head_dim]."""
    head_dim = x.shape[-1]
    x = x.float()
    ### BEGIN SOLUTION
    if kv_quant.per_token_head:
        scale = (x.abs().amax(dim=-1) / kv_quant.qmax).clamp_min(MIN_SCALE)      # [...]
    else:
        scale = torch.full(x.shape[:-1], kv_quant.tensor_scale(which), dtype=torch.float32, device=x.device)
    y = x * (1.0 / scale)[..., None]                                             # [..., head_dim]
    if kv_quant.storage_dtype == torch.int8:
        # round half away from zero, then the int8 store truncates (vLLM's kernel does the same)
        q = torch.where(y >= 0, y + 0.5, y - 0.5).clamp(-128.0, 127.0).to(torch.int8)
    else:
        q = y.clamp(-FP8_MAX, FP8_MAX).to(FP8)                                   # round to nearest even
    ### END SOLUTION
    if not kv_quant.per_token_head:
        return q
    rows = torch.empty(*x.shape[:-1], head_dim + SCALE_PAD, dtype=kv_quant.storage_dtype, device=x.device)
    rows[..., :head_dim] = q
    inline_scales(rows, head_dim).copy_(scale)
    return rows


def dequantize_rows(rows: torch.Tensor, kv_quant: KVQuant, which: str, head_dim: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The cache's rows [..., cache_head_dim] -> K or V [..., head_dim] in `dtype` (q * scale, in fp32)."""
    data = rows[..., :head_dim].float()
    ### BEGIN SOLUTION
    if kv_quant.per_token_head:
        scale = inline_scales(rows, head_dim)[..., None]                           # [..., 1]
    else:
        scale = kv_quant.tensor_scale(which)
    out = data * scale
    ### END SOLUTION
    return out.to(dtype)


def read_rows(rows: torch.Tensor, kv_quant: KVQuant | None, which: str, head_dim: int,
              dtype: torch.dtype) -> torch.Tensor:
    """What a reference/torch attention read does with gathered cache rows: a float cache's rows
    as they are, a quantized cache's dequantized to the query's dtype."""
    return rows if kv_quant is None else dequantize_rows(rows, kv_quant, which, head_dim, dtype)
