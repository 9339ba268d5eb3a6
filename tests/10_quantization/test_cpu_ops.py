"""Chapter 10's "cpu" backend (quantization/cpu_ops.py -> kernels_cpu/quant_gemm.py, csrc/quant_gemm.cpp)
against quantization.reference_ops.

What is exact and what is a tolerance:
  * WNA16: each product x * (q - z) is exact in fp32 and each group's sum is scaled once (one row
    tile: decode), or each weight is dequantized as the reference does, (q - z) * s in fp32, and
    multiplied (more rows): the reference's numbers up to the order of the fp32 sums -- the table's
    tolerance (tests/tolerances.py). Zero groups and zero rows contribute exactly 0: a zero row of
    W gives exactly the bias. 16-bit scales with fp32 x are the one case outside fp32's tolerance:
    the reference rounds every dequantized weight to the scales' dtype, the kernel keeps it exact
    (checked with the scales' dtype's tolerance; in the engine the scales have x's dtype);
  * W8A8: the per-token quantization (scale, round-half-to-even ties), the int32 sums and the
    fp64 scaling are the reference's: y equals reference.w8a8_linear_reference bit for bit, every
    dtype, every instruction set (VNNI's vpdpbusd, AVX-512 / AVX2's vpmaddwd, scalar).
Cases: int4 / int8, group 32 / 64 / 128 / 256 / per channel, symmetric / asymmetric, T = 1, 2, 7,
16, 33, 128 (one row tile; several: the dequantized-chunk path), SmolLM2-135M's shapes (576 -> 960
q|k|v, 576, 3072; 1536 -> 576) and odd ones (out not a multiple of a panel, in of a few groups),
fp32 / bf16 / fp16, bias or not; adversarial: zero groups and rows, scales from 1e-6 to 1e6, zero
points at both grid ends, W8A8 at the integer extremes and at exact rounding ties; strided x; an
empty batch; 1 vs 2 threads; every instruction-set build this machine runs (the AVX-512 one under
SIMDe too); bad arguments. Run with OMP_NUM_THREADS=1 on a shared machine.
"""
from __future__ import annotations

import pytest
import torch
from tolerances import assert_close, assert_equal

from quantization import ops, packing, reference_ops
from quantization.reference import QuantScheme, quantize_per_token_int8, quantize_rtn, w8a8_linear_reference


def _cpu_reason() -> str | None:
    from quantization import cpu_ops
    return cpu_ops.unavailable_reason()


pytestmark = pytest.mark.skipif(bool(reason := _cpu_reason()), reason=str(reason))

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKENS = [1, 2, 7, 16, 33, 128]
GROUPS = [32, 64, 128, 256, None]
# (in, out): SmolLM2-135M's linears, then odd ones (out not a multiple of any panel width; in a few groups)
SMOLLM2_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
ODD_SHAPES = [(256, 72), (512, 200)]


def seeded(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, "/".join(map(str, parts)))))


def cpu_ops():
    from quantization import cpu_ops as module
    return module


def make_weight(out_features: int, in_features: int, scheme: QuantScheme, g: torch.Generator,
                scale_dtype: torch.dtype = torch.float32):
    """RTN-quantized random weights as a checkpoint stores them: (weight_packed int32, weight_scale,
    weight_zero_point int8 or None). Shifted off zero so that asymmetric zero points vary."""
    w = (torch.randn(out_features, in_features, generator=g) * 0.05 + 0.01).to(scale_dtype)
    qw = quantize_rtn(w, scheme)
    return packing.pack_int32(qw.q, scheme.num_bits), qw.scale, None if scheme.symmetric else qw.zero_point


def from_integers(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme):
    """Hand-made integers as a checkpoint stores them."""
    return packing.pack_int32(q, scheme.num_bits), scale, zero


def shapes_for(group_size: int | None, shapes=SMOLLM2_SHAPES + ODD_SHAPES):
    return [(i, o) for i, o in shapes if group_size is None or i % group_size == 0]


