"""Chapter 10's grid, RTN and packing against compressed-tensors itself (the library llmcompressor
writes checkpoints with and vLLM reads them with): the same scales, zero points, integers and
int32 words, bit for bit."""
import pytest
import torch

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from quantization import packing
from quantization.reference import (QuantScheme, compute_qparams, dequantize, linear_reference, quantize,
                                    quantize_per_token_int8, quantize_rtn, w8a8_linear_reference)
from tolerances import assert_close, assert_equal

SCHEMES = [QuantScheme(4, True, 128), QuantScheme(4, False, 64), QuantScheme(4, True, 32),
           QuantScheme(8, True, None), QuantScheme(8, False, 128), QuantScheme(4, True, None)]


def ct_args(s: QuantScheme) -> QuantizationArgs:
    return QuantizationArgs(num_bits=s.num_bits, type="int", symmetric=s.symmetric, strategy=s.strategy,
                            group_size=s.group_size)


def ct_qparams(w: torch.Tensor, s: QuantScheme):
    """compressed-tensors' scale / zero point from each group's min and max."""
    g = w.reshape(w.shape[0], s.groups(w.shape[1]), -1)
    return calculate_qparams(g.amin(-1), g.amax(-1), ct_args(s))


def weights(seed: int, out: int = 48, inp: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g)   # rows of different ranges
    w[0] = 0.0                                                                 # an all-zero row
    w[1, :64] = w[1, :64].abs()                                                # groups of one sign
    w[2, 64:128] = -w[2, 64:128].abs()
    return w


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_qparams_and_integers_equal_compressed_tensors(scheme):
    w = weights(0)
    scale, zero = compute_qparams(w, scheme)
    ct_scale, ct_zero = ct_qparams(w, scheme)
    nonzero = ct_scale > torch.finfo(torch.float32).eps          # an all-zero group: any scale is exact
    assert_close(scale[nonzero], ct_scale[nonzero])
    assert_equal(zero, ct_zero.round().to(torch.int8))
    q = quantize(w, scale, zero, scheme)
    ct_q = ct_quantize(w, ct_scale, ct_zero, ct_args(scheme), dtype=torch.int8)
    assert_equal(q, ct_q)
    assert_close(dequantize(q, scale, zero, scheme), ct_dequantize(ct_q, ct_scale, ct_zero, ct_args(scheme)))


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_rtn_error_is_at_most_half_a_step(scheme):
    w = weights(1)
    qw = quantize_rtn(w, scheme)
    step = qw.scale.repeat_interleave(w.shape[1] // qw.scale.shape[1], dim=1)
    err = (qw.dequantize() - w).abs()
    # Symmetric grids clip the one value at +max (7.5 steps rounds to 8, the grid stops at 7): a whole step.
    bound = step * (1.0 if scheme.symmetric else 0.5) * (1 + 1e-5) + 1e-7
    assert bool((err <= bound).all()), f"max error {float((err / step).max()):.3f} steps"
    assert qw.q.min() >= scheme.qmin and qw.q.max() <= scheme.qmax


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_int32_equals_compressed_tensors_words(bits, dim):
    g = torch.Generator().manual_seed(bits + dim)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (64, 96), generator=g, dtype=torch.int8)
    packed = packing.pack_int32(q, bits, dim=dim)
    assert_equal(packed, pack_to_int32(q, bits, packed_dim=dim))
    assert_equal(packing.unpack_int32(packed, bits, dim=dim), q)
    assert_equal(unpack_from_int32(packed, bits, q.shape, packed_dim=dim), q)


def test_pack_rejects_a_length_that_is_not_whole_words():
    with pytest.raises(ValueError, match="not a multiple"):
        packing.pack_int32(torch.zeros(4, 12, dtype=torch.int8), 4)


def test_gptq_and_awq_layouts_hold_the_same_integers():
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (32, 64), generator=g, dtype=torch.int8)
    gptq = packing.pack_gptq(q)
    assert gptq.shape == (64 // 8, 32)                             # [in / 8, out]
    assert_equal(packing.unpack_gptq(gptq), q)
    awq = packing.pack_awq(q)
    assert awq.shape == (64, 32 // 8)                              # [in, out / 8]
    assert_equal(packing.unpack_awq(awq), q)
    # AWQ's word order: nibble j of a word holds output column AWQ_ORDER[j] of its eight
    word = int(awq[0, 0]) & 0xFFFFFFFF
    nibbles = [((word >> (4 * j)) & 0xF) - 8 for j in range(8)]
    assert nibbles == [int(q[c, 0]) for c in packing.AWQ_ORDER]


def test_scheme_rejects_unsupported_bits_and_groups():
    with pytest.raises(ValueError, match="num_bits 3"):
        QuantScheme(3, True, 128)
    with pytest.raises(ValueError, match="power of two"):
        QuantScheme(4, True, 96)
    with pytest.raises(ValueError, match="not a multiple of group_size 128"):
        quantize_rtn(torch.randn(4, 576), QuantScheme(4, True, 128))      # SmolLM2's hidden size


def test_linear_reference_is_the_dequantized_matmul():
    w, x = weights(4, 32, 128), torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    qw = quantize_rtn(w, QuantScheme(4, False, 32))
    assert_close(linear_reference(x, qw), x @ qw.dequantize().t())


def test_per_token_int8_and_w8a8_reference():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 64, generator=g)
    x[2] = 0.0                                                     # an all-zero token keeps scale 1
    xq, scale = quantize_per_token_int8(x)
    assert_equal(xq[2], torch.zeros(64, dtype=torch.int8))
    assert float(scale[2]) == 1.0
    assert_equal(xq.abs().amax(-1)[[0, 1, 3, 4, 5]], torch.full((5,), 127, dtype=torch.int8))
    w = torch.randn(16, 64, generator=g)
    qw = quantize_rtn(w, QuantScheme(8, True, None))
    y = w8a8_linear_reference(x, qw.q, qw.scale)
    expected = (xq.double() * scale.double()) @ (qw.q.double() * qw.scale.double()).t()
    assert_close(y, expected.float())
