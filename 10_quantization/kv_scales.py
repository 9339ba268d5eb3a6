"""Per-layer fp8 KV-cache scales from calibration text: what a checkpoint's `kv_cache_scheme`
stores and an engine run with kv_cache_dtype="fp8" reads (llmcompressor: a QuantizationModifier
with `kv_cache_scheme`, its static min-max observer; vLLM: BaseKVCacheMethod).

One scale for K and one for V per attention layer: the largest magnitude the layer writes into its
cache over the calibration windows (K after RoPE, as the cache holds it), over fp8 e4m3's largest
number (448). Stored as `model.layers.{i}.self_attn.k_scale` / `v_scale`, shape [1].

    scales = calibrate_kv_scales(model_dir, num_samples=32, seq_len=256)
"""
from __future__ import annotations

from pathlib import Path

import torch

from paged_attention.kv_quant import FP8_MAX

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False,
                   "group_size": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {},
                   "actorder": None}


@torch.inference_mode()
def calibrate_kv_scales(model_dir: Path | str, num_samples: int = 32, seq_len: int = 256,
                        batch: int = 8) -> dict[str, float]:
    """{checkpoint name: scale} for every layer's K and V (see the module doc)."""
    from transformers import AutoTokenizer

    from mini_vllm.config import ModelConfig
    from mini_vllm.model_inputs import prepare_inputs
    from mini_vllm.models.attention import PagedAttention
    from mini_vllm.models.loader import get_model
    from quantization.calibration import calibration_samples

    config = ModelConfig.from_pretrained(model_dir)
    model = get_model(config)
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    amax = torch.zeros(len(layers), 2)                                  # [layer, (K, V)]

    def observe(i):
        def hook(module, args):                                          # (query, key, value, kv_cache, metadata)
            amax[i, 0] = torch.maximum(amax[i, 0], args[1].abs().max().float())
            amax[i, 1] = torch.maximum(amax[i, 1], args[2].abs().max().float())
        return hook
    handles = [layer.register_forward_pre_hook(observe(i)) for i, layer in enumerate(layers)]
    try:
        samples = calibration_samples(AutoTokenizer.from_pretrained(model_dir), num_samples, seq_len)
        block_size = 16
        for start in range(0, len(samples), batch):
            prompts = [s.tolist() for s in samples[start:start + batch]]
            per = -(-seq_len // block_size)
            caches = config.kv_cache_spec(block_size).allocate_per_layer(per * len(prompts), "cpu")
            blocks = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
            inputs = prepare_inputs(prompts, [0] * len(prompts), blocks, block_size)
            model(inputs.input_ids, inputs.positions, caches, inputs.attn_metadata)
    finally:
        for h in handles:
            h.remove()
    scales = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return {f"model.layers.{i}.self_attn.{w}_scale": float(scales[i, j])
            for i in range(len(layers)) for j, w in enumerate("kv")}
