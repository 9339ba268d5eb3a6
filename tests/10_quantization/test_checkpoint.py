"""The checkpoint writer against compressed-tensors' own compressors, and the written checkpoints
read back by HF transformers (which decompresses them with compressed-tensors) and by our loader."""
import json

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from quant_cases import QUANT_CASES, hf_quantized

from mini_vllm.config import ModelConfig
from mini_vllm.models.loader import get_model
from quantization.checkpoint import compressed_tensors_of, quantization_config, save_decompressed
from quantization.packing import unpack_int32
from quantization.reference import QuantScheme, quantize_rtn
from tolerances import assert_close, assert_equal


def ct_scheme(s: QuantScheme, w8a8: bool) -> QuantizationScheme:
    weights = QuantizationArgs(num_bits=s.num_bits, type="int", symmetric=s.symmetric, strategy=s.strategy,
                               group_size=s.group_size)
    act = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True) if w8a8 else None
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=act)


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_written_tensors_equal_compressed_tensors_compressor(case):
    scheme, w8a8 = QUANT_CASES[case]
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(0))
    qw = quantize_rtn(w, scheme)
    ours = compressed_tensors_of("layer", qw, w8a8, torch.float32)
    fmt = "int-quantized" if w8a8 else "pack-quantized"
    state = {"weight": w, "weight_scale": qw.scale, "weight_zero_point": qw.zero_point}
    theirs = BaseCompressor.load_from_registry(fmt).compress(state, ct_scheme(scheme, w8a8))
    assert sorted(ours) == sorted(f"layer.{k}" for k in theirs), (sorted(ours), sorted(theirs))
    for key, tensor in theirs.items():
        assert_equal(ours[f"layer.{key}"], tensor.to(ours[f"layer.{key}"].dtype) if key == "weight_scale" else tensor,
                     key)


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_config_is_valid_for_compressed_tensors(case, tiny_quantized):
    config = json.loads((tiny_quantized[case] / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    scheme, w8a8 = QUANT_CASES[case]
    group = parsed.config_groups["group_0"]
    assert group.weights.num_bits == scheme.num_bits and group.weights.symmetric == scheme.symmetric
    assert (group.input_activations is not None) == w8a8
    assert config == quantization_config(scheme, w8a8, ["lm_head"])


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_written_tensors_decompress_with_compressed_tensors(case):
    """compressed-tensors' own decompressor turns what we wrote back into our dequantized weight."""
    scheme, w8a8 = QUANT_CASES[case]
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    qw = quantize_rtn(w, scheme)
    state = {k.removeprefix("layer."): v for k, v in compressed_tensors_of("layer", qw, w8a8, torch.float32).items()}
    fmt = "int-quantized" if w8a8 else "pack-quantized"
    theirs = BaseCompressor.load_from_registry(fmt).decompress(state, ct_scheme(scheme, w8a8))
    assert_close(theirs["weight"].float(), qw.dequantize())


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_save_decompressed_equals_compressed_tensors_decompressor(case, tiny_quantized, tmp_path):
    """Our float copy of a quantized checkpoint: every linear's weight is what compressed-tensors'
    decompressor makes of the stored tensors; every other tensor unchanged."""
    from safetensors.torch import load_file

    scheme, w8a8 = QUANT_CASES[case]
    path = tiny_quantized[case]
    stored = load_file(str(path / "model.safetensors"))
    ours = load_file(str(save_decompressed(path, tmp_path / "float") / "model.safetensors"))
    compressor = BaseCompressor.load_from_registry("int-quantized" if w8a8 else "pack-quantized")
    layers = {k.removesuffix(".weight_scale") for k in stored if k.endswith(".weight_scale")}
    assert len(layers) == 14                                          # 2 layers x q k v o gate up down
    for layer in layers:
        state = {k.removeprefix(layer + "."): v for k, v in stored.items() if k.startswith(layer + ".")}
        assert_close(ours[f"{layer}.weight"], compressor.decompress(state, ct_scheme(scheme, w8a8))["weight"].float())
    assert set(ours) == {k for k in stored if not k.startswith(tuple(layers))} | {f"{m}.weight" for m in layers}
    assert "quantization_config" not in json.loads((tmp_path / "float" / "config.json").read_text())


SYMMETRIC = sorted(c for c, (s, _) in QUANT_CASES.items() if s.symmetric)


@pytest.mark.parametrize("case", SYMMETRIC)
def test_hf_decompresses_the_weights_our_loader_reads(case, tiny_quantized):
    """HF's float weights (decompressed by compressed-tensors) equal our layers' dequantized ones,
    merged q|k|v and gate|up included. Symmetric schemes only: transformers 5.25 builds asymmetric
    layers with zero points [out, groups] and re-initialises the checkpoint's packed ones
    ([out * b / 32, groups], the layout compressed-tensors writes and vLLM reads: a size-mismatch
    warning); the test above covers asymmetric decompression with compressed-tensors itself."""
    path = tiny_quantized[case]
    hf = hf_quantized(path)
    ours = get_model(ModelConfig.from_pretrained(path), cpu_gemm_backend="torch")
    scheme, w8a8 = QUANT_CASES[case]
    for i, layer in enumerate(ours.model.layers):
        hf_layer = hf.model.layers[i]
        pairs = [(layer.self_attn.qkv_proj, torch.cat([hf_layer.self_attn.q_proj.weight, hf_layer.self_attn.k_proj.weight,
                                                       hf_layer.self_attn.v_proj.weight])),
                 (layer.self_attn.o_proj, hf_layer.self_attn.o_proj.weight),
                 (layer.mlp.gate_up_proj, torch.cat([hf_layer.mlp.gate_proj.weight, hf_layer.mlp.up_proj.weight])),
                 (layer.mlp.down_proj, hf_layer.mlp.down_proj.weight)]
        for ours_linear, hf_weight in pairs:
            assert_close(dequantized(ours_linear, scheme, w8a8), hf_weight.detach(), msg=f"layer {i}")


def dequantized(linear, scheme: QuantScheme, w8a8: bool) -> torch.Tensor:
    """Our layer's weight as floats, read from the parameters the loader filled."""
    if w8a8:
        return linear.weight.float() * linear.weight_scale.float()
    q = unpack_int32(linear.weight_packed.data, scheme.num_bits).float()
    groups = linear.weight_scale.shape[1]
    q = q.reshape(q.shape[0], groups, -1)
    if not scheme.symmetric:
        q = q - linear.weight_zero_point.float().unsqueeze(-1)
    return (q * linear.weight_scale.float().unsqueeze(-1)).reshape(q.shape[0], -1)
