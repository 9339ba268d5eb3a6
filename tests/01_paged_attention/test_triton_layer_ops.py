"""The fused Triton layer ops (paged_attention/model/triton_layer_ops.py) against the layers'
forward_native (HF's math op for op), and the `forward_cuda` they are bound to.

Without CUDA they run under the Triton interpreter (conftest); on a GPU the same tests run the
compiled kernels, and the `gpu` tests add what only a GPU shows (bf16 bit-exactness against
torch's CUDA kernels at the engine's sizes, CUDA-graph replay).

What is exact and what is a tolerance (module doc of triton_layer_ops.py):
  * RoPE, the residual add, v's copy: bit for bit, every dtype;
  * RMSNorm: the mean of squares is summed in another order, so fp32 agrees to ~1e-7 relative and
    bf16/fp16 to the table's tolerance (one ulp now and then);
  * SiLU-and-mul: exp() is numpy's (interpreter) or libdevice's (GPU) vs torch's: the same bounds.
"""
from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from paged_attention.model import triton_layer_ops as L
from model_executor.custom_op import CustomOp
from paged_attention.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary_emb
from paged_attention.model.llama import LlamaDecoderLayer

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROPE_SCALINGS = [None, {"rope_type": "linear", "factor": 4.0},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}]


def make_norm(hidden: int, dtype: torch.dtype, device, seed: int = 0) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-6).to(device=device, dtype=dtype)
    norm.weight.data.copy_(1 + 0.5 * torch.randn(hidden, generator=g))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 960, 64, 100])          # SmolLM2's, Qwen2-0.5B's, a head, not 2^k
def test_rms_norm_equals_native(dtype, hidden, device):
    g = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(5, hidden, generator=g)).to(device=device, dtype=dtype)
    norm = make_norm(hidden, dtype, device)
    out = L.rms_norm(x, norm.weight, norm.eps)
    expected = norm.forward_native(x)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 960])
