"""The engine's KV cache in chapter 02's terms (`ModelConfig.kv_cache_spec` -> `KVCacheSpec`):
chapter 01's layout, one (K, V) pair per layer, and its byte count."""
from __future__ import annotations

import pytest
import torch

from mini_vllm.config import ModelConfig


def test_layout_and_bytes(tmp_path, tiny_checkpoint):
    tiny_checkpoint(tmp_path, "llama", num_key_value_heads=2, head_dim=16, num_hidden_layers=3)
    config = ModelConfig.from_pretrained(tmp_path)
    spec = config.kv_cache_spec(block_size=5, dtype=torch.bfloat16)
    caches = spec.allocate_per_layer(num_blocks=7, device="cpu")
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (7, 5, 2, 16) and k.dtype == torch.bfloat16
        assert k.data_ptr() != v.data_ptr() and not k.any() and not v.any()
    total = sum(t.numel() * t.element_size() for kv in caches for t in kv)
    assert spec.bytes_per_block == total // 7 == 2 * 3 * 5 * 2 * 16 * 2
    assert config.kv_cache_spec(1).allocate_per_layer(1, "cpu")[0][0].dtype == config.dtype == torch.float32
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        config.kv_cache_spec(16).allocate_per_layer(0, "cpu")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        config.kv_cache_spec(0)


@pytest.mark.model
def test_smollm2_bytes_per_token(smollm2):
    """2 (K, V) x 30 layers x 3 KV heads x 64 dims x 2 bytes = 23 040 bytes per token in bf16."""
    _, config = smollm2
    assert config.kv_cache_spec(16, torch.bfloat16).bytes_per_block == 16 * 23_040
