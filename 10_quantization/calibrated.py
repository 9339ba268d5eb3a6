"""GPTQ and AWQ over a whole HF checkpoint: the data-driven half of `python -m quantization.quantize`.

The float model is loaded with HF transformers (fp32, on the CPU), fed `n` windows of
calibration text (calibration.py: the standard library's docstrings, never the held-out modules),
and quantized layer by layer (gptq.py / awq.py); the result is what checkpoint.save_compressed
writes: the integers of every decoder linear, and for AWQ the smoothed norms (their scales folded in).
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantization.calibration import calibration_samples
from quantization.reference import QuantizedWeight, QuantScheme

__all__ = ["quantize_checkpoint"]


def quantize_checkpoint(model_dir: Path, scheme: QuantScheme, method: str, num_samples: int = 64,
                        seq_len: int = 256, progress=None, lm_head_scheme: QuantScheme | None = None
                        ) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """(integers per HF linear name, float tensors that replace the checkpoint's) for method "gptq" or
    "awq"; `lm_head_scheme`: GPTQ quantizes the lm_head too, on the final norm's outputs (AWQ's
    smoothing maps, llmcompressor's too, cover the decoder layers only)."""
    if lm_head_scheme is not None and method != "gptq":
        raise ValueError(f"a quantized lm_head is made with rtn or gptq: {method}'s smoothing maps cover the "
                         "decoder layers only")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = calibration_samples(AutoTokenizer.from_pretrained(model_dir), num_samples, seq_len)
    if method == "gptq":
        from quantization.gptq import gptq_quantize_model
        # static act-order (llmcompressor's default): 22.03 vs 23.16 held-out perplexity in order (quant_oracle.json)
        return gptq_quantize_model(model, samples, scheme, act_order=True, progress=progress,
                                   lm_head_scheme=lm_head_scheme), {}
    if method == "awq":
        from quantization.awq import awq_quantize_model
        result = awq_quantize_model(model, samples, scheme, progress=progress)
        quantized_linears = {f"{name}.weight" for name in result.quantized}
        replaced = {k: v for k, v in result.smoothed.items() if k not in quantized_linears}
        return result.quantized, replaced
    raise ValueError(f"method must be 'gptq' or 'awq', got {method!r}")