def check_wna16(x, weight, scheme, bias=None, dtype=None):
    packed, scale, zero = weight
    expected = reference_ops.wna16_linear(x, packed, scale, zero, scheme, bias)
    got = ops.wna16_linear(x, packed, scale, zero, scheme, bias, backend="cpu")
    assert got.dtype == x.dtype and got.shape == expected.shape
    assert_close(got, expected, dtype or x.dtype)
    return got


# ----------------------------------------------------------------------------- WNA16 against the reference

@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", GROUPS, ids=lambda g: f"g{g}" if g else "channel")
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_wna16_equals_the_reference(bits, group_size, symmetric):
    """Every shape this scheme divides, every T (fp32; bf16 and fp16 at T = 1 and 33), bias or not,
    the weight prepared once and reused for every T, as the engine does."""
    scheme = QuantScheme(bits, symmetric, group_size)
    for in_features, out_features in shapes_for(group_size):
        g = seeded(bits, group_size, symmetric, in_features, out_features)
        weight = make_weight(out_features, in_features, scheme, g)
        prepared = cpu_ops().prepare_wna16(*weight, scheme)
        bias = torch.randn(out_features, generator=g)
        for T in TOKENS:
            x = torch.randn(T, in_features, generator=g)
            b = bias if T % 2 else None
            got = check_wna16(x, weight, scheme, b)
            assert_equal(cpu_ops().wna16_linear_prepared(x, prepared, b), got, "prepared once vs per call")
        for dtype in (torch.bfloat16, torch.float16):
            for T in (1, 33):
                check_wna16(torch.randn(T, in_features, generator=g).to(dtype), weight, scheme, bias.to(dtype))


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_scales(scale_dtype):
    """Scales in bf16 / fp16: with x of the same dtype (the engine's case) the table's tolerance;
    with fp32 x the reference rounds each dequantized weight to the scales' dtype and the kernel
    does not, so the two agree within that dtype's tolerance."""
    scheme = QuantScheme(4, False, 64)
    g = seeded("scales", scale_dtype)
    weight = make_weight(200, 512, scheme, g, scale_dtype)
    for T in (1, 16):
        check_wna16(torch.randn(T, 512, generator=g).to(scale_dtype), weight, scheme)
        check_wna16(torch.randn(T, 512, generator=g), weight, scheme, dtype=scale_dtype)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_zero_groups_and_rows_contribute_exactly_nothing(bits, symmetric):
    """RTN turns an all-zero group into q = 0 (symmetric) or q = z = qmin (asymmetric), scale 1: the
    kernel's products are x * (q - z) = 0 exactly, whatever the order of the sums, so a row of W
    that is all zero gives exactly the bias, at T = 1 (in-register) and T = 33 (dequantized chunks)."""
    scheme = QuantScheme(bits, symmetric, 32)
    g = seeded("zeros", bits, symmetric)
    w = torch.randn(72, 256, generator=g) * 0.05
    w[:, 64:96] = 0                                   # one zero group in every row
    w[5] = 0                                          # a zero row
    w[70, :128] = 0                                   # half a row
    qw = quantize_rtn(w, scheme)
    weight = from_integers(qw.q, qw.scale, None if symmetric else qw.zero_point, scheme)
    bias = torch.randn(72, generator=g)
    for T in (1, 33):
        y = check_wna16(torch.randn(T, 256, generator=g), weight, scheme, bias)
        assert_equal(y[:, 5], bias[5].expand(T), "a zero row is exactly the bias")
        big = ops.wna16_linear(torch.randn(T, 256, generator=g) * 1e6, *weight, scheme, bias, backend="cpu")
        assert_equal(big[:, 5], bias[5].expand(T), "a zero row is exactly the bias, whatever x")


