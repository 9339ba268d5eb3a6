"""KV cache allocation: chapter 01's layout, one (K, V) pair per layer, and its byte count."""
from __future__ import annotations

import pytest
import torch

from mini_vllm.config import ModelConfig
from mini_vllm.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block


def test_layout_and_bytes(tmp_path, tiny_checkpoint):
    tiny_checkpoint(tmp_path, "llama", num_key_value_heads=2, head_dim=16, num_hidden_layers=3)
    config = ModelConfig.from_pretrained(tmp_path)
    caches = allocate_kv_caches(config, num_blocks=7, block_size=5, dtype=torch.bfloat16)
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (7, 5, 2, 16) and k.dtype == torch.bfloat16
        assert k.data_ptr() != v.data_ptr() and not k.any() and not v.any()
    total = sum(t.numel() * t.element_size() for kv in caches for t in kv)
    assert kv_cache_bytes_per_block(config, 5, torch.bfloat16) == total // 7 == 2 * 3 * 5 * 2 * 16 * 2
    assert allocate_kv_caches(config, 1, 1)[0][0].dtype == config.dtype == torch.float32
    with pytest.raises(ValueError, match="need num_blocks >= 1 and block_size >= 1"):
        allocate_kv_caches(config, 0, 16)


@pytest.mark.model
def test_smollm2_bytes_per_token(smollm2):
    """2 (K, V) x 30 layers x 3 KV heads x 64 dims x 2 bytes = 23 040 bytes per token in bf16."""
    _, config = smollm2
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) == 16 * 23_040
