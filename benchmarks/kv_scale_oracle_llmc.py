"""The peer side of benchmarks/kv_scale_oracle.py: llmcompressor's `oneshot` with a
`kv_cache_scheme` (fp8, per tensor) on OUR calibration tokens; runs in .venv-quant and imports
nothing of this repository.

    .venv-quant/bin/python benchmarks/kv_scale_oracle_llmc.py --ids IDS.json --model DIR --out DIR \
        --observer static_minmax|minmax

The weights get int8 per channel (RTN) so that the checkpoint is one our engine and vLLM load; the
KV-cache scales are the point: model.safetensors holds model.layers.{i}.self_attn.{k,v}_scale.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=Path, required=True, help="JSON: [[token ids] per window]")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--observer", default="static_minmax", choices=["static_minmax", "minmax"])
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = json.loads(args.ids.read_text())
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    weights = dict(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False)
    kv = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True, observer=args.observer)
    recipe = [QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                   ignore=["lm_head"], kv_cache_scheme=kv)]
    start = time.perf_counter()
    oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=len(ids[0]), shuffle_calibration_samples=False)
    seconds = time.perf_counter() - start
    model.save_pretrained(args.out, save_compressed=True)
    AutoTokenizer.from_pretrained(args.model).save_pretrained(args.out)
    (args.out / "run.json").write_text(json.dumps({"seconds": seconds, "windows": len(ids), "seq_len": len(ids[0]),
                                                   "observer": args.observer,
                                                   "llmcompressor": llmcompressor.__version__}, indent=2))


if __name__ == "__main__":
    main()