def check_against_fp64(x, weight, scheme, bias=None):
    """The kernel and the reference against the exact product (fp64, of the exactly dequantized
    weights), each error measured against the size of the terms, sum |x| |w|: on cancelling sums
    (zero points at the grid ends make every row's q - z one-signed) the outputs are much smaller
    than their terms, and fp32's summation error -- the reference's too -- is relative to the terms."""
    packed, scale, zero = weight
    q = packing.unpack_int32(packed, scheme.num_bits).double()
    groups = scale.shape[1]
    z = zero.double() if zero is not None else torch.zeros(scale.shape, dtype=torch.float64)
    w = ((q.reshape(q.shape[0], groups, -1) - z.unsqueeze(-1)) * scale.double().unsqueeze(-1)).reshape(q.shape)
    exact = x.double() @ w.t() + (0 if bias is None else bias.double())
    size = x.double().abs() @ w.abs().t() + (0 if bias is None else bias.double().abs())
    for name, y in [("cpu", ops.wna16_linear(x, *weight, scheme, bias, backend="cpu")),
                    ("reference", reference_ops.wna16_linear(x, *weight, scheme, bias))]:
        assert_close((y.double() / size).float(), (exact / size).float(), torch.float32, msg=name)


@pytest.mark.parametrize("group_size", [32, None], ids=["g32", "channel"])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_extreme_scales_and_zero_points_at_the_grid_ends(bits, group_size):
    """Hand-made integers: every q on the grid, zero points at qmin and qmax only (the largest
    |q - z|), scales from 1e-6 to 1e6 across rows and groups."""
    scheme = QuantScheme(bits, False, group_size)
    g = seeded("extreme", bits, group_size)
    out_features, in_features = 200, 256
    groups = scheme.groups(in_features)
    q = torch.randint(scheme.qmin, scheme.qmax + 1, (out_features, in_features), generator=g, dtype=torch.int8)
    ends = torch.tensor([scheme.qmin, scheme.qmax], dtype=torch.int8)
    zero = ends[torch.randint(0, 2, (out_features, groups), generator=g)]
    scale = 10.0 ** torch.empty(out_features, groups).uniform_(-6, 6, generator=g)
    weight = from_integers(q, scale, zero, scheme)
    for T in (1, 7, 33):
        bias = torch.randn(out_features, generator=g)
        check_against_fp64(torch.randn(T, in_features, generator=g), weight, scheme, bias)
    sym = QuantScheme(bits, True, group_size)                # and the symmetric grid's ends
    q_ends = ends[torch.randint(0, 2, (out_features, in_features), generator=g)]
    check_against_fp64(torch.randn(3, in_features, generator=g), from_integers(q_ends, scale, None, sym), sym)


def test_strided_x_and_an_empty_batch():
    """x as a strided view (every other column, or a transposed copy) is copied to rows first; an
    empty batch gives an empty [0, out]."""
    scheme = QuantScheme(4, True, 64)
    g = seeded("strided")
    weight = make_weight(100, 256, scheme, g)
    wide = torch.randn(9, 512, generator=g)
    check_wna16(wide[:, ::2], weight, scheme)
    check_wna16(torch.randn(256, 9, generator=g).t(), weight, scheme)
    assert ops.wna16_linear(torch.empty(0, 256), *weight, scheme, backend="cpu").shape == (0, 100)
    w8 = torch.randint(-128, 128, (100, 256), generator=g, dtype=torch.int8)
    s8 = torch.rand(100, 1, generator=g)
    assert_equal(ops.w8a8_linear(wide[:, ::2], w8, s8, backend="cpu"), w8a8_linear_reference(wide[:, ::2], w8, s8))
    assert ops.w8a8_linear(torch.empty(0, 256), w8, s8, backend="cpu").shape == (0, 100)


