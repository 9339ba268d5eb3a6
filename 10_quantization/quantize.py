"""Quantize an HF checkpoint and save it in the compressed-tensors format, from the command line:

    python -m quantization.quantize --model DIR --out DIR --scheme W4A16 [--method rtn|gptq|awq]

llmcompressor's `oneshot(model, recipe=GPTQModifier(scheme="W4A16", targets="Linear",
ignore=["lm_head"]))` followed by `save_pretrained(save_compressed=True)`, from scratch: every
decoder linear (q/k/v/o, gate/up/down) quantized, the embeddings, norms and lm_head kept as they are.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from quantization.checkpoint import SCHEMES, save_compressed
from quantization.reference import QuantizedWeight, QuantScheme, quantize_rtn

__all__ = ["decoder_linear_names", "quantize_checkpoint_rtn"]

DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj$")


def decoder_linear_names(names) -> list[str]:
    """The module names of the decoder's linears among checkpoint tensor names."""
    return sorted(n.removesuffix(".weight") for n in names
                  if n.endswith(".weight") and DECODER_LINEAR.match(n.removesuffix(".weight")))


def quantize_checkpoint_rtn(model_dir: Path, scheme: QuantScheme) -> dict[str, QuantizedWeight]:
    """Round-to-nearest needs no data: each linear's weight on its own grid."""
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in decoder_linear_names(f.keys()):
                out[name] = quantize_rtn(f.get_tensor(name + ".weight"), scheme)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="W4A16")
    parser.add_argument("--group-size", type=int, default=None, help="override the scheme's group size (0: per channel)")
    parser.add_argument("--method", choices=("rtn", "gptq", "awq"), default="rtn")
    parser.add_argument("--num-samples", type=int, default=64, help="gptq / awq: calibration windows")
    parser.add_argument("--seq-len", type=int, default=256, help="gptq / awq: tokens per window")
    parser.add_argument("--format", choices=("compressed-tensors", "gptq", "awq"), default="compressed-tensors",
                        help="the checkpoint's layout: compressed-tensors (what llmcompressor writes), or the same "
                             "integers as a GPTQ (symmetric) or AWQ (asymmetric int4) checkpoint")
    parser.add_argument("--kv-cache-scheme", choices=("fp8",), default=None,
                        help="also store per-layer fp8 KV-cache scales, calibrated (for kv_cache_dtype='fp8')")
    parser.add_argument("--kv-observer", choices=("static_minmax", "minmax"), default="static_minmax",
                        help="KV scales: the largest |K| / |V| seen, or llmcompressor's moving average (minmax)")
    args = parser.parse_args(argv)
    if args.model is None:
        from mini_vllm.default_model import default_model_path
        args.model = default_model_path()
    scheme, w8a8 = SCHEMES[args.scheme]
    if args.group_size is not None:
        scheme = QuantScheme(scheme.num_bits, scheme.symmetric, args.group_size or None)
    replaced = None
    if args.method == "rtn":
        weights = quantize_checkpoint_rtn(args.model, scheme)
    else:
        from quantization import calibrated
        weights, replaced = calibrated.quantize_checkpoint(args.model, scheme, args.method, args.num_samples,
                                                           args.seq_len)
    kv_scales = None
    if args.kv_cache_scheme:
        from quantization.kv_scales import calibrate_kv_scales
        kv_scales = calibrate_kv_scales(args.model, args.num_samples, args.seq_len, observer=args.kv_observer)
    save_compressed(args.model, args.out, weights, w8a8=w8a8, replaced=replaced, kv_scales=kv_scales,
                    checkpoint_format=args.format)
    print(f"{args.out}: {len(weights)} linears quantized ({args.scheme}, {args.method})")


if __name__ == "__main__":
    main()
