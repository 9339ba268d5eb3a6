"""Chapter 10's "triton" backend (quantization/triton_ops.py) against quantization.reference_ops.

Without CUDA the kernels run under the Triton interpreter (tests/conftest.py) on small shapes; the
`gpu` tests run the compiled kernels on SmolLM2-135M's layer shapes (`make test-gpu`, and the
tests step of `make gpu-check`), with the reference computed on the CPU.

What is exact and what is a tolerance:
  * WNA16: the kernel multiplies the reference's dequantized weights bit for bit (rounded to the
    scales' dtype, as reference.dequantize does) and sums in fp32 in another order: the table's
    tolerance (tests/tolerances.py). With one-hot rows of x (x = I) the sums have one term, so
    the output IS the dequantized W^T, exactly: that checks unpacking, zero points and group
    scales bit for bit on both the decode (split-K) and the prefill path;
  * W8A8: the per-token quantization (scale, and xq with round-half-to-even ties) is the
    reference's bit for bit, the int32 sums are exact and the epilogue runs in fp64 in the
    reference's order: y equals the reference bit for bit, every dtype.
Cases (CPU): int4 / int8 x group 32, 64, 128, 256 / per channel x symmetric / asymmetric x fp32 /
bf16 / fp16, each at T = 1 (decode: split-K) and T = 37 (prefill tiles, masked rows), with and
without bias; out = 40 there (one partial tile of rows) and 72 elsewhere (two tiles), per-channel
in = 200 (a partial K step); scales in another dtype than x; strided views; explicit split counts;
sm_90 compilation of the GPU tests' launches (ptxas, no GPU needed)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from tolerances import assert_close, assert_equal

from quantization import ops, packing, reference, reference_ops, triton_ops
from quantization.reference import QuantScheme, quantize_rtn

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUPS = [32, 64, 128, 256, None]
OUT = 72                          # two tiles of 64 rows, the second partial
# The interpreter's time goes by (program, K step): the many-case matrix runs one partial tile of
# rows and, for fp32 x, the 16-bit launch's 64/128-deep K steps instead of the fp32 dot's 16-deep
# ones (those run in the one-hot, split and mixed-dtype tests, and on the GPU).
MATRIX_OUT = 40


def seeded(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, "/".join(map(str, parts)))))


def make_weight(out_features: int, in_features: int, scheme: QuantScheme, dtype: torch.dtype, g: torch.Generator):
    """RTN-quantized random weights as a checkpoint stores them: (weight_packed int32, weight_scale in
    `dtype`, weight_zero_point int8 or None). Shifted off zero so that asymmetric zero points vary."""
    w = (torch.randn(out_features, in_features, generator=g) * 0.05 + 0.01).to(dtype)
    qw = quantize_rtn(w, scheme)
    zero = None if scheme.symmetric else qw.zero_point
    return packing.pack_int32(qw.q, scheme.num_bits), qw.scale, zero


def in_features_for(group_size: int | None) -> int:
    """At least two groups per row; per channel a K that is no multiple of any BLOCK_K."""
    return 200 if group_size is None else max(128, 2 * group_size)


# ----------------------------------------------------------------------------- WNA16 (interpreter)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", GROUPS, ids=lambda g: f"g{g}" if g else "channel")
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_wna16_equals_the_reference(bits, group_size, symmetric, dtype):
    scheme = QuantScheme(bits, symmetric, group_size)
    g = seeded(bits, group_size, symmetric, dtype)
    K = in_features_for(group_size)
    packed, scale, zero = make_weight(MATRIX_OUT, K, scheme, dtype, g)
    assert zero is None or len(set(zero.flatten().tolist())) > 1
    bias = torch.randn(MATRIX_OUT, generator=g).to(dtype)
    for T in (1, 37):
        x = torch.randn(T, K, generator=g).to(dtype)
        tiles = triton_ops.choose_tiles(T, K, group_size) if dtype == torch.float32 else None
        for b in (None, bias):
            expected = reference_ops.wna16_linear(x, packed, scale, zero, scheme, b)
            if tiles is None:
                got = ops.wna16_linear(x, packed, scale, zero, scheme, b, backend="triton")
            else:
                got = triton_ops.wna16_linear(x, packed, scale, zero, scheme, b, tiles=tiles)
            assert got.dtype == dtype
            assert_close(got, expected, msg=f"T={T} bias={b is not None}")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, None], ids=["g32", "channel"])
def test_wna16_one_hot_rows_give_the_dequantized_weight_exactly(bits, group_size, symmetric):
    """x = rows of I: y[t] = W[:, t], one product per sum, so nothing but the unpacking, the zero
    points and the scales can differ. Every code of the grid occurs (qmin..qmax, words with the top
    bit set: negative int32), fp32 scales and zero points of any value."""
    scheme = QuantScheme(bits, symmetric, group_size)
    g = seeded("one-hot", bits, group_size, symmetric)
    K = 64
    groups = scheme.groups(K)
    q = torch.randint(scheme.qmin, scheme.qmax + 1, (OUT, K), generator=g, dtype=torch.int8)
    q[0], q[1] = scheme.qmin, scheme.qmax
    scale = torch.rand(OUT, groups, generator=g) + 0.01
    zero = (torch.zeros(OUT, groups, dtype=torch.int8) if symmetric
            else torch.randint(scheme.qmin, scheme.qmax + 1, (OUT, groups), generator=g, dtype=torch.int8))
    packed = packing.pack_int32(q, bits)
    assert (packed < 0).any()
    expected = reference.dequantize(q, scale, zero, scheme).t()              # [K, OUT] fp32
    eye = torch.eye(K)
    for x in (eye, eye[:16]):                                                # prefill tiles; decode (split-K)
        got = triton_ops.wna16_linear(x, packed, scale, None if symmetric else zero, scheme)
        assert_equal(got, expected[:x.shape[0]].contiguous())


@pytest.mark.parametrize("x_dtype,scale_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                 (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)])
def test_wna16_scales_in_another_dtype(x_dtype, scale_dtype):
    """The weights are rounded to the SCALES' dtype (reference.dequantize) and the dot runs in fp32."""
    scheme = QuantScheme(4, False, 32)
    g = seeded("dtypes", x_dtype, scale_dtype)
    packed, scale, zero = make_weight(OUT, 128, scheme, scale_dtype, g)
    bias = torch.randn(OUT, generator=g).to(x_dtype)
    for T in (3, 20):
        x = torch.randn(T, 128, generator=g).to(x_dtype)
        expected = reference_ops.wna16_linear(x, packed, scale, zero, scheme, bias)
        assert_close(triton_ops.wna16_linear(x, packed, scale, zero, scheme, bias), expected, msg=f"T={T}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wna16_every_split_count(dtype):
    """Split-K by hand: 1 (no partials), 3 (uneven), 100 (capped: one K step each) at decode, 3 at
    prefill tile sizes; always the reference's numbers."""
    scheme = QuantScheme(4, True, 32)
    g = seeded("splits", dtype)
    packed, scale, zero = make_weight(OUT, 256, scheme, dtype, g)
    bias = torch.randn(OUT, generator=g).to(dtype)
    for T, split_counts in ((5, (1, 3, 100)), (37, (3,))):
        x = torch.randn(T, 256, generator=g).to(dtype)
        expected = reference_ops.wna16_linear(x, packed, scale, zero, scheme, bias)
        for split_k in split_counts:
            got = triton_ops.wna16_linear(x, packed, scale, zero, scheme, bias, split_k=split_k)
            assert_close(got, expected, msg=f"T={T} split_k={split_k}")


def test_wna16_strided_views():
    """x, weight_packed, weight_scale, weight_zero_point and bias as non-contiguous views."""
    scheme = QuantScheme(4, False, 64)
    g = seeded("strided")
    packed, scale, zero = make_weight(OUT, 256, scheme, torch.float16, g)
    wide = torch.zeros(OUT, packed.shape[1] + 5, dtype=torch.int32)
    wide[:, :packed.shape[1]] = packed
    bias = torch.randn(2 * OUT, generator=g).to(torch.float16)[::2]
    views = (wide[:, :packed.shape[1]], scale.t().contiguous().t(), zero.t().contiguous().t())
    assert not any(v.is_contiguous() for v in (*views, bias))
    for T in (2, 40):
        x = torch.randn(T, 512, generator=g).to(torch.float16)[:, ::2]
        expected = reference_ops.wna16_linear(x.contiguous(), packed, scale, zero, scheme, bias.contiguous())
        got = ops.wna16_linear(x, *views, scheme, bias, backend="triton")
        assert_close(got, expected, msg=f"T={T}")


def test_wna16_empty_batch_and_small_groups():
    scheme = QuantScheme(4, True, 32)
    packed, scale, _ = make_weight(OUT, 64, scheme, torch.float32, seeded("empty"))
    y = triton_ops.wna16_linear(torch.zeros(0, 64), packed, scale, None, scheme)
    assert y.shape == (0, OUT) and y.dtype == torch.float32
    small = QuantScheme(4, True, 8)
    packed, scale, _ = make_weight(OUT, 64, small, torch.float32, seeded("small"))
    with pytest.raises(ValueError, match="group_size >= 16"):
        triton_ops.wna16_linear(torch.zeros(1, 64), packed, scale, None, small)


def test_launch_choices():
    """Decode: 16-row tiles and split-K up to ~256 programs; prefill: 64 x 64 tiles, no split;
    BLOCK_K never crosses a group; fp32 dots take 16-deep K steps (no spills on sm_90)."""
    assert triton_ops.choose_tiles(1, 576, 64) == triton_ops.Tiles(16, 64, 64)
    assert triton_ops.choose_tiles(1, 1536, None) == triton_ops.Tiles(16, 64, 128)
    assert triton_ops.choose_tiles(256, 576, 32) == triton_ops.Tiles(64, 64, 32)
    assert triton_ops.choose_tiles(256, 576, None, dot_fp32=True) == triton_ops.Tiles(64, 64, 16, num_warps=8)
    assert triton_ops.choose_split_k(9, 9) == 9                   # o_proj at T = 1: one split per K step
    assert triton_ops.choose_split_k(48, 9) == 6                  # gate_up: 48 tiles x 6 ~ 256 programs
    assert triton_ops.choose_split_k(256, 12) == 1                # enough tiles already
    assert triton_ops.choose_split_k(5, 1) == 1


def test_dispatch_reaches_the_triton_module():
    """ops.py's backend check (paged_attention.ops.check_kernel_backend) lets "triton" through on
    CPU tensors under the interpreter and names the Triton rung when asked for "cuda"."""
    assert ops.backend_module("triton", torch.device("cpu")) is triton_ops
    with pytest.raises(ValueError, match="triton"):
        ops.backend_module("cuda", torch.device("cpu"))


# ----------------------------------------------------------------------------- W8A8 (interpreter)

TIE_ROW = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, -3.5, 0.0]
TIE_EXPECTED = [127, 0, 2, 2, 0, -2, -2, 126, -126, 4, -4, 0]     # round half to even, as torch.round


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_half_to_even_ties(dtype):
    """Rows whose scale is a power of two (max|x| = 127 * 2^e), so x / scale lands exactly on .5:
    ties go to the even integer. In fp32 also 0.49999997 (just below 0.5): floor(v + 0.5) would
    round it to 1, the magic-number rounding (and rint) to 0. An all-zero row gets scale 1."""
    rows = [[v * 2.0 ** e for v in TIE_ROW] for e in (0, -3, 2, -10)] + [[0.0] * len(TIE_ROW)]
    if dtype == torch.float32:
        rows.append([127.0, 0.49999997, -0.49999997] + [0.0] * (len(TIE_ROW) - 3))
    x = torch.tensor(rows).to(dtype)
    assert torch.equal(x[:4].float(), torch.tensor(rows[:4]))                 # every tie representable
    xq, scale = triton_ops.quantize_per_token_int8(x)
    for row in xq[:4]:
        assert row.tolist() == TIE_EXPECTED
    assert scale.flatten()[:5].tolist() == [1.0, 2.0 ** -3, 4.0, 2.0 ** -10, 1.0]
    assert not xq[4].any()
    if dtype == torch.float32:
        assert xq[5, :3].tolist() == [127, 0, 0]
    ref_q, ref_scale = reference.quantize_per_token_int8(x)
    assert_equal(xq, ref_q)
    assert_equal(scale, ref_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [200, 2500])