def test_the_prepared_weight_is_still_four_or_eight_bits_per_weight():
    """The point of the chapter: the prepared weight is the checkpoint's words regrouped into panels
    (zero-padded to whole panels), 4 / 8 bits per weight -- no float copy of W is kept."""
    from kernels_cpu import quant_gemm
    nr = quant_gemm.load().panel_width
    for bits in (4, 8):
        scheme = QuantScheme(bits, True, 64)
        packed, scale, _ = make_weight(200, 576, scheme, seeded("bytes", bits))
        prepared = cpu_ops().prepare_wna16(packed, scale, None, scheme)
        panels = -(-200 // nr)
        assert prepared.words.dtype == torch.int32
        assert prepared.words.numel() * 32 == panels * nr * 576 * bits
        # panel p, word kk, lane j = the checkpoint's word (p * nr + j, kk), each value's top bit flipped
        flip = (0x88888888 if bits == 4 else 0x80808080) - (1 << 32)
        columns = prepared.words.transpose(1, 2).reshape(panels * nr, -1)
        assert_equal(columns[:200], packed ^ flip)
        assert not columns[200:].any()


def test_one_and_two_threads_give_the_same_bits():
    """Threads split the panels: each output is computed the same way whoever computes it (on AMX
    tiles too: bf16 and W8A8 from 16 rows)."""
    scheme = QuantScheme(4, False, 32)
    g = seeded("threads")
    weight = make_weight(960, 576, scheme, g)
    w8 = torch.randint(-128, 128, (960, 576), generator=g, dtype=torch.int8)
    s8 = torch.rand(960, 1, generator=g)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append([f(torch.randn(T, 576, generator=seeded("x", T)).to(dtype))
                            for T in (1, 16, 33) for dtype in (torch.float32, torch.bfloat16)
                            for f in (lambda x: ops.wna16_linear(x, *weight, scheme, backend="cpu"),
                                      lambda x: ops.w8a8_linear(x, w8, s8, backend="cpu"))])
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results):
        assert_equal(two, one)


def matrix_unit_build() -> dict:
    """The build whose many-row linears run on AMX tiles: this machine's own where the CPU has AMX,
    else the SIMDe build, which runs the same code on emulated tiles (skip without either)."""
    from kernels_cpu import build, quant_gemm
    if quant_gemm.load().amx():
        return {}
    if reason := build.why_not_runnable("avx512_simde"):
        pytest.skip(f"no AMX here, and no SIMDe build to emulate it: {reason}")
    return dict(isa="avx512_simde")


def test_the_matrix_unit_path_equals_the_reference():
    """bf16 x from 16 rows (each panel dequantized to bf16 once per block of 256 rows, 32 rows x 32
    columns per pass of the tiles): the reference within bf16's tolerance, for row counts around a
    tile (16, 31, 32, 33), a decode batch (64) and more than one block of rows (257); SmolLM2's
    shapes and odd ones (out not a multiple of a panel), int4 / int8, groups / per channel,
    symmetric / asymmetric, with and without bias. W8A8 (any x dtype, inputs a multiple of 64):
    the reference bit for bit, the tiles' int32 sums being exact."""
    from kernels_cpu import quant_gemm
    build_args = matrix_unit_build()
    assert quant_gemm.load(**build_args).amx()
    emulated = bool(build_args)
    tokens = (16, 33, 64) if emulated else (16, 31, 32, 33, 64, 257)      # emulated tiles are slow
    shapes = [(576, 960), (1536, 576), (512, 200), (256, 72)]
    for bits, symmetric, group_size in [(4, True, 32), (4, False, 64), (8, True, None), (8, False, 128)]:
        scheme = QuantScheme(bits, symmetric, group_size)
        for in_features, out_features in shapes_for(group_size, shapes[2:] if emulated else shapes):
            g = seeded("amx", bits, symmetric, group_size, in_features)
            packed, scale, zero = make_weight(out_features, in_features, scheme, g)
            prepared = quant_gemm.pack_wna16(packed, scale, zero, bits, group_size, **build_args)
            bias = torch.randn(out_features, generator=g)
            for T in tokens:
                x = torch.randn(T, in_features, generator=g).bfloat16()
                b = bias if T % 2 else None
                got = quant_gemm.wna16_linear(x, prepared, b, **build_args)
                expected = reference_ops.wna16_linear(x, packed, scale, zero, scheme, None if b is None else b.bfloat16())
                assert_close(got, expected, torch.bfloat16, msg=f"int{bits} sym={symmetric} g={group_size} "
                                                                 f"{in_features}->{out_features} T={T}")
    for in_features, out_features in [(576, 960), (256, 70)] if emulated else [(576, 960), (1536, 576), (256, 70)]:
        g = seeded("amx w8a8", in_features)
        w = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
        s = torch.rand(out_features, 1, generator=g)
        prepared = quant_gemm.pack_w8a8(w, s, **build_args)
        for T in tokens:
            for dtype in DTYPES:
                x = torch.randn(T, in_features, generator=g).to(dtype)
                assert_equal(quant_gemm.w8a8_linear(x, prepared, None, **build_args), w8a8_linear_reference(x, w, s),
                             f"W8A8 {in_features}->{out_features} T={T} {dtype}")


