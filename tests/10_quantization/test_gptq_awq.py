"""GPTQ and AWQ checkpoints (gptq_awq.py): their layouts against compressed-tensors' own AutoAWQ
converter, the engine's tokens on the same integers in all three formats, tensor parallelism through
the converting loaders, and the fields that are refused."""
import json
import shutil

import pytest
import torch

from mini_vllm import SamplingParams
from quantization.checkpoint import awq_tensors_of, compressed_tensors_of, save_compressed
from quantization.quantize import quantize_checkpoint_rtn
from quantization.reference import QuantScheme

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
FORMATS = {   # name -> (format, scheme): GPTQ as its writers make it (symmetric), AWQ (asymmetric int4)
    "gptq_w4g32": ("gptq", QuantScheme(4, True, 32)),
    "gptq_w8": ("gptq", QuantScheme(8, True, None)),
    "awq_w4g32": ("awq", QuantScheme(4, False, 32)),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_float, tmp_path_factory):
    """name -> (the checkpoint in its format, the same integers as compressed-tensors)."""
    float_dir, _ = tiny_float
    root = tmp_path_factory.mktemp("formats")
    out = {}
    for name, (fmt, scheme) in FORMATS.items():
        weights = quantize_checkpoint_rtn(float_dir, scheme)
        out[name] = (save_compressed(float_dir, root / name, weights, checkpoint_format=fmt),
                     save_compressed(float_dir, root / f"{name}_ct", weights))
    return out


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_awq_layout_equals_compressed_tensors_converter(tiny_float):
    """compressed-tensors' AutoAWQConverter (the vLLM project's) turns our AWQ tensors into exactly
    the tensors our compressed-tensors writer stores for the same integers: the nibble order, the
    zero points and the scales' transpose are AWQ's."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    float_dir, _ = tiny_float
    weights = quantize_checkpoint_rtn(float_dir, QuantScheme(4, False, 32))
    name = "model.layers.0.mlp.down_proj"
    converted = AutoAWQConverter(bits=4, group_size=32, zero_point=True).process(
        awq_tensors_of(name, weights[name], torch.float32))
    ours = compressed_tensors_of(name, weights[name], False, torch.float32)
    for key in ("weight_packed", "weight_scale", "weight_zero_point"):
        assert torch.equal(converted[f"{name}.{key}"], ours[f"{name}.{key}"]), key
    assert converted[f"{name}.weight_shape"].tolist() == ours[f"{name}.weight_shape"].tolist()


@pytest.mark.parametrize("name", FORMATS)
def test_the_engine_gives_the_same_tokens_in_every_format(checkpoints, make_llm, name):
    """The same integers as GPTQ, AWQ or compressed-tensors tensors: the same greedy tokens (the
    loaders convert each piece of the merged q|k|v and gate|up layers as it loads)."""
    fmt_dir, ct_dir = checkpoints[name]
    config = json.loads((fmt_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == FORMATS[name][0]
    assert tokens(make_llm(fmt_dir)) == tokens(make_llm(ct_dir))


def test_tensor_parallel_shards_of_an_awq_checkpoint(checkpoints, make_llm):
    """TP=2: column-parallel layers split the converted rows, row-parallel ones the packed words and
    groups (a split must not cut a group): the tokens of TP=1."""
    fmt_dir, _ = checkpoints["awq_w4g32"]
    llm = make_llm(fmt_dir, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert tokens(llm) == tokens(make_llm(fmt_dir))
    finally:
        llm.shutdown()


def edited(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("name, changes, message", [
    ("gptq_w4g32", dict(bits=3), r"gptq quantization_config\.bits: 3"),
    ("gptq_w4g32", dict(checkpoint_format="marlin"), r"checkpoint_format: 'marlin'"),
    ("awq_w4g32", dict(version="gemv"), r"awq quantization_config\.version: 'gemv'"),
    ("awq_w4g32", dict(bits=8), r"awq quantization_config\.bits: 8"),
])
def test_unsupported_fields_are_refused_naming_them(checkpoints, make_llm, tmp_path, name, changes, message):
    with pytest.raises(ValueError, match=message):
        make_llm(edited(checkpoints[name][0], tmp_path / "bad", **changes))


def test_a_g_idx_that_regroups_the_inputs_is_refused(checkpoints, make_llm, tmp_path):
    """desc_act with act-order: g_idx is not i // group_size, and the kernels read groups in order."""
    from safetensors.torch import load_file, save_file
    bad = edited(checkpoints["gptq_w4g32"][0], tmp_path / "bad", desc_act=True)
    file = bad / "model.safetensors"
    tensors = load_file(file)
    key = "model.layers.0.mlp.down_proj.g_idx"
    tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="g_idx regroups the inputs"):
        make_llm(bad)