def test_quantize_per_token_equals_the_reference(dtype, K):
    """Random rows of very different magnitudes (one row 1e4, one 1e-6), an all-zero row, a strided
    view; K = 2500 takes three steps of the kernel's loops."""
    g = seeded("quant", dtype, K)
    x = torch.randn(6, 2 * K, generator=g) * torch.tensor([1.0, 1e4, 1e-6, 0.0, 3.0, 0.1])[:, None]
    x = x.to(dtype)[:, ::2]
    xq, scale = triton_ops.quantize_per_token_int8(x)
    ref_q, ref_scale = reference.quantize_per_token_int8(x)
    assert_equal(xq, ref_q)
    assert_equal(scale, ref_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_w8a8_equals_the_reference_bit_for_bit(dtype, with_bias):
    g = seeded("w8a8", dtype, with_bias)
    K = 200
    weight = torch.randint(-128, 128, (OUT, K), generator=g, dtype=torch.int8)
    for T, scale_shape, scale_dtype in ((1, (OUT, 1), torch.float32), (37, (OUT,), dtype)):
        w_scale = (torch.rand(scale_shape, generator=g) * 0.01 + 1e-4).to(scale_dtype)
        bias = torch.randn(OUT, generator=g).to(dtype) if with_bias else None
        x = (torch.randn(T, K, generator=g) * 3).to(dtype)
        expected = reference_ops.w8a8_linear(x, weight, w_scale, bias)
        assert_equal(ops.w8a8_linear(x, weight, w_scale, bias, backend="triton"), expected, what=f"T={T}")


def test_w8a8_integer_sums_are_exact():
    """max|x_t| = 127 and integer x: x_scale = 1, so with w_scale = 1 y IS the integer sum (fp32
    holds it exactly: < 2^24). Weights include -128 and 127 rows."""
    g = seeded("w8a8-int")
    K = 256
    x = torch.randint(-127, 128, (20, K), generator=g).float()
    x[:, 0] = 127.0
    x[1] = -127.0
    weight = torch.randint(-128, 128, (OUT, K), generator=g, dtype=torch.int8)
    weight[0], weight[1] = -128, 127
    expected = (x.long() @ weight.long().t()).float()
    assert_equal(triton_ops.w8a8_linear(x, weight, torch.ones(OUT, 1)), expected)


def test_w8a8_strided_and_empty():
    g = seeded("w8a8-strided")
    weight = torch.randint(-128, 128, (OUT, 2 * 96), generator=g, dtype=torch.int8)[:, ::2]
    w_scale = torch.rand(2 * OUT, generator=g)[::2]
    x = torch.randn(9, 2 * 96, generator=g).to(torch.bfloat16)[:, 1::2]
    expected = reference_ops.w8a8_linear(x, weight, w_scale)
    assert_equal(ops.w8a8_linear(x, weight, w_scale, backend="triton"), expected)
    assert triton_ops.w8a8_linear(torch.zeros(0, 96), weight, w_scale).shape == (0, OUT)


# ----------------------------------------------------------------------------- sm_90 compilation

TESTS_DIR = pathlib.Path(__file__).resolve().parent.parent
# The launches the gpu tests below make (choose_tiles' picks for SmolLM2's shapes), compiled for
# Hopper without a GPU, in a subprocess with TRITON_INTERPRET=0 (this session may interpret).
COMPILE_SCRIPT = r"""
import json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])             # tests/: ptxas_report
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantization import triton_ops as Q
from ptxas_report import ptxas_report

TARGET = GPUTarget("cuda", 90, 32)
DT = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}

def compile_one(label, fn, const, ptrs, tiles=None, **options):
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*fp32") if n.endswith("_ptr") else "i32"
           for n in fn.arg_names}
    if tiles is not None:
        options.update(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    kernel = triton.compile(ASTSource(fn, sig, const), target=TARGET, options=options)
    report = ptxas_report(kernel, label)
    ptx = kernel.asm["ptx"]
    report.update(rni="cvt.rni.f32.f32" in ptx, div_rn="div.rn.f32" in ptx, fma64="fma.rn.f64" in ptx,
                  mma=bool(re.search(r"\bw?mma", ptx)))
    return report

results = []
for dt in ("bf16", "fp32"):
    p = DT[dt]
    fp32 = dt == "fp32"
    for T, bits, group, zero, K in ((1, 4, 64, False, 576), (256, 8, None, True, 1536)) if dt == "bf16" else \
                                   ((1, 8, None, True, 1536), (256, 4, 64, False, 576)):
        tiles = Q.choose_tiles(T, K, group, dot_fp32=fp32)
        split = T <= Q.DECODE_MAX_T
        const = dict(BITS=bits, HAS_ZERO=zero, HAS_BIAS=not split, DOT_FP32=fp32, PRECISION="ieee" if fp32 else "tf32",
                     UPCAST=False, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k)
        ptrs = dict(x_ptr=p, w_ptr="*i32", scale_ptr=p, zero_ptr="*i8", bias_ptr=p, out_ptr="*fp32" if split else p)
        results.append(compile_one(f"wna16_{dt}_T{T}_int{bits}_g{group}", Q._wna16_kernel, const, ptrs, tiles))
    if dt == "fp32":
        continue                            # quantization and W8A8 do the same in every dtype
    results.append(compile_one(f"quant_{dt}", Q._quantize_int8_kernel, dict(BLOCK=Q.QUANT_BLOCK, GPU_MATH=True),
                               dict(x_ptr=p, xq_ptr="*i8", scale_ptr="*fp32")))
    for T in (1, 256):
        tiles = Q.choose_tiles(T, 576, None, min_block_k=32)
        const = dict(HAS_BIAS=True, UPCAST=False, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k)
        ptrs = dict(xq_ptr="*i8", w_ptr="*i8", xs_ptr="*fp32", ws_ptr=p, bias_ptr=p, out_ptr=p)
        results.append(compile_one(f"w8a8_{dt}_T{T}", Q._w8a8_kernel, const, ptrs, tiles, enable_fp_fusion=False))
print(json.dumps(results))
"""


def test_every_kernel_compiles_for_sm90_without_spills():
    """What a GPU would compile, checked here: no register spills; the 16-bit WNA16 and the W8A8
    dots on tensor cores (mma); the quantization rounds with cvt.rni and divides with div.rn; the
    W8A8 epilogue has no fp64 FMA (fusion off: the reference's two roundings)."""
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(TESTS_DIR)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["label"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert len(results) == 2 * 2 + 1 + 2, results.keys()
    assert not [r for r in results.values() if r["spills"]], results
    assert all(r["mma"] for label, r in results.items() if label.startswith(("wna16_bf16", "w8a8")))
    assert all(r["rni"] and r["div_rn"] for label, r in results.items() if label.startswith("quant"))
    assert not any(r["fma64"] for label, r in results.items() if label.startswith("w8a8"))


# ----------------------------------------------------------------------------- GPU (native Triton)

# SmolLM2-135M's linear layers: (in_features, out_features); q/k/v and gate/up fused as vLLM does.
SMOLLM2_LAYERS = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576)}
GPU_SCHEMES = {
    "int4_g32_asym": QuantScheme(4, False, 32),
    "int4_g64_sym": QuantScheme(4, True, 64),
    "int4_g128_sym": QuantScheme(4, True, 128),              # 1536 only (576 is no multiple of 128)
    "int4_channel_asym": QuantScheme(4, False, None),
    "int8_g256_asym": QuantScheme(8, False, 256),            # 1536 only
    "int8_channel_sym": QuantScheme(8, True, None),
}
GPU_TOKENS = (1, 16, 256)          # a decode step, a batch of decodes, a prefill chunk


