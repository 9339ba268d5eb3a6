"""Per-layer fp8 KV-cache scales from calibration text: what a checkpoint's `kv_cache_scheme`
stores and an engine run with kv_cache_dtype="fp8" reads (llmcompressor: a QuantizationModifier
with `kv_cache_scheme`, its static min-max observer; vLLM: BaseKVCacheMethod).

One scale for K and one for V per attention layer: the largest magnitude the layer writes into its
cache over the calibration windows (K after RoPE, as the cache holds it; "static_minmax"), or
llmcompressor's moving average of each window's ("minmax"), over fp8 e4m3's largest number (448).
Stored as `model.layers.{i}.self_attn.k_scale` / `v_scale`, shape [1]; with strategy "attn_head" one
per KV head, shape [kv_heads, 1, 1] (llmcompressor's layout for it).

    scales = calibrate_kv_scales(model_dir, num_samples=32, seq_len=256, observer="static_minmax")
"""
from __future__ import annotations

from pathlib import Path

import torch

from paged_attention.kv_quant import FP8_MAX

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False,
                   "group_size": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {},
                   "actorder": None}
STRATEGIES = ("tensor", "attn_head")


OBSERVERS = ("static_minmax", "minmax")


def observed_range(mins: torch.Tensor, maxs: torch.Tensor, observer: str, averaging_constant: float = 0.01
                   ) -> torch.Tensor:
    """Per-window minima / maxima [windows, ...] -> the observer's largest magnitude [...].

    "static_minmax": the smallest minimum and largest maximum over every window (nothing the
    calibration wrote is clipped). "minmax": llmcompressor's default observer, a moving average
    of each window's min and max (v += c (x - v), c = 0.01), one window at a time."""
    if observer == "static_minmax":
        lo, hi = mins.amin(0), maxs.amax(0)
    elif observer == "minmax":
        lo, hi = mins[0].clone(), maxs[0].clone()
        for m, x in zip(mins[1:], maxs[1:]):
            lo, hi = torch.lerp(lo, m, averaging_constant), torch.lerp(hi, x, averaging_constant)
    else:
        raise ValueError(f"observer must be one of {OBSERVERS}, got {observer!r}")
    return torch.maximum(lo.abs(), hi.abs())


@torch.inference_mode()
def calibrate_kv_scales(model_dir: Path | str, num_samples: int = 32, seq_len: int = 256,
                        observer: str = "static_minmax", strategy: str = "tensor") -> dict[str, torch.Tensor]:
    """{checkpoint name: scale [1], or [kv_heads, 1, 1] for strategy "attn_head"} for every layer's
    K and V (see the module doc; `observer`: observed_range)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    from transformers import AutoTokenizer

    from mini_vllm.config import ModelConfig
    from mini_vllm.model_inputs import prepare_inputs
    from mini_vllm.models.attention import PagedAttention
    from mini_vllm.models.loader import get_model
    from quantization.calibration import calibration_samples

    config = ModelConfig.from_pretrained(model_dir)
    model = get_model(config)
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    samples = calibration_samples(AutoTokenizer.from_pretrained(model_dir), num_samples, seq_len)
    heads = config.num_key_value_heads if strategy == "attn_head" else 1
    mins = torch.zeros(len(samples), len(layers), 2, heads)            # [window, layer, (K, V), head]
    maxs = torch.zeros(len(samples), len(layers), 2, heads)
    window = 0

    def observe(i):
        def hook(module, args):                                          # (query, key, value, kv_cache, metadata)
            for j, x in enumerate(args[1:3]):                            # [T, KVH, D]
                x = x.float().transpose(0, 1).reshape(heads, -1)         # [heads, T * KVH / heads * D]
                mins[window, i, j], maxs[window, i, j] = x.amin(1), x.amax(1)
        return hook
    handles = [layer.register_forward_pre_hook(observe(i)) for i, layer in enumerate(layers)]
    block_size = 16
    blocks = -(-seq_len // block_size)
    caches = config.kv_cache_spec(block_size).allocate_per_layer(blocks, "cpu")
    try:
        for window, sample in enumerate(samples):                        # one window a forward, as llmcompressor
            inputs = prepare_inputs([sample.tolist()], [0], [list(range(blocks))], block_size)
            model(inputs.input_ids, inputs.positions, caches, inputs.attn_metadata)
    finally:
        for h in handles:
            h.remove()
    scales = (observed_range(mins, maxs, observer) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    shape = (heads, 1, 1) if strategy == "attn_head" else (1,)
    return {f"model.layers.{i}.self_attn.{w}_scale": scales[i, j].reshape(shape).clone()
            for i in range(len(layers)) for j, w in enumerate("kv")}