# ----------------------------------------------------------------------------- W8A8: exact

@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_equals_the_reference_bit_for_bit(dtype):
    """The per-token quantization, the int32 sums and the scaling in fp64 are the reference's: equal."""
    for in_features, out_features in SMOLLM2_SHAPES + ODD_SHAPES + [(130, 70)]:   # 130: inputs padded to 4
        g = seeded("w8a8", dtype, in_features, out_features)
        weight = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
        scale = (torch.rand(out_features, 1, generator=g) * 0.01).to(dtype)
        prepared = cpu_ops().prepare_w8a8(weight, scale)
        bias = torch.randn(out_features, generator=g).to(dtype)
        for T in TOKENS:
            x = (torch.randn(T, in_features, generator=g) * 3).to(dtype)
            b = bias if T % 2 else None
            expected = w8a8_linear_reference(x, weight, scale, b)
            assert_equal(ops.w8a8_linear(x, weight, scale, b, backend="cpu"), expected, f"T={T}")
            assert_equal(cpu_ops().w8a8_linear_prepared(x, prepared, b), expected, f"T={T}, prepared")


def w8a8_adversarial_cases(g: torch.Generator):
    """(x, weight, scale): the integer extremes (every product 127 * -128 or -127 * -128, long rows:
    sums near 2^25), ties of the rounding (x / scale = k + 0.5 exactly), zero rows of x (scale 1), a
    huge dynamic range within a row, and a row so small that its scale underflows to 0: x / scale
    is +-inf and the reference's activations are -128 and 127 (an int8 value that vpmaddubsw-style
    sign tricks cannot take)."""
    cases = []
    K = 3072
    w = torch.full((80, K), -128, dtype=torch.int8)
    w[1::2] = 127
    x = torch.full((3, K), -5.0)
    x[1] = 5.0
    x[2, ::2] = 5.0
    cases.append((x, w, torch.ones(80, 1)))
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0.0, -127.0])
    x = torch.stack([ties, ties * 2.0 ** -10, torch.zeros(12), ties * 3.0])
    cases.append((x, torch.randint(-128, 128, (70, 12), generator=g, dtype=torch.int8), torch.rand(70, 1, generator=g)))
    x = torch.randn(5, 576, generator=g) * 10.0 ** torch.empty(5, 576).uniform_(-8, 8, generator=g)
    w = torch.randint(-128, 128, (64, 576), generator=g, dtype=torch.int8)
    cases.append((x, w, torch.rand(64, 1, generator=g)))
    x = torch.tensor([[-1e-44, 3e-45, 6e-45, -3e-45, 0.0, 1e-45, -1e-44, 0.0],
                      [1.0, -2.0, 3.0, 0.5, 0.0, -1.0, 2.5, -3.0]])
    assert quantize_per_token_int8(x)[0].min() == -128
    w = torch.randint(-128, 128, (66, 8), generator=g, dtype=torch.int8)
    w[::3] = -128
    cases.append((x, w, torch.rand(66, 1, generator=g)))
    return cases


