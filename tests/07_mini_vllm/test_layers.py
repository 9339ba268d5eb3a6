"""Each building block against HF transformers' own implementation of it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from mini_vllm.models.layers import (MergedColumnLinear, QKVLinear, RMSNorm, RotaryEmbedding, SiluAndMul,
                                     apply_rotary_emb, rope_inv_freq)

ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
}


def hf_rope_config(head_dim: int, theta: float, scaling: dict | None, max_position: int = 4096) -> LlamaConfig:
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                       rope_scaling=dict(scaling) if scaling else None, max_position_embeddings=max_position)


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
@pytest.mark.parametrize("head_dim,theta", [(64, 1e5), (128, 5e5), (16, 1e4)])
def test_rope_inv_freq_equals_hf(variant, head_dim, theta):
    """Bit-exact: the frequencies feed every position of every layer."""
    scaling = ROPE_VARIANTS[variant]
    config = hf_rope_config(head_dim, theta, scaling)
    init = ROPE_INIT_FUNCTIONS.get(variant, LlamaRotaryEmbedding.compute_default_rope_parameters)
    expected, attention_scaling = init(config)
    assert attention_scaling == 1.0
    assert torch.equal(rope_inv_freq(head_dim, theta, scaling), expected)


def test_llama3_rope_touches_all_three_bands():
    """The llama3 case above must exercise kept, blended and slowed frequencies, or it proves little."""
    inv = rope_inv_freq(128, 5e5, None)
    scaled = rope_inv_freq(128, 5e5, ROPE_VARIANTS["llama3"])
    ratio = inv / scaled
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported; supported: default, linear, llama3"):
        rope_inv_freq(64, 1e4, {"rope_type": "yarn", "factor": 4.0})


@settings(max_examples=15, deadline=None)
@given(variant=st.sampled_from(list(ROPE_VARIANTS)), num_tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rotary_embedding_equals_hf(variant, num_tokens, seed):
    """Our table lookup + rotation vs HF's on-the-fly cos/sin + rotate_half, at random positions."""
    g = torch.Generator().manual_seed(seed)
    head_dim, theta, max_pos = 32, 1e4, 2048
    scaling = ROPE_VARIANTS[variant]
    if scaling and scaling["rope_type"] == "llama3":
        scaling = {**scaling, "original_max_position_embeddings": 512}
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    q = torch.randn(num_tokens, 4, head_dim, generator=g)
    k = torch.randn(num_tokens, 2, head_dim, generator=g)

    rope = RotaryEmbedding(head_dim, max_pos, theta, scaling, dtype=torch.float32)
    cos, sin = rope.cos_sin(positions)
    ours_q, ours_k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)

    hf_rope = LlamaRotaryEmbedding(hf_rope_config(head_dim, theta, scaling, max_pos))
    hf_cos, hf_sin = hf_rope(q, positions[None])                                   # [1, T, d]
    # HF layout [batch, heads, T, d]; ours [T, heads, d].
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    assert_close(ours_q, ref_q[0].transpose(0, 1), torch.float32)
    assert_close(ours_k, ref_k[0].transpose(0, 1), torch.float32)
    # Given HF's own cos/sin, the rotation is HF's ops in HF's order: bit for bit.
    hf_cos_t, hf_sin_t = hf_cos[0][:, None, :], hf_sin[0][:, None, :]              # [T, 1, d]
    assert torch.equal(apply_rotary_emb(q, hf_cos_t, hf_sin_t), ref_q[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_hf(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 48, generator=g).to(dtype)
    residual = torch.randn(7, 48, generator=g).to(dtype)
    weight = torch.randn(48, generator=g).to(dtype)
    ours = RMSNorm(48, 1e-5).to(dtype)
    ours.weight.copy_(weight)
    hf = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        assert torch.equal(ours(x), hf(x))
        # The fused residual add: returns (norm(x + residual), x + residual), updating residual in place.
        expected_sum = residual + x
        out, new_residual = ours(x, residual)
        assert new_residual is residual and torch.equal(new_residual, expected_sum)
        assert torch.equal(out, hf(expected_sum))


def test_qkv_linear_is_three_linears_in_one():
    g = torch.Generator().manual_seed(0)
    hidden, head_dim, heads, kv_heads = 32, 8, 4, 2
    pieces = {s: (torch.randn(n * head_dim, hidden, generator=g), torch.randn(n * head_dim, generator=g))
              for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    qkv = QKVLinear(hidden, head_dim, heads, kv_heads, bias=True)
    for shard, (w, b) in pieces.items():
        qkv.weight.weight_loader(qkv.weight, w, shard)
        qkv.bias.weight_loader(qkv.bias, b, shard)
    x = torch.randn(5, hidden, generator=g)
    expected = torch.cat([F.linear(x, w, b) for w, b in pieces.values()], dim=-1)
    assert_close(qkv(x), expected, torch.float32)
    assert qkv.weight.shard_ids == ("q", "k", "v")
    with pytest.raises(ValueError, match=r"shard 'k': checkpoint tensor has shape \(32, 32\), expected \(16, 32\)"):
        qkv.weight.weight_loader(qkv.weight, pieces["q"][0], "k")


def test_gate_up_and_silu_and_mul_equal_llama_mlp_math():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)
    merged = MergedColumnLinear(16, [12, 12])
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    x = torch.randn(3, 16, generator=g)
    assert_close(SiluAndMul()(merged(x)), F.silu(x @ gate.T) * (x @ up.T), torch.float32)
