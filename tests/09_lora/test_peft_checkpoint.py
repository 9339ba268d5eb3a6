"""Reading PEFT's saved adapters: every A and B lands in the right slice of the right merged layer,
the scaling is PEFT's, and every adapter we cannot serve exactly is refused with the file and key named.

The oracle is PEFT itself: the in-memory PeftModel that wrote each directory holds the tensors each
slice must equal, bit for bit, and its `scaling` dict the scale."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora.peft_checkpoint import (CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, hf_module_map, load_peft_adapter,
                                  lora_targets)


@pytest.fixture(scope="module")
def targets(tiny_lora):
    return lora_targets(tiny_lora.model)


def peft_layer(peft_model, hf_name: str):
    """PEFT's LoRA layer for an HF module name ("model.layers.0.self_attn.k_proj")."""
    return peft_model.base_model.model.get_submodule(hf_name)


def test_targets_are_the_merged_layers(tiny_lora, targets):
    config = tiny_lora.config
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    qkv = targets["model.layers.1.self_attn.qkv_proj"]
    assert (qkv.input_size, qkv.output_sizes, qkv.hf_names, qkv.offsets) == \
        (config.hidden_size, (q, kv, kv), ("q_proj", "k_proj", "v_proj"), (0, q, q + kv))
    gate_up = targets["model.layers.0.mlp.gate_up_proj"]
    assert gate_up.hf_names == ("gate_proj", "up_proj") and gate_up.output_sizes == (config.intermediate_size,) * 2
    assert targets["model.layers.0.mlp.down_proj"].input_size == config.intermediate_size
    assert len(targets) == 4 * config.num_hidden_layers                  # no lm_head, no embedding
    assert hf_module_map(targets)["model.layers.1.self_attn.v_proj"] == ("model.layers.1.self_attn.qkv_proj", 2)


@pytest.mark.parametrize("name", ["plain", "rslora", "partial"])
def test_every_slice_equals_peft(tiny_lora, targets, name):
    lora = load_peft_adapter(tiny_lora.dirs[name], targets, max_lora_rank=8)
    peft_config = tiny_lora.peft_model.peft_config[name]
    assert lora.rank == peft_config.r
    expected_scale = peft_config.lora_alpha / (math.sqrt(peft_config.r) if peft_config.use_rslora else peft_config.r)
    assert lora.scaling == pytest.approx(expected_scale)
    found = 0
    for hf_name, (layer, index) in hf_module_map(targets).items():
        short = hf_name.rsplit(".", 1)[-1]
        if short not in peft_config.target_modules:
            assert index not in lora.layers.get(layer, {}), f"{name}: {hf_name} is not targeted but was loaded"
            continue
        peft = peft_layer(tiny_lora.peft_model, hf_name)
        assert peft.scaling[name] == pytest.approx(lora.scaling)
        assert torch.equal(lora.layers[layer][index].lora_a, peft.lora_A[name].weight), hf_name
        assert torch.equal(lora.layers[layer][index].lora_b, peft.lora_B[name].weight), hf_name
        found += 1
    assert found == len(peft_config.target_modules) * tiny_lora.config.num_hidden_layers


# ---- bad adapters: each a copy of "plain" with one thing broken -------------------------------------

def edit_config(**changes):
    def edit(d):
        raw = json.loads((d / CONFIG_FILE).read_text())
        raw.update(changes)
        (d / CONFIG_FILE).write_text(json.dumps(raw))
    return edit


def edit_tensors(fn):
    def edit(d):
        tensors = load_file(d / WEIGHTS_FILE)
        fn(tensors)
        save_file(tensors, d / WEIGHTS_FILE, metadata={"format": "pt"})
    return edit


KEY_A = f"{PEFT_PREFIX}model.layers.1.self_attn.k_proj.lora_A.weight"
KEY_B = f"{PEFT_PREFIX}model.layers.0.mlp.up_proj.lora_B.weight"

