"""Quantized linears as CPU kernels (csrc/quant_gemm.cpp) that read the packed integers directly:
int4 / int8 weights with fp32 / bf16 / fp16 activations (WNA16), and int8 weights x int8
activations quantized per token (W8A8, exact int32 sums; AVX-512 VNNI's vpdpbusd where the CPU has
it). The raw entry of chapter 10's "cpu" backend (`quantization/cpu_ops.py`, which checks the
arguments first).

    packed = quant_gemm.pack_wna16(weight_packed, scale, zero_point, num_bits, group_size)   # once, at load
    y = quant_gemm.wna16_linear(x, packed, bias)                                             # every step
    packed = quant_gemm.pack_w8a8(weight, scale)
    y = quant_gemm.w8a8_linear(x, packed, bias)

Why: a decode step reads every weight once, so a linear's time is its weights' bytes over the
memory's bandwidth; int8 is 4x fewer bytes than fp32, int4 8x, and the kernels turn the integers
into floats in registers, never into a float matrix in memory. The packing is a regrouping of the
checkpoint's own int32 words into column panels (one word per SIMD lane, one output column per
lane), still 4 / 8 bits per weight; the .cpp's top comment has the layout and the arithmetic.

vLLM on a CPU runs these through oneDNN (compressed_tensors_w8a8_int8.py's ScaledMMLinearKernel ->
`onednn_scaled_mm`; WNA16 through a oneDNN-based dynamic-4bit path or torch), repacking each weight
once after loading (`process_weights_after_loading`), as `pack_*` does here.

Build: like every kernel here (build.py), compiled on first use into torch's extension cache. On an
AVX-512 CPU with VNNI the AVX-512 variant is built a second way, with -mavx512vnni (a separate
extension, `vfs_cpu_quant_gemm_vnni_avx512`), so the W8A8 sums run on vpdpbusd; without VNNI the
plain AVX-512 build (like AVX2) sums int16 pairs with vpmaddwd. On a CPU with AMX (Sapphire Rapids
on) a third build adds -mamx-* and -mavx512bf16 (`vfs_cpu_quant_gemm_amx_avx512`): from 16 rows, bf16
WNA16 and W8A8 run on the tiles (csrc/amx.h; module.amx() says whether Linux let this process use
them). The SIMDe build (tests) always runs the vpdpbusd code and the tile code, both emulated.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels_cpu import build

SOURCES = ("quant_gemm.cpp",)           # + vec.h, amx.h
WHAT = "CPU quantized GEMM kernel"
# No contraction into fused multiply-adds where the source does not ask for one: the W8A8 scaling
# then rounds exactly as the reference's double arithmetic (the kernels' FMAs are intrinsics).
CFLAGS = ("-ffp-contract=off",)
VNNI_CFLAGS = ("-mavx512vnni",)
# The matrix unit (csrc/amx.h): tiles, their bf16 and int8 products. AMX CPUs all have VNNI and
# AVX512-BF16 (the dequantization's float -> bf16 conversion).
AMX_CFLAGS = VNNI_CFLAGS + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8")

_default = []                           # the module load() returns without arguments, once resolved


@functools.lru_cache(maxsize=None)
def cpu_has_vnni() -> bool:
    """This CPU runs AVX-512 VNNI (torch's own cpuinfo check)."""
    check = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(check and check())


@functools.lru_cache(maxsize=None)
def cpu_has_amx() -> bool:
    """This CPU has AMX tiles with their bf16 and int8 products (the kernel asks Linux for the tile
    state itself; a process that is refused runs the vector paths, module.amx() says which)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if not (check and check()):
        return False
    with open("/proc/cpuinfo") as cpuinfo:                  # the first CPU's "flags : ..." line
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    return {"amx_tile", "amx_bf16", "amx_int8"} <= set(flags)


def load(isa: str | None = None, vnni: bool | None = None, amx: bool | None = None):
    """The extension for `isa` (default: this CPU's best; built on first use, build.py). vnni and
    amx None: the AMX build where the variant is native AVX-512 and the CPU has AMX, else the VNNI
    build where it has VNNI, else the plain one; True / False ask for a build (tests)."""
    default = isa is None and vnni is None and amx is None
    if default and _default:
        return _default[0]                                   # the hot path: one list lookup
    resolved = isa or build.cpu_isa()
    if amx is None:
        amx = resolved == "avx512" and vnni is not False and cpu_has_amx()
    if vnni is None:
        vnni = amx or (resolved == "avx512" and cpu_has_vnni())
    if (vnni or amx) and resolved != "avx512":
        raise ValueError(f"the VNNI and AMX builds are AVX-512 ones, not {resolved}")
    if amx and not vnni:
        raise ValueError("the AMX build is a VNNI one too (every AMX CPU has VNNI)")
    stem, flags = (("cpu_quant_gemm_amx", AMX_CFLAGS) if amx else ("cpu_quant_gemm_vnni", VNNI_CFLAGS) if vnni
                   else ("cpu_quant_gemm", ()))
    module = build.load_extension(stem, SOURCES, WHAT, resolved, CFLAGS + flags)
    if default:
        _default.append(module)
    return module


def is_available() -> bool:
    """True when the kernels are (or can be) built here. Builds them on the first call."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why `load` fails here (None when it works)."""
    return build.unavailable_reason_of(load)


# ----------------------------------------------------------------------------- packing, once per weight

class WNA16Weight(NamedTuple):
    """A weight packed for `wna16_linear`: words int32 [P, in / (32 / b), NR] (one word = 32 / b
    consecutive inputs of one output column, each value q in b-bit two's complement), params
    float32 [P, groups, 1 or 2, NR] (scale; and the zero point unless symmetric), NR the panel
    width of the build that packed it (the last panel zero-padded)."""
    words: torch.Tensor
    params: torch.Tensor
    num_bits: int
    group_size: int              # inputs per scale (in_features when per channel)
    symmetric: bool
    in_features: int
    out_features: int


class W8A8Weight(NamedTuple):
    """A weight packed for `w8a8_linear`: words int32 [P, ceil(in / 4), NR] (4 consecutive int8
    weights of one output column, zero-padded), row_sums int32 [P * NR] (sum over k of each row),
    w_scale float64 [P * NR] (the reference scales in double)."""
    words: torch.Tensor
    row_sums: torch.Tensor
    w_scale: torch.Tensor
    in_features: int
    out_features: int


def to_panels(rows: torch.Tensor, nr: int) -> torch.Tensor:
    """[N, C] (one row per output column) -> [ceil(N / nr), C, nr]: panel p holds rows p*nr ... as
    its columns, zero rows past N."""
    n, c = rows.shape
    panels = -(-n // nr)
    padded = F.pad(rows, (0, 0, 0, panels * nr - n))                        # [P * nr, C]
    return padded.reshape(panels, nr, c).transpose(1, 2).contiguous()       # [P, C, nr]


def pack_wna16(weight_packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, num_bits: int,
               group_size: int | None, isa: str | None = None, vnni: bool | None = None,
               amx: bool | None = None) -> WNA16Weight:
    """compressed-tensors' pack-quantized weight -> the kernel's panels. weight_packed int32
    [out, in * b / 32] (values q - qmin, little end first), scale [out, groups] float, zero_point
    int8 [out, groups] or None (symmetric), group_size None: per channel. The words move as they
    are (a transpose of panels), each value's top bit flipped: q - qmin becomes q in two's
    complement, which the kernel sign-extends with two shifts (or one table lookup)."""
    nr = load(isa, vnni, amx).panel_width
    out_features, num_words = weight_packed.shape
    in_features = num_words * (32 // num_bits)
    top_bits = 0x88888888 if num_bits == 4 else 0x80808080                  # the top bit of every value
    words = weight_packed.to(torch.int32) ^ (top_bits - (1 << 32))           # (as an int32: its sign bit is set)
    params = [scale.float()]                                                 # [out, groups]
    if zero_point is not None:
        params.append(zero_point.float())
    groups = scale.shape[1]
    stacked = torch.stack(params, dim=1).reshape(out_features, -1)          # [out, kind * groups]
    params_panels = to_panels(stacked, nr).reshape(-1, len(params), groups, nr).transpose(1, 2)
    return WNA16Weight(to_panels(words, nr), params_panels.contiguous(), num_bits,
                       group_size or in_features, zero_point is None, in_features, out_features)


def pack_w8a8(weight: torch.Tensor, scale: torch.Tensor, isa: str | None = None, vnni: bool | None = None,
              amx: bool | None = None) -> W8A8Weight:
    """int8 [out, in] + per-channel scale ([out] or [out, 1]) -> the kernel's panels: 4 consecutive
    inputs of a row in one int32 word (the input dim zero-padded to a multiple of 4)."""
    nr = load(isa, vnni, amx).panel_width
    out_features, in_features = weight.shape
    padded = F.pad(weight.contiguous(), (0, -in_features % 4))              # [out, 4 * K4] int8
    words = padded.view(torch.int32)                                         # [out, K4]: byte j = input 4 kk + j
    panels = to_panels(words, nr)
    padding = panels.shape[0] * nr - out_features
    row_sums = F.pad(weight.sum(dim=1, dtype=torch.int32), (0, padding))
    w_scale = F.pad(scale.reshape(-1).double(), (0, padding))
    return W8A8Weight(panels, row_sums, w_scale, in_features, out_features)


# ----------------------------------------------------------------------------- the products

def wna16_linear(x: torch.Tensor, packed: WNA16Weight, bias: torch.Tensor | None = None,
                 isa: str | None = None, vnni: bool | None = None, amx: bool | None = None) -> torch.Tensor:
    """x [T, in] contiguous (fp32 / bf16 / fp16) @ dequantize(W)^T (+ bias, fp32 [out]) -> [T, out]
    in x's dtype."""
    return load(isa, vnni, amx).wna16_gemm(x, packed.words, packed.params, bias, packed.num_bits,
                                           packed.group_size, packed.symmetric, packed.out_features)


def w8a8_linear(x: torch.Tensor, packed: W8A8Weight, bias: torch.Tensor | None = None,
                isa: str | None = None, vnni: bool | None = None, amx: bool | None = None) -> torch.Tensor:
    """x [T, in] contiguous -> int8 per token, times W in int32, scaled (+ bias, float64 [out]) ->
    [T, out] in x's dtype."""
    return load(isa, vnni, amx).w8a8_gemm(x, packed.words, packed.row_sums, packed.w_scale, bias,
                                          packed.in_features, packed.out_features)