def test_w8a8_adversarial_inputs_are_exact():
    for x, w, s in w8a8_adversarial_cases(seeded("w8a8 adversarial")):
        assert_equal(ops.w8a8_linear(x, w, s, backend="cpu"), w8a8_linear_reference(x, w, s))


# ----------------------------------------------------------------------------- every instruction set

VARIANTS = {                      # name -> (isa, vnni, amx): the builds of csrc/quant_gemm.cpp
    "avx512_amx": ("avx512", True, True),     # many rows on AMX tiles (bf16 WNA16, W8A8)
    "avx512_vnni": ("avx512", True, False),
    "avx512": ("avx512", False, False),       # AVX-512 without VNNI: W8A8 on vpmaddwd
    "avx2": ("avx2", False, False),
    "scalar": ("scalar", False, False),
    "avx512_simde": ("avx512_simde", None, None),   # the AVX-512 source (vpdpbusd, vpermps, the tiles) emulated
}


def variant_skip_reason(name: str) -> str | None:
    from kernels_cpu import build, quant_gemm
    isa, vnni, amx = VARIANTS[name]
    if reason := build.why_not_runnable(isa):
        return reason
    if vnni and not quant_gemm.cpu_has_vnni():
        return "this CPU has no AVX-512 VNNI"
    if amx and not quant_gemm.cpu_has_amx():
        return "this CPU has no AMX (tiles, bf16 and int8 products)"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_instruction_set_build_gives_the_same_answers(variant):
    """Each build (compiled here on first use) against the reference: WNA16 through every path (one
    row tile, several, and AMX tiles for bf16 from 16 rows), W8A8 bit for bit (tiles from 16 rows
    where the inputs are a multiple of 64). The SIMDe build runs the AVX-512 code -- vpermps'
    nibble table, vpdpbusd -- and the AMX code on emulated tiles on any AVX2 machine, and is run
    even where AVX-512 and AMX are native."""
    from kernels_cpu import quant_gemm
    if reason := variant_skip_reason(variant):
        pytest.skip(reason)
    isa, vnni, amx = VARIANTS[variant]
    build_args = dict(isa=isa, vnni=vnni, amx=amx)
    module = quant_gemm.load(**build_args)
    assert module.isa() == isa and module.vnni() == (vnni is not False) and module.amx() == (amx is not False)
    g = seeded("isa", variant)
    for bits, symmetric, group_size in [(4, True, 64), (4, False, 32), (8, True, None), (8, False, 128)]:
        scheme = QuantScheme(bits, symmetric, group_size)
        packed, scale, zero = make_weight(200, 512, scheme, g)
        prepared = quant_gemm.pack_wna16(packed, scale, zero, bits, group_size, **build_args)
        for T, dtype in [(1, torch.float32), (3, torch.float32), (9, torch.float32), (9, torch.bfloat16),
                         (33, torch.bfloat16)]:
            x = torch.randn(T, 512, generator=g).to(dtype)
            got = quant_gemm.wna16_linear(x, prepared, None, **build_args)
            assert_close(got, reference_ops.wna16_linear(x, packed, scale, zero, scheme), dtype,
                         msg=f"{variant} int{bits} sym={symmetric} g={group_size} T={T}")
    cases = w8a8_adversarial_cases(g) + [(torch.randn(T, k, generator=g),
                                          torch.randint(-128, 128, (70, k), generator=g, dtype=torch.int8),
                                          torch.rand(70, 1, generator=g)) for T, k in [(1, 130), (9, 130), (33, 256)]]
    for i, (x, w, s) in enumerate(cases):                    # every other case with a bias
        prepared = quant_gemm.pack_w8a8(w, s, **build_args)
        bias = torch.randn(w.shape[0], generator=g, dtype=torch.float64) if i % 2 else None
        assert_equal(quant_gemm.w8a8_linear(x, prepared, bias, **build_args), w8a8_linear_reference(x, w, s, bias),
                     f"{variant} W8A8 {tuple(x.shape)} bias={bias is not None}")