BAD = {
    "rank above max": (edit_config(), dict(max_lora_rank=4), r"r=8 is above max_lora_rank=4"),
    "lm_head target": (edit_config(target_modules=["q_proj", "lm_head"]), {}, r"target module 'lm_head'"),
    "regex matches nothing": (edit_config(target_modules=r".*\.embed_tokens"), {}, r"regex .* matches no layer"),
    "dora": (edit_config(use_dora=True), {}, r"use_dora=True"),
    "bias": (edit_config(bias="lora_only"), {}, r"bias='lora_only'"),
    "modules_to_save": (edit_config(modules_to_save=["lm_head"]), {}, r"modules_to_save"),
    "fan_in_fan_out": (edit_config(fan_in_fan_out=True), {}, r"fan_in_fan_out=True"),
    "rank_pattern": (edit_config(rank_pattern={"q_proj": 4}), {}, r"rank_pattern"),
    "not lora": (edit_config(peft_type="IA3"), {}, r"not a LoRA adapter"),
    "missing tensor": (edit_tensors(lambda t: t.pop(KEY_A)), {},
                       r"missing tensor .*layers\.1\.self_attn\.k_proj\.lora_A"),
    "transposed A": (edit_tensors(lambda t: t.update({KEY_A: t[KEY_A].T.contiguous()})), {},
                     r"k_proj\.lora_A\.weight' has shape"),
    "short B": (edit_tensors(lambda t: t.update({KEY_B: t[KEY_B][:-1].contiguous()})), {},
                r"up_proj\.lora_B\.weight' has shape"),
    "integer B": (edit_tensors(lambda t: t.update({KEY_B: t[KEY_B].to(torch.int32)})), {}, r"floating point"),
    "extra tensor": (edit_tensors(lambda t: t.update({f"{PEFT_PREFIX}lm_head.lora_A.weight": torch.zeros(8, 64)})), {},
                     r"unexpected tensor .*lm_head"),
    "layer the model lacks": (edit_tensors(lambda t: t.update({KEY_A.replace(".1.", ".7."): t[KEY_A].clone()})), {},
                              r"unexpected tensor .*layers\.7\."),
    "corrupt safetensors": (lambda d: (d / WEIGHTS_FILE).write_bytes((d / WEIGHTS_FILE).read_bytes()[:200]), {},
                            r"adapter_model\.safetensors: not a readable safetensors file"),
    "no safetensors": (lambda d: (d / WEIGHTS_FILE).rename(d / "adapter_model.bin"), {}, r"only safetensors"),
    "no config": (lambda d: (d / CONFIG_FILE).unlink(), {}, r"adapter_config\.json: not found"),
    "config not json": (lambda d: (d / CONFIG_FILE).write_text("{r: 8"), {}, r"adapter_config\.json: cannot read"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_a_clear_error(tiny_lora, targets, tmp_path, case):
    edit, kwargs, message = BAD[case]
    broken = tmp_path / "adapter"
    shutil.copytree(tiny_lora.dirs["plain"], broken)
    load_peft_adapter(broken, targets, max_lora_rank=8)                  # the unbroken copy loads
    edit(broken)
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(broken, targets, **{"max_lora_rank": 8, **kwargs})


def test_partial_layers_and_exclusions_follow_peft(tiny_lora, targets, tmp_path):
    """layers_to_transform / exclude_modules: only the modules PEFT targeted are expected; a module
    they leave out that still has tensors is an error (PEFT would not apply it)."""
    adapter = tmp_path / "adapter"
    shutil.copytree(tiny_lora.dirs["plain"], adapter)
    edit_config(layers_to_transform=[0])(adapter)
    edit_tensors(lambda t: [t.pop(k) for k in list(t) if ".layers.1." in k])(adapter)
    lora = load_peft_adapter(adapter, targets, max_lora_rank=8)
    assert sorted(lora.layers) == sorted(n for n in targets if ".layers.0." in n)
    edit_config(exclude_modules=["down_proj"])(adapter)
    with pytest.raises(ValueError, match=r"unexpected tensor .*layers\.0\.mlp\.down_proj"):
        load_peft_adapter(adapter, targets, max_lora_rank=8)