def test_fused_add_rms_norm_equals_native_and_updates_the_residual_in_place(dtype, hidden, device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, hidden, generator=g).to(device=device, dtype=dtype)
    residual = (4 * torch.randn(6, hidden, generator=g)).to(device=device, dtype=dtype)
    norm = make_norm(hidden, dtype, device)
    ref_residual = residual.clone()
    expected, expected_sum = norm.forward_native(x, ref_residual)
    x_before = x.clone()
    out, new_residual = L.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert new_residual is residual                                # the contract callers rely on: in place
    assert torch.equal(residual, expected_sum)                     # the add rounds exactly as residual.add_(x)
    assert torch.equal(x, x_before)                                # x itself is only read
    assert_close(out, expected, dtype)
    # And through the layer: forward_cuda returns the same tensor it was given as the residual.
    norm.dispatch_forward("cuda")
    residual2 = ref_residual.clone() - x                           # any residual; compare against native
    r_native = residual2.clone()
    out2, res2 = norm(x, residual2)
    exp2, exp_res2 = norm.forward_native(x, r_native)
    assert res2 is residual2 and torch.equal(res2, exp_res2)
    assert_close(out2, exp2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fp32_is_within_rounding_and_mostly_exact(dtype, device):
    """How far apart: fp32 a few ulp at most; 16-bit outputs mostly identical (one ulp where the
    fp32 variance's last bits flip a rounding)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 576, generator=g).to(device=device, dtype=dtype)
    norm = make_norm(576, dtype, device)
    out, expected = L.rms_norm(x, norm.weight, norm.eps), norm.forward_native(x)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=0, rtol=1e-6)
    else:
        assert (out != expected).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_per_head_views(dtype, device):
    """Qwen3's q/k norms: x is a [T, heads, D] view into the qkv projection's rows (strided)."""
    g = torch.Generator().manual_seed(4)
    T, H, KVH, D = 5, 4, 2, 32
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(device=device, dtype=dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    norm = make_norm(D, dtype, device)
    for x in (q, k):
        assert not x.is_contiguous()
        out = L.rms_norm(x, norm.weight, norm.eps)
        assert out.is_contiguous()
        assert_close(out, norm.forward_native(x), dtype)
    norm.dispatch_forward("cuda")
    assert_close(norm(q), norm.forward_native(q), dtype)


def test_rms_norm_weight_of_another_dtype_promotes_like_torch(device):
    """weight fp32, x bf16: native's `weight * normed.to(bf16)` is fp32; so is the kernel's output."""
    x = torch.randn(3, 64).to(device=device, dtype=torch.bfloat16)
    norm = make_norm(64, torch.float32, device)
    out, expected = L.rms_norm(x, norm.weight, norm.eps), norm.forward_native(x)
    assert out.dtype == expected.dtype == torch.float32
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 1536, 1500])              # one block, exactly SILU_BLOCK + more, ragged
def test_silu_and_mul_equals_native(dtype, inter, device):
    g = torch.Generator().manual_seed(inter)
    x = (4 * torch.randn(3, 2 * inter, generator=g)).to(device=device, dtype=dtype)
    out, expected = L.silu_and_mul(x), SiluAndMul().forward_native(x)
    assert out.shape == (3, inter) and out.dtype == dtype
    assert_close(out, expected, dtype)
    op = SiluAndMul()
    op.dispatch_forward("cuda")
    assert_close(op(x), expected, dtype)


# dtype x RoPE scaling x head shape as a Latin square: every pair of values exactly once (9 cases,
# not the 27 of the product). Scaling only changes the cos/sin table the kernel is given.
ROPE_SHAPES = [(4, 2, 64), (3, 1, 48), (2, 2, 16)]      # GQA, MQA with a head_dim not 2^k, MHA
ROPE_CASES = [pytest.param(DTYPES[d], ROPE_SCALINGS[r], *ROPE_SHAPES[(d + r) % 3],
                           id=f"{'-'.join(map(str, ROPE_SHAPES[(d + r) % 3]))}-{name}-dtype{d}")
              for d in range(3) for r, name in enumerate(["default", "linear", "llama3"])]


@pytest.mark.parametrize("dtype,scaling,heads,kv_heads,head_dim", ROPE_CASES)
def test_rotary_embedding_is_bit_exact(dtype, scaling, heads, kv_heads, head_dim, device):
    """q and k as views into one qkv row (as the model slices them), positions at random: every
    element equals apply_rotary_emb's, and v comes back as v.contiguous()."""
    g = torch.Generator().manual_seed(heads * head_dim)
    T, max_pos = 9, 128
    rope = RotaryEmbedding(head_dim, max_pos, 1e4, scaling, dtype=dtype).to(device)
    cos, sin = rope.cos_sin(torch.randint(0, max_pos, (T,), generator=g).to(device))
    qkv = (3 * torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g)).to(device=device, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(T, -1, head_dim) for t in (q, k, v))
    q_out, k_out, v_out = L.rotary_embedding(q, k, cos, sin, v)
    assert torch.equal(q_out, apply_rotary_emb(q, cos, sin))
    assert torch.equal(k_out, apply_rotary_emb(k, cos, sin))
    assert torch.equal(v_out, v) and v_out.is_contiguous()
    q2, k2 = L.rotary_embedding(q, k, cos, sin)                     # without v
    assert torch.equal(q2, q_out) and torch.equal(k2, k_out)


def test_rotary_embedding_reads_both_halves_of_cos_and_sin(device):
    """No shortcut: a table whose halves differ is applied exactly as apply_rotary_emb applies it."""
    g = torch.Generator().manual_seed(7)
    T, H, D = 4, 2, 16
    q, k = torch.randn(T, H, D, generator=g).to(device), torch.randn(T, 1, D, generator=g).to(device)
    cos, sin = torch.randn(T, 1, D, generator=g).to(device), torch.randn(T, 1, D, generator=g).to(device)
    q_out, k_out = L.rotary_embedding(q, k, cos, sin)
    assert torch.equal(q_out, apply_rotary_emb(q, cos, sin)) and torch.equal(k_out, apply_rotary_emb(k, cos, sin))