# ----------------------------------------------------------------------------- bad input

def _wna16_args(**over):
    scheme = QuantScheme(4, False, 32)
    packed, scale, zero = make_weight(72, 256, scheme, seeded("bad"))
    args = dict(x=torch.randn(3, 256), weight_packed=packed, weight_scale=scale, weight_zero_point=zero,
                scheme=scheme, bias=None)
    args.update(over)
    return args


BAD_WNA16 = {
    "x columns": (dict(x=torch.randn(3, 128)), "columns"),
    "1-D x": (dict(x=torch.randn(256)), r"\[T, in\]"),
    "int x": (dict(x=torch.ones(3, 256, dtype=torch.int32)), "x must be one of"),
    "bias shape": (dict(bias=torch.randn(71)), "bias must be"),
    "scale shape": (dict(weight_scale=torch.rand(72, 4)), "weight_scale"),
    "zero point for a symmetric scheme": (dict(scheme=QuantScheme(4, True, 32)), "weight_zero_point"),
    "packed dtype": (dict(weight_packed=torch.zeros(72, 32, dtype=torch.int64)), "weight_packed"),
}


@pytest.mark.parametrize("bad", list(BAD_WNA16))
def test_bad_wna16_arguments_raise_a_clear_value_error(bad):
    over, match = BAD_WNA16[bad]
    with pytest.raises(ValueError, match=match):
        cpu_ops().wna16_linear(**_wna16_args(**over))
    with pytest.raises(ValueError, match=match):
        ops.wna16_linear(**_wna16_args(**over), backend="cpu")


def test_bad_arguments_of_the_prepared_forms():
    """The prepared forms check what changes per call (x, bias) against the prepared weight; a group
    smaller than one word's values is refused when preparing."""
    args = _wna16_args()
    prepared = cpu_ops().prepare_wna16(args["weight_packed"], args["weight_scale"], args["weight_zero_point"],
                                       args["scheme"])
    with pytest.raises(ValueError, match="x has 128 columns"):
        cpu_ops().wna16_linear_prepared(torch.randn(2, 128), prepared)
    with pytest.raises(ValueError, match="bias must be"):
        cpu_ops().wna16_linear_prepared(torch.randn(2, 256), prepared, torch.randn(3))
    tiny = QuantScheme(4, True, 4)
    q = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_ops().prepare_wna16(packing.pack_int32(q, 4), torch.ones(8, 4), None, tiny)
    w8 = torch.zeros(10, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="weight must be int8"):
        cpu_ops().prepare_w8a8(w8.int(), torch.ones(10, 1))
    with pytest.raises(ValueError, match="weight_scale"):
        cpu_ops().prepare_w8a8(w8, torch.ones(9, 1))
    prepared8 = cpu_ops().prepare_w8a8(w8, torch.ones(10, 1))
    with pytest.raises(ValueError, match="x has 15 columns"):
        cpu_ops().w8a8_linear_prepared(torch.randn(2, 15), prepared8)
    with pytest.raises(ValueError, match="x must be one of"):
        cpu_ops().w8a8_linear_prepared(torch.ones(2, 16, dtype=torch.int8), prepared8)


# ----------------------------------------------------------------------------- benchmark

def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_quant_ops.py --quick: one shape, T = 1, every side checked against the
    reference before it is timed, the JSON written."""
    import json

    from benchmarks import bench_quant_ops

    result = bench_quant_ops.main(["--quick", "--out-dir", str(tmp_path)])
    assert [(r["layer"], r["tokens"]) for r in result["rows"]] == [("o_proj", 1)]
    row = result["rows"][0]
    assert all(row[f"{side} us"] > 0 for side in bench_quant_ops.SIDES)
    saved = json.loads(result["path"].read_text())
    assert saved["rows"] == result["rows"] and saved["workload"]["isa"]