def gpu_layers(scheme: QuantScheme | None = None):
    """(name, in, out) of every SmolLM2 layer the scheme's groups divide."""
    return [(name, K, N) for name, (K, N) in SMOLLM2_LAYERS.items()
            if scheme is None or scheme.group_size is None or K % scheme.group_size == 0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme_name", list(GPU_SCHEMES))
def test_wna16_on_the_gpu_equals_the_reference(scheme_name, dtype):
    """The compiled kernels at SmolLM2's shapes, decode (split-K) and prefill, against the CPU
    reference; the bias on qkv_proj only (as Qwen2's q/k/v have one)."""
    scheme = GPU_SCHEMES[scheme_name]
    g = seeded("gpu", scheme_name, dtype)
    for name, K, N in gpu_layers(scheme):
        packed, scale, zero = make_weight(N, K, scheme, dtype, g)
        bias = torch.randn(N, generator=g).to(dtype) if name == "qkv_proj" else None
        on_gpu = [t.cuda() if t is not None else None for t in (packed, scale, zero, bias)]
        for T in GPU_TOKENS:
            x = torch.randn(T, K, generator=g).to(dtype)
            expected = reference_ops.wna16_linear(x, packed, scale, zero, scheme, bias)
            got = ops.wna16_linear(x.cuda(), on_gpu[0], on_gpu[1], on_gpu[2], scheme, on_gpu[3], backend="triton")
            assert got.is_cuda and got.dtype == dtype
            assert_close(got.cpu(), expected, msg=f"{name} T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, None], ids=["g32", "channel"])
def test_wna16_on_the_gpu_one_hot_rows_exact(bits, group_size):
    """x = rows of I at in = 576, out = 960: the compiled kernel's output is the dequantized W^T bit
    for bit (decode: 16 rows, split-K; prefill: all 576)."""
    scheme = QuantScheme(bits, False, group_size)
    g = seeded("gpu-one-hot", bits, group_size)
    K, N = SMOLLM2_LAYERS["qkv_proj"]
    groups = scheme.groups(K)
    q = torch.randint(scheme.qmin, scheme.qmax + 1, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, groups, generator=g) + 0.01
    zero = torch.randint(scheme.qmin, scheme.qmax + 1, (N, groups), generator=g, dtype=torch.int8)
    expected = reference.dequantize(q, scale, zero, scheme).t().contiguous()    # [K, N]
    packed = packing.pack_int32(q, bits).cuda()
    eye = torch.eye(K, device="cuda")
    for x in (eye[:16], eye):
        got = triton_ops.wna16_linear(x, packed, scale.cuda(), zero.cuda(), scheme)
        assert_equal(got.cpu(), expected[:x.shape[0]])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_on_the_gpu_equals_the_reference_bit_for_bit(dtype):
    """The per-token quantization (libdevice rint, div.rn), the int8 tensor-core dot and the fp64
    epilogue at SmolLM2's shapes: the CPU reference's numbers exactly; the bias on qkv_proj."""
    g = seeded("gpu-w8a8", dtype)
    for name, K, N in gpu_layers():
        weight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        w_scale = (torch.rand(N, 1, generator=g) * 0.01 + 1e-4).to(dtype)
        bias = torch.randn(N, generator=g).to(dtype) if name == "qkv_proj" else None
        for T in GPU_TOKENS:
            x = (torch.randn(T, K, generator=g) * 3).to(dtype)
            expected = reference_ops.w8a8_linear(x, weight, w_scale, bias)
            got = ops.w8a8_linear(x.cuda(), weight.cuda(), w_scale.cuda(), None if bias is None else bias.cuda(),
                                  backend="triton")
            assert_equal(got.cpu(), expected, what=f"{name} T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_per_token_on_the_gpu_ties(dtype):
    """libdevice's rint rounds ties to even (the interpreter's formula is checked on the CPU), and
    the compiled kernel is the reference bit for bit on SmolLM2-wide random rows."""
    rows = [[v * 2.0 ** e for v in TIE_ROW] for e in (0, -3, 2, -10)]
    x = torch.tensor(rows).to(dtype)
    xq, scale = triton_ops.quantize_per_token_int8(x.cuda())
    assert all(row == TIE_EXPECTED for row in xq.cpu().tolist())
    assert scale.flatten().tolist() == [1.0, 2.0 ** -3, 4.0, 2.0 ** -10]
    x = (torch.randn(256, 1536, generator=seeded("gpu-quant", dtype)) * 3).to(dtype)
    xq, scale = triton_ops.quantize_per_token_int8(x.cuda())
    ref_q, ref_scale = reference.quantize_per_token_int8(x)
    assert_equal(xq.cpu(), ref_q)
    assert_equal(scale.cpu(), ref_scale)
