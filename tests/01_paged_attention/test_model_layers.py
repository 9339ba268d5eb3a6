"""Chapter 01's model code (paged_attention/model/) against HF transformers' own implementation of
each block, up to a whole decoder layer of each family; the init and autograd paths chapter 04 uses.

The layer is the one chapter 04's EAGLE head and chapter 07's engine are built from; here it runs
with a test-local attention op (causal SDPA, no cache), so these tests need no other task's code.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from paged_attention.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary_emb, rope_inv_freq
from model_executor.linear import Linear, MergedColumnLinear, QKVLinear, VocabEmbedding
from paged_attention.model.llama import STACKED_PARAMS_MAPPING, LlamaDecoderLayer

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


# ---------------------------------------------------------------- init and autograd (chapter 04's uses)
def test_reset_parameters_is_torch_nn_init_draw_for_draw():
    """reset_parameters() is nn.Linear's / nn.Embedding's init, and a merged linear draws what its
    separate nn.Linears would, in order (same fan-in): a model built from these layers gets the
    weights its nn.Linear version had under the same seed (chapter 04's toy target and EAGLE head)."""
    torch.manual_seed(3)
    expected, expected_emb = [nn.Linear(16, n, bias=True) for n in (8, 4, 4)], nn.Embedding(10, 16)
    torch.manual_seed(3)
    linears, emb = [Linear(16, n, bias=True) for n in (8, 4, 4)], VocabEmbedding(10, 16)
    for m in (*linears, emb):
        m.reset_parameters()
    for ours, ref in zip(linears, expected):
        assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    assert torch.equal(emb.weight, expected_emb.weight)

    torch.manual_seed(3)
    pieces = [nn.Linear(16, n, bias=False).weight for n in (8, 4, 4)]
    torch.manual_seed(3)
    qkv = QKVLinear(16, head_dim=4, num_heads=2, num_kv_heads=1)
    qkv.reset_parameters()
    assert torch.equal(qkv.weight, torch.cat(pieces))
    norm = RMSNorm(16, 1e-6)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(16))
    assert not any(p.requires_grad for p in (qkv.weight, norm.weight, *linears[0].parameters()))   # serving: none


def test_rmsnorm_under_autograd_leaves_the_residual_alone():
    """In place when serving (test_rmsnorm_equals_hf); under autograd a new tensor, so backward
    sees the values it saved, and the gradients are those of norm(x + residual)."""
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 16, generator=g, requires_grad=True), torch.randn(5, 16, generator=g)
    norm = RMSNorm(16, 1e-5)
    norm.weight.data = torch.rand(16, generator=g) + 0.5
    norm.requires_grad_(True)
    before = residual.clone()
    out, new_residual = norm(x, residual)
    assert torch.equal(residual, before) and new_residual is not residual
    (out.square().sum() + new_residual.sum()).backward()
    x2 = x.detach().clone().requires_grad_(True)
    hf = LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(norm.weight)
    total = x2 + residual
    (hf(total).square().sum() + total.sum()).backward()
    assert_close(x.grad, x2.grad, torch.float32)
    assert_close(norm.weight.grad, hf.weight.grad, torch.float32)


# ---------------------------------------------------------------- the decoder layer
class CausalSDPA(nn.Module):
    """A test attention op: no cache; each sequence of the flat batch (attn_metadata: its cu_seqlens)
    attends causally to itself."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, query, key, value, kv_cache, attn_metadata):
        assert kv_cache is None
        out = []
        bounds = attn_metadata.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[s:e].transpose(0, 1) for t in (query, key, value))
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                      enable_gqa=True).transpose(0, 1))
        return torch.cat(out)


def hf_decoder_layer(family: str):
    from transformers import Qwen2Config, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLlama
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as HFQwen2
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer as HFQwen3

    sizes = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rms_norm_eps=1e-5)
    config, cls, switches = {
        "llama": (LlamaConfig(**sizes, attention_bias=True, mlp_bias=True), HFLlama,
                  dict(qkv_bias=True, o_bias=True, qk_norm=False)),
        "qwen2": (Qwen2Config(**sizes), HFQwen2, dict(qkv_bias=True, o_bias=False, qk_norm=False)),
        "qwen3": (Qwen3Config(**sizes), HFQwen3, dict(qkv_bias=False, o_bias=False, qk_norm=True)),
    }[family]
    config._attn_implementation = "sdpa"                     # no mask given: causal
    torch.manual_seed(0)
    hf = cls(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():                            # norms and biases away from their init
            p.add_(torch.randn_like(p) * 0.1)
    return config, hf, switches


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_decoder_layer_equals_hf(family):
    """Chapter 01's LlamaDecoderLayer, loaded from HF's layer through STACKED_PARAMS_MAPPING, on a
    flat batch of two sequences == HF's layer on each sequence (residual included)."""
    config, hf, switches = hf_decoder_layer(family)
    ours = LlamaDecoderLayer(config, CausalSDPA(config.head_dim ** -0.5), **switches)
    params, loaded = dict(ours.named_parameters()), set()
    for name, tensor in hf.state_dict().items():
        for merged, piece, shard in STACKED_PARAMS_MAPPING:
            if piece in name:
                target = name.replace(piece, merged)
                params[target].weight_loader(params[target], tensor, shard)
                loaded.add((target, shard))
                break
        else:
            params[name].data.copy_(tensor)
            loaded.add((name, None))
    assert loaded == {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}

    g = torch.Generator().manual_seed(1)
    lens = [5, 3]
    x = torch.randn(sum(lens), config.hidden_size, generator=g)
    positions = torch.cat([torch.arange(n) for n in lens])
    cos, sin = RotaryEmbedding(config.head_dim, 64, 1e4).cos_sin(positions)           # [T, 1, D]
    with torch.no_grad():
        out, residual = ours(x.clone(), None, (cos, sin), None, torch.tensor([0, 5, 8]))
        expected = torch.cat([hf(x[s:s + n][None], position_embeddings=(cos[s:s + n, 0][None], sin[s:s + n, 0][None]))[0]
                              for s, n in zip([0, 5], lens)])
    assert_close(out + residual, expected, torch.float32)
