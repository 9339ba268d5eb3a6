"""The peer side of benchmarks/quant_oracle.py: llmcompressor's `oneshot` on OUR calibration tokens.

Runs in .venv-quant (llmcompressor 0.14 and its own transformers), never in .venv; it imports
nothing of this repository. quant_oracle.py starts it once per method:

    .venv-quant/bin/python benchmarks/quant_oracle_llmc.py --method gptq --num-bits 4 --group-size 64 \
        --ids build/quant/calibration_ids.json --model ~/.cache/vllm-from-scratch/SmolLM2-135M-Instruct \
        --out build/quant/llmc_gptq_w4g64

and reads back from --out:
    a compressed-tensors checkpoint (config.json with quantization_config, model.safetensors with
    weight_packed / weight_scale / weight_zero_point per linear): what vLLM (and our engine) load
    fp_state.safetensors   AWQ only: the smoothed fp32 weights as oneshot left them, before
                           compression (the norms' weights and the linears' W diag(s)); the
                           checkpoint holds only the integers of the linears
    run.json               seconds, versions, the recipe
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def weight_args(num_bits: int, group_size: int, symmetric: bool) -> dict:
    args = dict(num_bits=num_bits, type="int", symmetric=symmetric, dynamic=False)
    if group_size:
        args.update(strategy="group", group_size=group_size)
    else:
        args.update(strategy="channel")
    return args


def make_recipe(method: str, num_bits: int, group_size: int, symmetric: bool, actorder: str | None,
                n_grid: int, duo_scaling: bool):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    quant = dict(config_groups={"group_0": {"targets": ["Linear"],
                                            "weights": weight_args(num_bits, group_size, symmetric)}},
                 ignore=["lm_head"])
    if method == "rtn":
        return [QuantizationModifier(**quant)]
    if method == "gptq":
        return [GPTQModifier(**quant, block_size=128, dampening_frac=0.01, actorder=actorder)]
    if method == "awq":
        return [AWQModifier(n_grid=n_grid, duo_scaling=duo_scaling), QuantizationModifier(**quant)]
    raise ValueError(method)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", required=True, choices=["rtn", "gptq", "awq"])
    ap.add_argument("--num-bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64, help="0: per channel")
    ap.add_argument("--asymmetric", action="store_true")
    ap.add_argument("--actorder", default="static", help="GPTQ: static | none")
    ap.add_argument("--n-grid", type=int, default=20)
    ap.add_argument("--no-duo-scaling", action="store_true")
    ap.add_argument("--ids", type=Path, required=True, help="JSON: [[token ids] per sample]")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import compressed_tensors
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.accelerator.is_available():
        # llmcompressor 0.14's AWQ pins its cached activations for faster host-to-device copies;
        # pinning needs an accelerator and raises on a CPU-only torch. There is nothing to copy to
        # on CPU: pinning is skipped, nothing else changes.
        from llmcompressor.pipelines.cache import IntermediatesCache
        IntermediatesCache.pin_memory = lambda self, *a, **k: None

    ids = json.loads(args.ids.read_text())
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    fp_names = set(model.state_dict())
    actorder = None if args.actorder == "none" else args.actorder
    recipe = make_recipe(args.method, args.num_bits, args.group_size, not args.asymmetric, actorder,
                         args.n_grid, not args.no_duo_scaling)
    start = time.perf_counter()
    # RTN reads no data (the datafree pipeline); GPTQ and AWQ run layer by layer ("sequential")
    oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=len(ids[0]), shuffle_calibration_samples=False,
            pipeline="datafree" if args.method == "rtn" else "sequential")
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    if args.method == "awq":
        state = model.state_dict()
        save_file({k: state[k].detach().float().contiguous() for k in fp_names
                   if k in state and "embed_tokens" not in k and k != "lm_head.weight"},
                  str(args.out / "fp_state.safetensors"))
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    (args.out / "run.json").write_text(json.dumps({
        "seconds": seconds, "samples": len(ids), "seq_len": len(ids[0]),
        "recipe": [repr(m) for m in recipe],
        "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__}}, indent=2))


if __name__ == "__main__":
    main()
