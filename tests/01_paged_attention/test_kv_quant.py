"""Chapter 01's 8-bit cache rows (kv_quant.py; vLLM's kv_cache_dtype): what a quantized row holds
and what reading it back gives. The kernels of every backend against these: chapter 10's
tests/10_quantization/test_kv_cache.py."""
import pytest
import torch

from paged_attention import ops
from paged_attention.kv_quant import FP8_MAX, KVQuant, dequantize_rows, inline_scales, quantize_rows
from paged_attention.reference import dense_attention

MODES = {
    "int8_per_token_head": KVQuant("int8_per_token_head"),
    "fp8_per_token_head": KVQuant("fp8_per_token_head"),
    "fp8": KVQuant("fp8", k_scale=0.02, v_scale=0.01),
}


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_row_is_within_half_a_step_of_the_truth(mode):
    """The shadow of the truth: int8 rows dequantize to within scale / 2 of x, fp8 rows within
    1/16 relative (3 mantissa bits) plus half the smallest subnormal step; per-row scales are
    absmax / qmax, stored in the row's last 4 bytes."""
    kq = MODES[mode]
    x = torch.randn(200, 4, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 200)[:, None, None]
    x = x * (0.005 if mode == "fp8" else 1)                           # per-tensor: inside the scaled range
    rows = quantize_rows(x, kq, "k")
    assert rows.dtype == kq.storage_dtype and rows.shape[-1] == kq.cache_head_dim(64)
    back = dequantize_rows(rows, kq, "k", 64)
    if kq.per_token_head:
        scale = inline_scales(rows, 64)
        assert torch.equal(scale, (x.abs().amax(-1) / kq.qmax).clamp_min(1e-6))
    else:
        scale = torch.full(x.shape[:-1], kq.k_scale)
    if kq.storage_dtype == torch.int8:
        assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()
    else:
        assert ((back - x).abs() <= (x.abs() / 16 + 2.0 ** -9 * scale[..., None]) * (1 + 1e-6)).all()


@pytest.mark.parametrize("mode", MODES)
def test_numbers_on_the_grid_come_back_exactly(mode):
    """A row whose numbers are already grid points times the scale round-trips exactly; V uses
    the layer's v_scale (per-tensor), K its k_scale."""
    kq = MODES[mode]
    if kq.storage_dtype == torch.int8:
        q = torch.randint(-127, 128, (50, 2, 32), generator=torch.Generator().manual_seed(5)).float()
        q[:, :, 0] = 127                                              # the row's absmax is a grid end
    else:
        q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        q = q[q.isfinite()][:224].reshape(7, 1, 32).repeat(1, 2, 1)
        q[:, :, 0] = FP8_MAX
    scale = 0.25 if kq.per_token_head else kq.v_scale
    x = q * scale
    assert torch.equal(dequantize_rows(quantize_rows(x, kq, "v"), kq, "v", 32), x)


@pytest.mark.parametrize("mode", MODES)
def test_reference_and_torch_write_the_same_bytes_and_read_within_the_rounding(mode):
    """The cache write quantizes each row (the reference loop and the torch scatter, the same
    bytes); the paged decode reads them back within the quantization's error of fp32 attention."""
    kq = MODES[mode]
    gen = torch.Generator().manual_seed(6)
    n, kvh, h, d, bs = 40, 2, 4, 32, 8
    k, v = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
    blocks = torch.tensor([3, 0, 4, 1, 5], dtype=torch.int32)
    slots = blocks[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    caches = {}
    for backend in ("reference", "torch"):
        kc = torch.zeros(6, bs, kvh, kq.cache_head_dim(d), dtype=kq.storage_dtype)
        vc = torch.zeros_like(kc)
        ops.reshape_and_cache(k, v, kc, vc, slots, backend=backend, kv_quant=kq)
        caches[backend] = (kc, vc)
    assert torch.equal(caches["torch"][0].view(torch.uint8), caches["reference"][0].view(torch.uint8))
    assert torch.equal(caches["torch"][1].view(torch.uint8), caches["reference"][1].view(torch.uint8))
    q = torch.randn(1, h, d, generator=gen)
    out = ops.paged_decode_attention(q, *caches["reference"], blocks[None], torch.tensor([n], dtype=torch.int32),
                                     d ** -0.5, backend="reference", kv_quant=kq)
    truth = dense_attention(q, k, v, d ** -0.5, causal=False)
    assert (out - truth).abs().max() < (0.04 if kq.storage_dtype == torch.int8 else 0.3)
