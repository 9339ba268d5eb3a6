"""Quantize an HF checkpoint and save it in the compressed-tensors format, from the command line:

    python -m quantization.quantize --model DIR --out DIR --scheme W4A16 [--method rtn|gptq|awq]

llmcompressor's `oneshot(model, recipe=GPTQModifier(scheme="W4A16", targets="Linear",
ignore=["lm_head"]))` followed by `save_pretrained(save_compressed=True)`, from scratch: every
decoder linear (q/k/v/o, gate/up/down) quantized, the embeddings, norms and lm_head kept as they are.

`--lm-head` quantizes the lm_head too, with rtn or gptq (llmcompressor without `ignore=["lm_head"]`;
GPTQ's `"lm_head": true`), the one matrix a decode step reads that the decoder linears leave in floats. A
tied model (SmolLM2) is untied for it: the embedding lookup keeps its float rows, the lm_head gets
integers of its own (vLLM 0.32 runs either as ParallelLMHead's linear method). `--lm-head-scheme
W8A16` gives it a scheme of its own in a second config group (int4 decoder linears, an int8 lm_head).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from quantization.checkpoint import SCHEMES, save_compressed
from quantization.reference import QuantizedWeight, QuantScheme, quantize_rtn

__all__ = ["decoder_linear_names", "quantize_checkpoint_rtn"]

DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj$")
LM_HEAD_SOURCES = ("lm_head.weight", "model.embed_tokens.weight")     # untied first; a tied model has one matrix


def decoder_linear_names(names) -> list[str]:
    """The module names of the decoder's linears among checkpoint tensor names."""
    return sorted(n.removesuffix(".weight") for n in names
                  if n.endswith(".weight") and DECODER_LINEAR.match(n.removesuffix(".weight")))


def quantize_checkpoint_rtn(model_dir: Path, scheme: QuantScheme, lm_head: bool = False,
                            lm_head_scheme: QuantScheme | None = None) -> dict[str, QuantizedWeight]:
    """Round-to-nearest needs no data: each linear's weight on its own grid (and the lm_head's,
    `lm_head`: its own matrix, or the embedding's when the two are tied; `lm_head_scheme`, default
    `scheme`)."""
    from safetensors import safe_open

    out, tensors = {}, {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in decoder_linear_names(f.keys()):
                out[name] = quantize_rtn(f.get_tensor(name + ".weight"), scheme)
            if lm_head:
                tensors.update({k: f.get_tensor(k) for k in LM_HEAD_SOURCES if k in f.keys()})
    if lm_head:
        source = next((k for k in LM_HEAD_SOURCES if k in tensors), None)
        if source is None:
            raise ValueError(f"{model_dir}: no lm_head.weight nor model.embed_tokens.weight to quantize")
        out["lm_head"] = quantize_rtn(tensors[source], lm_head_scheme or scheme)
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
    parser.add_argument("--lm-head", action="store_true",
                        help="quantize the lm_head too (rtn or gptq, the same scheme; a tied one is untied)")
    parser.add_argument("--lm-head-scheme", choices=sorted(s for s in SCHEMES if not SCHEMES[s][1]), default=None,
                        help="the lm_head's own weight-only scheme (implies --lm-head; a second config group), "
                             "e.g. W8A16 beside W4A16 decoder linears")
    parser.add_argument("--kv-cache-scheme", choices=("fp8",), default=None,
                        help="also store per-layer fp8 KV-cache scales, calibrated (for kv_cache_dtype='fp8')")
    parser.add_argument("--kv-strategy", choices=("tensor", "attn_head"), default="tensor",
                        help="KV scales: one per layer, or one per KV head (llmcompressor's attn_head)")
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
    lm_head_scheme = SCHEMES[args.lm_head_scheme][0] if args.lm_head_scheme else None
    args.lm_head = args.lm_head or lm_head_scheme is not None
    if args.lm_head and args.method == "awq":
        parser.error("--lm-head: with rtn or gptq (AWQ's smoothing maps, llmcompressor's too, cover the decoder "
                     "layers only)")
    if args.method == "rtn":
        weights = quantize_checkpoint_rtn(args.model, scheme, lm_head=args.lm_head, lm_head_scheme=lm_head_scheme)
    else:
        from quantization import calibrated
        head = (lm_head_scheme or scheme) if args.lm_head else None
        weights, replaced = calibrated.quantize_checkpoint(args.model, scheme, args.method, args.num_samples,
                                                           args.seq_len, lm_head_scheme=head)
    kv_scales = None
    if args.kv_cache_scheme:
        from quantization.kv_scales import calibrate_kv_scales
        kv_scales = calibrate_kv_scales(args.model, args.num_samples, args.seq_len, observer=args.kv_observer,
                                        strategy=args.kv_strategy)
    save_compressed(args.model, args.out, weights, w8a8=w8a8, replaced=replaced, kv_scales=kv_scales,
                    checkpoint_format=args.format)
    print(f"{args.out}: {len(weights)} linears quantized ({args.scheme}, {args.method})")


if __name__ == "__main__":
    main()
