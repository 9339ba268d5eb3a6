"""Fixtures for chapter 10: a tiny random Llama (GQA, SmolLM2's tokenizer) and quantized copies of
it written by our own checkpoint writer, each made once per session."""
from __future__ import annotations

import pytest
from quant_cases import QUANT_CASES, TINY_QUANT
from tiny_checkpoints import make_tiny_engine_checkpoint

from quantization.checkpoint import save_compressed
from quantization.quantize import quantize_checkpoint_rtn

@pytest.fixture(scope="session")
def tiny_float(tmp_path_factory):
    """(directory, HF model) of the float checkpoint."""
    path = tmp_path_factory.mktemp("quant") / "float"
    return path, make_tiny_engine_checkpoint(path, "llama", seed=3, **TINY_QUANT)


@pytest.fixture(scope="session")
def tiny_quantized(tiny_float, tmp_path_factory):
    """name -> directory of the float checkpoint quantized with RTN by QUANT_CASES[name]."""
    float_dir, _ = tiny_float
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, (scheme, w8a8) in QUANT_CASES.items():
        out[name] = save_compressed(float_dir, root / name, quantize_checkpoint_rtn(float_dir, scheme), w8a8=w8a8)
    return out
