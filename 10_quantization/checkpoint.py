"""Write a quantized checkpoint in the compressed-tensors format (what llmcompressor's
`oneshot(...)` + `save_pretrained(save_compressed=True)` writes, and what vLLM and HF transformers
read): the float checkpoint's directory, copied, with each quantized linear's `weight` replaced by
its integers and scales, and config.json given a `quantization_config`.

    <layer>.weight_packed      int32 [out, in * b / 32]    WNA16 ("pack-quantized")
    <layer>.weight_scale       [out, groups]               the weight's dtype
    <layer>.weight_zero_point  int32 [out * b / 32, groups]  asymmetric only, packed along outputs
    <layer>.weight_shape       int64 [2]                   [out, in]
  or
    <layer>.weight             int8 [out, in]              W8A8 ("int-quantized")
    <layer>.weight_scale       [out, 1]

compressed-tensors: compressors/pack_quantized/base.py (`compress`), compressors/naive_quantized
(int-quantized), config/ and quantization/quant_config.py (the config's fields).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from quantization.packing import pack_awq, pack_gptq, pack_int32
from quantization.reference import QuantizedWeight, QuantScheme

__all__ = ["SCHEMES", "quantization_config", "save_compressed", "save_decompressed"]

# vLLM / llmcompressor preset names -> (weights, quantized activations?)
SCHEMES = {
    "W4A16": (QuantScheme(4, True, 128), False),
    "W4A16_ASYM": (QuantScheme(4, False, 128), False),
    "W8A16": (QuantScheme(8, True, None), False),
    "W8A8": (QuantScheme(8, True, None), True),
}
COMPRESSED_TENSORS_VERSION = "0.20.1"          # the format version these files follow
_SCALE = {"compressed-tensors": "weight_scale", "gptq": "scales", "awq": "scales"}   # a quantized layer's scale tensor


def quantization_config(scheme: QuantScheme, w8a8: bool, ignore: list[str], lm_head: bool = False,
                        lm_head_scheme: QuantScheme | None = None) -> dict:
    """config.json's quantization_config: one group of every Linear but `ignore`, the lm_head in it
    when `lm_head` (named: vLLM's class target "Linear" does not reach its ParallelLMHead), or in a
    group of its own with `lm_head_scheme` (a target naming a layer wins over a class target in
    vLLM, compressed-tensors and here)."""
    same = lm_head and lm_head_scheme in (None, scheme)
    groups = dict(group_0=_config_group(scheme, w8a8, ["Linear", "lm_head"] if same else ["Linear"]))
    if lm_head and not same:
        groups["group_1"] = _config_group(lm_head_scheme, False, ["lm_head"])
    return dict(quant_method="compressed-tensors",
                format=groups["group_0"]["format"] if len(groups) == 1 else "mixed-precision",
                quantization_status="compressed", config_groups=groups, ignore=list(ignore), kv_cache_scheme=None,
                global_compression_ratio=None, sparsity_config={}, version=COMPRESSED_TENSORS_VERSION)


def _config_group(scheme: QuantScheme, w8a8: bool, targets: list[str]) -> dict:
    weights = dict(num_bits=scheme.num_bits, type="int", symmetric=scheme.symmetric, strategy=scheme.strategy,
                   group_size=scheme.group_size, dynamic=False, actorder=None, observer="minmax",
                   block_structure=None)
    activations = None
    if w8a8:
        activations = dict(num_bits=8, type="int", symmetric=True, strategy="token", group_size=None,
                           dynamic=True, actorder=None, observer=None, block_structure=None)
    return dict(targets=targets, weights=weights, input_activations=activations, output_activations=None,
                format="int-quantized" if w8a8 else "pack-quantized")


def compressed_tensors_of(name: str, weight: QuantizedWeight, w8a8: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized linear `name` (its float weight not among them)."""
    s = weight.scheme
    if w8a8:
        return {f"{name}.weight": weight.q.contiguous(),
                f"{name}.weight_scale": weight.scale.to(dtype).reshape(-1, 1).contiguous()}
    tensors = {f"{name}.weight_packed": pack_int32(weight.q, s.num_bits),
               f"{name}.weight_scale": weight.scale.to(dtype).contiguous(),
               f"{name}.weight_shape": torch.tensor(list(weight.q.shape), dtype=torch.int64)}
    if not s.symmetric:
        tensors[f"{name}.weight_zero_point"] = pack_int32(weight.zero_point, s.num_bits, dim=0)
    return tensors


def gptq_tensors_of(name: str, weight: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """GPTQ's tensors of one linear (format "gptq": qzeros store zero - 1, so symmetric only here,
    where that is the grid's middle - 1 for every group)."""
    s = weight.scheme
    if not s.symmetric:
        raise ValueError("the GPTQ writer stores symmetric schemes (format 'gptq' cannot hold every zero point)")
    groups, in_features = weight.scale.shape[1], weight.q.shape[1]
    size = s.group_size or in_features
    return {f"{name}.qweight": pack_gptq(weight.q, s.num_bits),
            f"{name}.scales": weight.scale.t().to(dtype).contiguous(),
            f"{name}.qzeros": pack_int32(torch.full((groups, weight.q.shape[0]), -1, dtype=torch.int8), s.num_bits),
            f"{name}.g_idx": (torch.arange(in_features) // size).to(torch.int32)}


def awq_tensors_of(name: str, weight: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """AWQ's ("gemm") tensors of one int4 linear; asymmetric (its zero points always stored)."""
    if weight.scheme.num_bits != 4:
        raise ValueError("AWQ checkpoints are int4")
    return {f"{name}.qweight": pack_awq(weight.q),
            f"{name}.scales": weight.scale.t().to(dtype).contiguous(),
            f"{name}.qzeros": pack_awq(weight.zero_point)}


def packed_format_config(fmt: str, scheme: QuantScheme, lm_head: bool = False) -> dict:
    """config.json's quantization_config of a GPTQ (AutoGPTQ / GPTQModel) or AWQ (AutoAWQ) checkpoint;
    `lm_head`: the lm_head is quantized too (the key vLLM's GPTQ and AWQ configs read)."""
    group = scheme.group_size or -1
    if fmt == "gptq":
        return dict(quant_method="gptq", bits=scheme.num_bits, group_size=group, desc_act=False, sym=scheme.symmetric,
                    checkpoint_format="gptq", lm_head=lm_head)
    return dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm",
                modules_to_not_convert=None, **({"lm_head": True} if lm_head else {}))


def save_compressed(model_dir: Path | str, out_dir: Path | str, weights: dict[str, QuantizedWeight], w8a8: bool = False,
                    ignore: list[str] | None = None, replaced: dict[str, torch.Tensor] | None = None,
                    kv_scales: dict[str, float | torch.Tensor] | None = None, checkpoint_format: str = "compressed-tensors") -> Path:
    """Copy the HF checkpoint `model_dir` to `out_dir` with the linears named in `weights` (HF module
    names, e.g. "model.layers.0.self_attn.q_proj") stored quantized. `replaced`: float tensors to
    write instead of the checkpoint's (AWQ folds its scales into the norms). `kv_scales`: per-layer
    fp8 KV-cache scales (kv_scales.py; [heads, 1, 1] tensors: one per KV head, strategy "attn_head")
    stored with a `kv_cache_scheme`. `checkpoint_format`:
    "compressed-tensors", or the same integers in GPTQ's or AWQ's own layout ("gptq", "awq"). Every
    quantized decoder linear must share one scheme (one config group); everything else stays as it
    was. A quantized "lm_head" of a tied model unties it (config.json's tie_word_embeddings false); it
    may have a scheme of its own (a second config group, compressed-tensors weight-only)."""
    if checkpoint_format not in ("compressed-tensors", "gptq", "awq"):
        raise ValueError(f"checkpoint_format must be compressed-tensors, gptq or awq, got {checkpoint_format!r}")
    if checkpoint_format != "compressed-tensors" and (w8a8 or kv_scales):
        raise ValueError(f"a {checkpoint_format} checkpoint holds weight-only integers (no W8A8, no KV-cache scales)")
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    schemes = {w.scheme for name, w in weights.items() if name != "lm_head"}
    if len(schemes) != 1:
        raise ValueError(f"save_compressed writes one scheme for the decoder linears: got {len(schemes)} schemes "
                         f"{sorted(map(str, schemes))}")
    scheme = schemes.pop()
    lm_head_scheme = weights["lm_head"].scheme if "lm_head" in weights else None
    if lm_head_scheme not in (None, scheme) and (checkpoint_format != "compressed-tensors" or w8a8):
        raise ValueError(f"an lm_head of another scheme ({lm_head_scheme}) than the decoder's ({scheme}) needs a "
                         "config group of its own: a weight-only compressed-tensors checkpoint (not gptq / awq / W8A8)")
    replaced = dict(replaced or {})
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}

    def write_quantized(module: str, dtype: torch.dtype) -> None:
        if checkpoint_format == "gptq":
            tensors.update(gptq_tensors_of(module, weights[module], dtype))
        elif checkpoint_format == "awq":
            tensors.update(awq_tensors_of(module, weights[module], dtype))
        else:
            tensors.update(compressed_tensors_of(module, weights[module], w8a8, dtype))

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                module = key.removesuffix(".weight")
                if key.endswith(".weight") and module in weights:
                    write_quantized(module, f.get_tensor(key).dtype)
                else:
                    tensors[key] = replaced.pop(key) if key in replaced else f.get_tensor(key)
    config = json.loads((model_dir / "config.json").read_text())
    if "lm_head" in weights:     # integers of its own; the embedding lookup keeps its floats
        if f"lm_head.{_SCALE[checkpoint_format]}" not in tensors:          # tied: the embedding's matrix
            write_quantized("lm_head", tensors["model.embed_tokens.weight"].dtype)
        config["tie_word_embeddings"] = False
    missing = sorted(m for m in weights if f"{m}.{_SCALE[checkpoint_format]}" not in tensors)
    if missing or replaced:
        raise ValueError(f"save_compressed: not in {model_dir}: {missing + sorted(replaced)}")
    kv_tensors = {name: _kv_scale_tensor(scale) for name, scale in (kv_scales or {}).items()}
    tensors.update(kv_tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    for path in model_dir.iterdir():                     # tokenizer, chat template, generation config
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                                   "model.safetensors.index.json"):
            shutil.copy2(path, out_dir / path.name)
    if checkpoint_format == "compressed-tensors":
        if ignore is None:
            ignore = [] if "lm_head" in weights else ["lm_head"]
        config["quantization_config"] = quantization_config(scheme, w8a8, ignore, lm_head="lm_head" in weights,
                                                            lm_head_scheme=lm_head_scheme)
    else:
        config["quantization_config"] = packed_format_config(checkpoint_format, scheme, lm_head="lm_head" in weights)
    if kv_scales:
        from quantization.kv_scales import KV_CACHE_SCHEME
        per_head = any(t.dim() == 3 for t in kv_tensors.values())             # [heads, 1, 1]
        config["quantization_config"]["kv_cache_scheme"] = dict(KV_CACHE_SCHEME,
                                                                strategy="attn_head" if per_head else "tensor")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def _kv_scale_tensor(scale) -> torch.Tensor:
    """A KV-cache scale as stored: [1] for one per layer, [heads, 1, 1] for one per KV head."""
    t = torch.as_tensor(scale, dtype=torch.float32)
    return t.reshape(1) if t.dim() == 0 else t.contiguous()


def save_decompressed(quantized_dir: Path | str, out_dir: Path | str) -> Path:
    """The float checkpoint a compressed-tensors one stands for: each quantized linear's integers
    dequantized back into a `weight` (what compressed-tensors' decompressor, and HF through it, give),
    config.json without its quantization_config. An unquantized engine on it must give the quantized
    engine's tokens: the truth the composition matrix keeps for quantized pairs."""
    from safetensors.torch import load_file, save_file

    from quantization.compressed_tensors import CompressedTensorsConfig
    from quantization.packing import unpack_int32
    from quantization.reference import dequantize

    quantized_dir, out_dir = Path(quantized_dir), Path(out_dir)
    config = json.loads((quantized_dir / "config.json").read_text())
    ct_config = CompressedTensorsConfig.from_config(config.pop("quantization_config"))
    tensors = {}
    for path in sorted(quantized_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    for name in [k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")]:
        group = ct_config.scheme_of(name, None)        # the checkpoint's modules: no layer, matched by name
        if group is None:
            raise ValueError(f"{quantized_dir}: {name} is quantized but no config group targets it")
        scheme = group.weights
        scale = tensors.pop(f"{name}.weight_scale")
        if f"{name}.weight_packed" in tensors:
            q = unpack_int32(tensors.pop(f"{name}.weight_packed"), scheme.num_bits)
            tensors.pop(f"{name}.weight_shape", None)
            zp = tensors.pop(f"{name}.weight_zero_point", None)
            zero = unpack_int32(zp, scheme.num_bits, dim=0) if zp is not None else torch.zeros_like(scale, dtype=torch.int8)
        else:                                                       # int-quantized: the int8 weight itself
            q, zero = tensors.pop(f"{name}.weight"), torch.zeros_like(scale, dtype=torch.int8)
        tensors[f"{name}.weight"] = dequantize(q, scale, zero, scheme)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for path in quantized_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, out_dir / path.name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
