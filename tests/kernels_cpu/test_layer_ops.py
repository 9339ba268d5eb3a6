"""The fused CPU layer ops (kernels_cpu/layer_ops.py, csrc/layer_ops.cpp) == the engine layers'
PyTorch forwards (chapter 01's paged_attention/model/layers.py, the oracle): RoPE and the residual add bit for bit,
RMSNorm and SiLU-and-mul within the dtype's tolerance; strided rows, odd sizes, GQA; every
instruction-set build; bad shapes refused. A whole model switched over:
tests/07_mini_vllm/test_cpu_kernels.py."""
from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from kernels_cpu import build
from kernels_cpu import layer_ops as cpu_layer_ops
from paged_attention.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary_emb

pytestmark = pytest.mark.skipif(not cpu_layer_ops.is_available(), reason=f"{cpu_layer_ops.unavailable_reason()}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rows(num_rows: int, width: int, dtype, strided: bool, seed: int) -> torch.Tensor:
    """[num_rows, width]; strided: a column slice of a wider tensor (rows not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_rows, width + (7 if strided else 0), generator=g).to(dtype) * 3
    return wide[:, 3:3 + width] if strided else wide


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,hidden", [(1, 576), (7, 33), (64, 576), (300, 16)])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_equals_the_torch_layer(dtype, num_rows, hidden, strided):
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = rows(1, hidden, torch.float32, False, 1)[0].to(dtype)
    x = rows(num_rows, hidden, dtype, strided, 2)
    assert_close(cpu_layer_ops.rms_norm(x, norm.weight, norm.eps), norm(x), dtype=dtype)
    # The fused residual add: the residual stream is updated in place, bit for bit as torch's add_.
    residual = rows(num_rows, hidden, dtype, False, 3)
    expected_residual = residual.clone()
    expected_out, _ = norm(x.clone(), expected_residual)
    out = cpu_layer_ops.rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(residual, expected_residual)
    assert_close(out, expected_out, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,inter", [(1, 1536), (9, 37), (130, 64)])
def test_silu_and_mul_equals_the_torch_layer(dtype, num_rows, inter):
    x = rows(num_rows, 2 * inter, dtype, False, 4)
    x[0, :4] = torch.tensor([-100.0, 100.0, -20.0, 30.0])    # exp's range ends (the vector exp clamps)
    out = cpu_layer_ops.silu_and_mul(x)
    assert out.shape == (num_rows, inter) and out.dtype == dtype
    assert_close(out, SiluAndMul()(x), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 128), (2, 1, 2)])
@pytest.mark.parametrize("strided", [False, True])
def test_rope_split_qkv_is_bit_for_bit_the_torch_path(dtype, heads, kv_heads, head_dim, strided):
    T = 11
    qkv = rows(T, (heads + 2 * kv_heads) * head_dim, dtype, strided, 5)
    rope = RotaryEmbedding(head_dim, 4096, 1e5, None, dtype)
    positions = torch.tensor([0, 1, 2, 17, 500, 4095, 3, 3, 64, 1000, 7])
    cos, sin = rope.cos_sin(positions)                                     # [T, 1, D] each
    q, k, v = cpu_layer_ops.rope_split_qkv(qkv, cos.view(T, -1), sin.view(T, -1), heads, kv_heads, head_dim)
    assert_rope_split_is_the_torch_path(q, k, v, qkv, cos, sin, heads, kv_heads, head_dim)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


def assert_rope_split_is_the_torch_path(q, k, v, qkv, cos, sin, heads, kv_heads, head_dim):
    """q, k rotated and v split out of qkv [T, (heads + 2 kv_heads) * head_dim] bit for bit as
    the torch layers do it (cos, sin: RotaryEmbedding.cos_sin, [T, 1, head_dim])."""
    T = qkv.shape[0]
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(q, apply_rotary_emb(q_ref.view(T, heads, head_dim), cos, sin))
    assert torch.equal(k, apply_rotary_emb(k_ref.view(T, kv_heads, head_dim), cos, sin))
    assert torch.equal(v, v_ref.reshape(T, kv_heads, head_dim))


@pytest.mark.parametrize("isa", build.ALL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_instruction_set_variant_computes_the_torch_layers(isa, dtype):
    """The ops are compiled per instruction set (csrc/vec.h); the engine loads the best one this
    CPU runs, so the others are built here by name. Every width has whole vectors and a tail on
    each instruction set (16 / 8 / 1 lanes): the vector roundings to bf16 / fp16 and the lane-by-lane
    tail are both checked. (conftest.py skips the variants not tested here.)"""
    ops = cpu_layer_ops.load(isa)
    assert ops.isa() == isa
    norm = RMSNorm(33, 1e-5).to(dtype)
    norm.weight.data = rows(1, 33, torch.float32, False, 1)[0].to(dtype)
    x, residual = rows(7, 33, dtype, True, 2), rows(7, 33, dtype, False, 3)
    assert_close(ops.rms_norm(x, None, norm.weight, norm.eps), norm(x), dtype=dtype)
    expected_out, expected_residual = norm(x.clone(), residual.clone())
    assert_close(ops.rms_norm(x, residual, norm.weight, norm.eps), expected_out, dtype=dtype)
    assert torch.equal(residual, expected_residual)
    gate_up = rows(9, 2 * 37, dtype, False, 4)
    assert_close(ops.silu_and_mul(gate_up), SiluAndMul()(gate_up), dtype=dtype)
    T, heads, kv_heads, head_dim = 5, 4, 2, 40                             # half = 20 = 16 + 4 = 2 x 8 + 4
    qkv = rows(T, (heads + 2 * kv_heads) * head_dim, dtype, True, 5)
    cos, sin = RotaryEmbedding(head_dim, 4096, 1e5, None, dtype).cos_sin(torch.tensor([0, 1, 9, 500, 4095]))
    q, k, v = ops.rope_split_qkv(qkv, cos.view(T, -1), sin.view(T, -1), heads, kv_heads, head_dim)
    assert_rope_split_is_the_torch_path(q, k, v, qkv, cos, sin, heads, kv_heads, head_dim)


def test_bad_shapes_are_refused_with_a_message():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous \[hidden\]"):
        cpu_layer_ops.rms_norm(x, torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="residual must match x"):
        cpu_layer_ops.rms_norm(x, torch.ones(8), 1e-5, torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="weight dtype"):
        cpu_layer_ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="even last dim"):
        cpu_layer_ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="must be 2-D"):
        cpu_layer_ops.silu_and_mul(torch.randn(2, 3, 8))
    with pytest.raises(RuntimeError, match="expected"):
        cpu_layer_ops.rope_split_qkv(torch.randn(3, 40), torch.randn(3, 8), torch.randn(3, 8), 2, 1, 8)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        cpu_layer_ops.rope_split_qkv(torch.randn(3, 32), torch.randn(2, 8), torch.randn(3, 8), 2, 1, 8)
    with pytest.raises(RuntimeError, match="silu_and_mul.* not implemented for 'Double'"):   # the engine's dtypes only
        cpu_layer_ops.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
