"""Chapter 10's test cases: the tiny model's shape and the schemes its quantized copies use
(imported by name by tests/10_quantization and the composition tests)."""
from __future__ import annotations

import torch

from quantization.reference import QuantScheme

# hidden 128 / intermediate 256: every linear's input is a multiple of the group sizes used here
TINY_QUANT = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.05)
# name -> (scheme, w8a8)
QUANT_CASES = {
    "w4a16_g32": (QuantScheme(4, True, 32), False),
    "w4a16_asym_g64": (QuantScheme(4, False, 64), False),
    "w8a16": (QuantScheme(8, True, None), False),
    "w8a8": (QuantScheme(8, True, None), True),
}


def hf_quantized(path):
    """HF transformers' own loading of a compressed-tensors checkpoint (it decompresses to floats)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.tensor([[1]]))           # compressed-tensors decompresses on the first forward
    return model
