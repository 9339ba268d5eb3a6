"""The seam through which a quantized checkpoint reaches the linear layers (vLLM:
`vllm/model_executor/layers/quantization/base_config.py: QuantizationConfig`).

A quantized checkpoint says in its config.json how its weights are stored
(`"quantization_config": {"quant_method": "compressed-tensors", ...}`). The engine looks the
method up BY NAME (chapter 07's `models/quantization.py`; the methods themselves are chapter 10's),
builds its config from that dict, and asks it, layer by layer, which linear method runs the
layer. The chosen method then:

    create_weights(layer)                 replaces the layer's float `weight` by what the checkpoint
                                          stores (packed integers, scales, zero points), each with
                                          the layer's own weight_loader, so merged q|k|v, gate|up
                                          and tensor-parallel shards load as they do unquantized
    process_weights_after_loading(layer)  repacks once for its kernel
    apply(layer, x)                       the forward: x [T, in] -> [T, out]

A layer the config leaves alone (its `ignore` list: usually the lm_head) keeps the unquantized
method and the CPU GEMMs. The model code does not change.
"""
from __future__ import annotations

from torch import nn

from model_executor.linear import LinearMethodBase

__all__ = ["QuantizationConfig"]


class QuantizationConfig:
    """A quantization method's reading of a checkpoint's `quantization_config`."""

    @classmethod
    def get_name(cls) -> str:
        """The checkpoint's `quant_method` and the engine's `quantization=` for this method."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict) -> "QuantizationConfig":
        """Build from config.json's quantization_config; ValueError naming an unsupported field."""
        raise NotImplementedError

    def has_kv_cache_scales(self) -> bool:
        """True when the checkpoint stores per-layer K and V cache scales (compressed-tensors'
        kv_cache_scheme; vLLM: BaseKVCacheMethod) for an fp8 KV cache (kv_cache_dtype "fp8")."""
        return False

    def kv_cache_scales_per_head(self) -> bool:
        """True when those scales are one per KV head (compressed-tensors' strategy "attn_head")."""
        return False

    def get_quant_method(self, layer: nn.Module, prefix: str, checkpoint_names: list[str],
                         backend: str = "auto") -> LinearMethodBase | None:
        """The linear method for `layer` (our module name `prefix`; `checkpoint_names`: the
        checkpoint's module names it was merged from, e.g. q_proj, k_proj, v_proj for qkv_proj),
        running its matmul on `backend` ("auto": the fastest kernel for the layer's device), or None
        to leave the layer unquantized."""
        raise NotImplementedError
