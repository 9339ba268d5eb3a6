"""Bad input gets a clear error, never a model that runs and generates garbage."""
from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from mini_vllm.config import ModelConfig, read_rope
from mini_vllm.models.loader import get_model, iterate_weights, load_weights
from mini_vllm.models.registry import SUPPORTED_ARCHITECTURES, get_model_class


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp("llama")
    tiny_checkpoint(path, "llama")
    return path


def copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    """A copy of a one-file checkpoint with its tensors and/or config edited."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_supported_architectures_resolve():
    assert SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    assert {get_model_class(a).__name__ for a in SUPPORTED_ARCHITECTURES} == \
        {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def test_unknown_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .*/nope does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json: expected an HF-format checkpoint directory"):
        ModelConfig.from_pretrained(tmp_path)


def test_directory_without_safetensors(tmp_path, llama_dir):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors weights \(found PyTorch .bin files"):
        ModelConfig.from_pretrained(tmp_path)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, llama_dir):
    path = copy_checkpoint(llama_dir, tmp_path / "gpt2", edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match=r"declares architectures \['GPT2LMHeadModel'\]; supported: LlamaForCausalLM, "
                                         r"MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        ModelConfig.from_pretrained(path)


def test_unsupported_rope_and_activation(tmp_path, llama_dir):
    yarn = copy_checkpoint(llama_dir, tmp_path / "yarn", edit_config=lambda c: c.update(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported; supported: default, linear, llama3"):
        ModelConfig.from_pretrained(yarn)
    gelu = copy_checkpoint(llama_dir, tmp_path / "gelu", edit_config=lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_pretrained(gelu)


def test_sliding_window_caps_max_model_len(tmp_path, tiny_checkpoint):
    tiny_checkpoint(tmp_path, "mistral", sliding_window=64, head_dim=16)
    assert ModelConfig.from_pretrained(tmp_path).max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=100 exceeds the sliding window \\(64\\) = 64"):
        ModelConfig.from_pretrained(tmp_path, max_model_len=100)


def test_dtype_choice(llama_dir):
    assert ModelConfig.from_pretrained(llama_dir).dtype == torch.float32          # "auto": the checkpoint's
    assert ModelConfig.from_pretrained(llama_dir, dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        ModelConfig.from_pretrained(llama_dir, dtype="int8")


def test_transformers4_rope_spelling_is_read():
    """transformers 4 configs carry rope_theta/rope_scaling at the top level (no rope_parameters)."""
    v4 = types.SimpleNamespace(rope_theta=5e5, max_position_embeddings=4096,
                               rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    theta, scaling = read_rope(v4)
    assert theta == 5e5
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 4096}
    assert read_rope(types.SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == (1e4, None)
    with pytest.raises(ValueError, match="config has no rope_theta"):
        read_rope(types.SimpleNamespace(rope_scaling=None))


def test_missing_tensor_is_named(tmp_path, llama_dir):
    path = copy_checkpoint(llama_dir, tmp_path / "missing",
                           edit_tensors=lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\) for LlamaForCausalLM: "
                                         r"model.layers.1.self_attn.qkv_proj.weight \(shard 'k'\)$"):
        get_model(ModelConfig.from_pretrained(path))


def test_unexpected_tensor_is_named(tmp_path, llama_dir):
    path = copy_checkpoint(llama_dir, tmp_path / "extra",
                           edit_tensors=lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) this LlamaForCausalLM has no parameter for \(wrong architecture\?\): "
                                         r"model.layers.0.self_attn.q_norm.weight$"):
        get_model(ModelConfig.from_pretrained(path))


def test_wrong_shape_is_named(tmp_path, llama_dir):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:10]
    path = copy_checkpoint(llama_dir, tmp_path / "shape", edit_tensors=shrink)
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint tensor has shape \(10,\), parameter expects \(64,\)"):
        get_model(ModelConfig.from_pretrained(path))


def test_duplicate_tensor_is_an_error(llama_dir):
    config = ModelConfig.from_pretrained(llama_dir)
    model = get_model(config)
    weights = list(iterate_weights(llama_dir))
    with pytest.raises(ValueError, match="loaded twice"):
        load_weights(model, weights + weights[:1])


def test_missing_shard_file(tmp_path, tiny_checkpoint):
    tiny_checkpoint(tmp_path, "llama", max_shard_size="60KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=f"names shards that are missing .*{shards[-1].name}"):
        get_model(ModelConfig.from_pretrained(tmp_path))


def test_qwen2_loads_qkv_bias_and_no_o_bias(tmp_path, tiny_checkpoint):
    hf = tiny_checkpoint(tmp_path, "qwen2")
    model = get_model(ModelConfig.from_pretrained(tmp_path))
    attn = model.model.layers[1].self_attn
    hf_attn = hf.model.layers[1].self_attn
    assert attn.o_proj.bias is None and attn.q_norm is None
    assert torch.equal(attn.qkv_proj.bias, torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias]))


def test_forward_rejects_bad_inputs(llama_dir):
    from mini_vllm.model_inputs import prepare_inputs

    config = ModelConfig.from_pretrained(llama_dir)
    model = get_model(config)
    caches = config.kv_cache_spec(4).allocate_per_layer(4, "cpu")
    inputs = prepare_inputs([[1, 2, 3]], [0], [[2]], block_size=4)
    with pytest.raises(ValueError, match=r"must both be 1-D \[num_tokens\] \(a flat ragged batch\), got \(1, 3\)"):
        model(inputs.input_ids[None], inputs.positions[None], caches, inputs.attn_metadata)
    with pytest.raises(ValueError, match="2 input tokens but attn_metadata.slot_mapping has 3"):
        model(inputs.input_ids[:2], inputs.positions[:2], caches, inputs.attn_metadata)
    with pytest.raises(ValueError, match=r"one \(key_cache, value_cache\) per layer \(2\), got 1"):
        model(inputs.input_ids, inputs.positions, caches[:1], inputs.attn_metadata)
    with pytest.raises(ValueError, match="attention backend 'flash' is not supported; supported: cpu, torch, reference, triton, cuda"):
        get_model(config, attn_backend="flash")