def test_empty_batches(device):
    norm = make_norm(64, torch.float32, device)
    assert L.rms_norm(torch.empty(0, 64, device=device), norm.weight, 1e-6).shape == (0, 64)
    assert L.silu_and_mul(torch.empty(0, 64, device=device)).shape == (0, 32)
    q, k = L.rotary_embedding(torch.empty(0, 2, 16, device=device), torch.empty(0, 1, 16, device=device),
                              torch.empty(0, 16, device=device), torch.empty(0, 16, device=device))
    assert q.shape == (0, 2, 16) and k.shape == (0, 1, 16)


def test_bad_inputs_are_clear_errors(device):
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="rms_norm takes"):
        L.rms_norm(torch.randn(3, 9, device=device), w, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        L.rms_norm(torch.randn(3, 8, device=device), w, 1e-6, torch.randn(3, 8, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="silu_and_mul takes"):
        L.silu_and_mul(torch.randn(3, 7, device=device))
    with pytest.raises(ValueError, match="rotary_embedding takes"):
        L.rotary_embedding(torch.randn(2, 2, 16, device=device), torch.randn(2, 1, 16, device=device),
                           torch.randn(2, 8, device=device), torch.randn(2, 8, device=device))


def test_forward_cuda_under_autograd_runs_native(device):
    """Chapter 04 trains through these layers: with grad, forward_cuda must keep autograd's graph."""
    norm = make_norm(32, torch.float32, device)
    norm.dispatch_forward("cuda")
    x = torch.randn(3, 32, device=device, requires_grad=True)
    residual = torch.randn(3, 32, device=device)
    before = residual.clone()
    out, summed = norm(x, residual)
    out.sum().backward()
    assert x.grad is not None and torch.equal(residual, before)     # native under autograd: not in place


# ----------------------------------------------------------------------------- a whole decoder layer

class CausalSDPA(torch.nn.Module):
    """One sequence per call, no cache: enough to run a decoder layer."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True).transpose(0, 1).contiguous()


class Sizes:
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim = 96, 160, 4, 2, 24
    rms_norm_eps = 1e-6


# llama and qwen2 differ only in o_proj's bias (no Triton op involved), qwen3 adds the per-head
# q/k norms: each family once, both dtypes, and qwen3 (every Triton op) in both dtypes.
@pytest.mark.parametrize("family,dtype", [pytest.param("llama", torch.float32, id="llama-dtype0"),
                                          pytest.param("qwen2", torch.bfloat16, id="qwen2-dtype1"),
                                          pytest.param("qwen3", torch.float32, id="qwen3-dtype0"),
                                          pytest.param("qwen3", torch.bfloat16, id="qwen3-dtype1")])
def test_decoder_layer_on_platform_cuda_equals_native(family, dtype, device):
    """Two stacked layers (the second gets a residual): platform "cuda" (the Triton ops) vs "native"."""
    switches = {"llama": dict(qkv_bias=True, o_bias=True), "qwen2": dict(qkv_bias=True),
                "qwen3": dict(qk_norm=True)}[family]
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(LlamaDecoderLayer(Sizes, CausalSDPA(), **switches) for _ in range(2))
    with torch.no_grad():
        for p in layers.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1 if p.dim() == 1 else 0))
    layers = layers.to(device=device, dtype=dtype)
    T = 7
    x = torch.randn(T, Sizes.hidden_size, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    cos, sin = RotaryEmbedding(Sizes.head_dim, 64, 1e4, dtype=dtype).to(device).cos_sin(torch.arange(T, device=device))

    def run(platform):
        for m in layers.modules():
            if isinstance(m, CustomOp):
                m.dispatch_forward(platform)
        h, r = x.clone(), None
        with torch.no_grad():
            for layer in layers:
                h, r = layer(h, r, (cos, sin), None, None)
        return h, r

    h_native, r_native = run("native")
    h_cuda, r_cuda = run("cuda")
    assert all(m.platform == "cuda" for m in layers.modules() if isinstance(m, CustomOp))
    # fp32: RMSNorm's last-bit differences pass through four matmuls (seen on an H200: 1.5e-5 in one
    # element of 672), so 1e-4 here; 16-bit: the table's tolerance.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else {}
    for got, want in ((h_cuda, h_native), (r_cuda, r_native)):
        if tol:
            torch.testing.assert_close(got, want, **tol)
        else:
            assert_close(got, want, dtype)


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_engine_sizes_against_torch_cuda(dtype):
    """Qwen3-0.6B's sizes (hidden 1024, intermediate 3072, 16/8 heads of 128) and SmolLM2's (576),
    T = 256: RoPE bit-exact; SiLU-and-mul bit-exact (libdevice expf, IEEE division, as torch's
    CUDA silu); RMSNorm within tolerance and almost always identical."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T = 256
    for hidden in (1024, 576):
        norm = make_norm(hidden, dtype, dev)
        x = torch.randn(T, hidden, device=dev, generator=g).to(dtype)
        residual = torch.randn(T, hidden, device=dev, generator=g).to(dtype)
        expected, expected_sum = norm.forward_native(x, residual.clone())
        out, res = L.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        assert torch.equal(res, expected_sum)
        assert_close(out, expected, dtype)
        if dtype != torch.float32:                                 # fp32: last bits differ often (the sum's order)
            assert (out != expected).float().mean().item() < 0.01
    gate_up = (3 * torch.randn(T, 2 * 3072, device=dev, generator=g)).to(dtype)
    silu = L.silu_and_mul(gate_up)
    assert_close(silu, SiluAndMul().forward_native(gate_up), dtype)
    assert (silu != SiluAndMul().forward_native(gate_up)).float().mean().item() < 1e-3 or dtype == torch.float32
    rope = RotaryEmbedding(128, 4096, 1e6, dtype=dtype).to(dev)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (T,), device=dev, generator=g))
    qkv = torch.randn(T, (16 + 16) * 128, device=dev, generator=g).to(dtype)
    q, k, v = (t.view(T, -1, 128) for t in qkv.split([2048, 1024, 1024], dim=-1))
    q_out, k_out, v_out = L.rotary_embedding(q, k, cos, sin, v)
    assert torch.equal(q_out, apply_rotary_emb(q, cos, sin)) and torch.equal(k_out, apply_rotary_emb(k, cos, sin))
    assert torch.equal(v_out, v)


@pytest.mark.gpu
def test_gpu_ops_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers: same results as eager."""
    dev, dtype, T = torch.device("cuda"), torch.bfloat16, 8
    norm = make_norm(1024, dtype, dev)
    x, residual = torch.randn(T, 1024, device=dev, dtype=dtype), torch.randn(T, 1024, device=dev, dtype=dtype)
    gate_up = torch.randn(T, 2 * 3072, device=dev, dtype=dtype)
    cos, sin = torch.randn(T, 1, 128, device=dev, dtype=dtype), torch.randn(T, 1, 128, device=dev, dtype=dtype)
    q, k = torch.randn(T, 16, 128, device=dev, dtype=dtype), torch.randn(T, 8, 128, device=dev, dtype=dtype)

    def step():
        return (L.fused_add_rms_norm(x, residual, norm.weight, norm.eps)[0], L.silu_and_mul(gate_up),
                *L.rotary_embedding(q, k, cos, sin))

    step()                                                      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, residual, gate_up, cos, sin, q, k):
        t.copy_(torch.randn_like(t))
    res_before = residual.clone()
    graph.replay()
    captured = [o.clone() for o in outs]
    residual.copy_(res_before)
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)
