"""Ours vs llmcompressor: RTN, GPTQ and AWQ on SmolLM2-135M, the same scheme and the same
calibration tokens, compared layer by layer on held-out text.

    python -m benchmarks.quant_oracle                                  # every config below, ~40 min on 2 cores
    python -m benchmarks.quant_oracle --configs gptq_w4g64 --n-samples 16 --out-name quant_oracle_smoke

Calibration: 32 samples x 256 tokens of the stdlib docstrings (8192 tokens, 5x the widest input,
1536: fewer tokens than inputs leave H singular); AWQ, whose grid search runs each block 20 times
per mapping, the first 16 of them. Held out: 16 x 256 tokens of the held-out modules.

For each config, ours (10_quantization: reference.quantize_rtn, gptq.gptq_quantize_model,
awq.awq_quantize_model) runs in this process while llmcompressor's `oneshot` (GPTQModifier,
AWQModifier + QuantizationModifier, QuantizationModifier alone for RTN; its sequential pipeline)
runs in .venv-quant (benchmarks/quant_oracle_llmc.py) on the SAME token ids, handed over as a
datasets.Dataset. Its compressed-tensors checkpoints stay in build/quant/llmc_<config>/ (the engine
loads them too); ours are saved as build/quant/ours_<config>.pt.

The measure, per linear layer (210 of them: 30 layers x q k v o gate up down):

    err = || X W_q^T - X W^T ||^2 / || X W^T ||^2      on held-out tokens (modules never calibrated on)

X is what the layer receives in the fp32 model. AWQ changes the basis: its model computes
(X / s)(W s)^T, so its X comes from ITS smoothed fp32 model (for llmcompressor: the fp32 weights
oneshot leaves before compression), and W_q is the quantized W s; the reference output X W^T is the
same. Each side's quantized weights are read back the way an engine reads them: llmcompressor's
from its checkpoint (our packing.unpack_int32 of weight_packed, times weight_scale).

How close to expect: RTN is the same arithmetic (ratio 1 exactly); GPTQ with static act-order is
the same algorithm (ratios within a few % from float rounding carried through 30 layers); AWQ
scatters more, because its grid search is chaotic: a symmetric group's largest weight lands
exactly on +-7.5 steps (scale = max / 7.5), so a last-bit difference in mean|x| (a sum taken in
another order) can flip it between -8 and -7 and change which alpha wins, and a different alpha
moves error between the layers of one mapping (q/k worse, v better). Compare AWQ's mean error and
perplexity, not its worst layer.

SmolLM2's hidden size is 576 = 4.5 x 128: group 128 does not divide it (llmcompressor refuses such
layers too), so the 4-bit configs use group 64 (576 = 9 x 64, 1536 = 24 x 64), which Marlin and
vLLM's other WNA16 kernels support. Writes benchmarks/results/quant_oracle.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import write_result

ROOT = Path(__file__).resolve().parent.parent
QUANT_PYTHON = ROOT / ".venv-quant" / "bin" / "python"
BUILD = ROOT / "build" / "quant"

# name -> (method, num_bits, group_size (None: per channel), our options, llmcompressor's options)
CONFIGS = {
    "rtn_w4g64": ("rtn", 4, 64, {}, []),
    "gptq_w4g64": ("gptq", 4, 64, {"act_order": True}, ["--actorder", "static"]),
    "gptq_w8ch": ("gptq", 8, None, {"act_order": True}, ["--actorder", "static"]),
    "awq_w4g64": ("awq", 4, 64, {"duo_scaling": True, "n_grid": 20}, ["--n-grid", "20"]),
    # the paper's GPTQ: in order, each group's grid from its error-updated weights; llmcompressor
    # has no such mode (actorder=None still fixes every grid up front from the original weights)
    "gptq_w4g64_inorder": ("gptq", 4, 64, {"act_order": False}, ["--actorder", "none"]),
    # llmcompressor's W4A16_ASYM preset with groups of 32: a zero point per group as well as a scale
    "gptq_w4g32_asym": ("gptq", 4, 32, {"act_order": True}, ["--actorder", "static", "--asymmetric"]),
    # AWQ as AutoAWQ and llmcompressor's AWQ preset run it: a zero point per group
    "awq_w4g64_asym": ("awq", 4, 64, {"duo_scaling": True, "n_grid": 20}, ["--n-grid", "20", "--asymmetric"]),
    "awq_w4g32_asym": ("awq", 4, 32, {"duo_scaling": True, "n_grid": 20}, ["--n-grid", "20", "--asymmetric"]),
}


def is_symmetric(config: str) -> bool:
    return "--asymmetric" not in CONFIGS[config][4]


def load_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def linear_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]


# ------------------------------------------------------------------------------------ both sides

def run_theirs(config: str, ids_path: dict[str, Path], model_path: Path, log) -> Path:
    method, bits, group, _, extra = CONFIGS[config]
    ids_path = ids_path[method]
    out = BUILD / f"llmc_{config}"
    cmd = [str(QUANT_PYTHON), str(ROOT / "benchmarks" / "quant_oracle_llmc.py"), "--method", method,
           "--num-bits", str(bits), "--group-size", str(group or 0), "--ids", str(ids_path),
           "--model", str(model_path), "--out", str(out), *extra]
    with open(BUILD / f"llmc_{config}.log", "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    log(f"llmcompressor {config}: {json.loads((out / 'run.json').read_text())['seconds']:.0f} s")
    return out


def run_ours(config: str, model_path: Path, samples: torch.Tensor, log) -> dict:
    """{"weights": {name: dequantized W_q}, "smoothed": {param: fp32} (AWQ), "seconds", "quantized"}."""
    from quantization.awq import awq_quantize_model
    from quantization.gptq import gptq_quantize_model
    from quantization.reference import QuantScheme, quantize_rtn

    method, bits, group, options, _ = CONFIGS[config]
    scheme = QuantScheme(bits, is_symmetric(config), group)
    model = load_model(model_path)
    progress = lambda done, total: log(f"ours {config}: layer {done}/{total}") if done % 10 == 0 else None
    start = time.perf_counter()
    smoothed = {}
    if method == "rtn":
        quantized = {n: quantize_rtn(model.get_submodule(n).weight.detach(), scheme) for n in linear_names(model)}
    elif method == "gptq":
        quantized = gptq_quantize_model(model, samples, scheme, progress=progress, **options)
    else:
        result = awq_quantize_model(model, samples, scheme, progress=progress, **options)
        quantized, smoothed = result.quantized, result.smoothed
    seconds = time.perf_counter() - start
    log(f"ours {config}: {seconds:.0f} s")
    torch.save({"scheme": scheme, "smoothed": smoothed,
                "quantized": {n: (q.q, q.scale, q.zero_point) for n, q in quantized.items()}},
               BUILD / f"ours_{config}.pt")
    return {"weights": {n: q.dequantize().float() for n, q in quantized.items()}, "smoothed": smoothed,
            "seconds": seconds}


def read_theirs(out: Path, config: str) -> dict:
    """Their checkpoint read as an engine reads it: unpack, dequantize (our reference code)."""
    from safetensors.torch import load_file

    from quantization.packing import unpack_int32
    from quantization.reference import QuantScheme, dequantize

    _, bits, group, _, _ = CONFIGS[config]
    args = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (args["num_bits"], args["group_size"], args["symmetric"]) == (bits, group, is_symmetric(config)), args
    scheme = QuantScheme(bits, is_symmetric(config), group)
    tensors = load_file(str(out / "model.safetensors"))
    weights = {}
    for key in tensors:
        if key.endswith(".weight_packed"):
            name = key[: -len(".weight_packed")]
            q = unpack_int32(tensors[key], bits)                      # [out, in] int8
            scale = tensors[f"{name}.weight_scale"].float()          # [out, groups]
            zero = (torch.zeros(scale.shape, dtype=torch.int8) if scheme.symmetric   # packed along the outputs
                    else unpack_int32(tensors[f"{name}.weight_zero_point"], bits, dim=0))
            weights[name] = dequantize(q, scale, zero, scheme)
    smoothed = load_file(str(out / "fp_state.safetensors")) if (out / "fp_state.safetensors").exists() else {}
    run = json.loads((out / "run.json").read_text())
    return {"weights": weights, "smoothed": smoothed, "seconds": run["seconds"], "versions": run["versions"]}


# ------------------------------------------------------------------------------------ measuring

@torch.no_grad()
def layer_errors(model, candidates: dict[str, dict[str, torch.Tensor]], held: torch.Tensor,
                 batch_size: int = 8) -> dict[str, dict[str, float]]:
    """{label: {linear: ||X W_q^T - X W^T||^2 / ||X W^T||^2}} for every label's W_q, X the linear's
    inputs in `model` (its own fp32 weights W) on the held-out ids."""
    err = {label: {} for label in candidates}
    norm = {}

    def hook(module, args, name):
        x = args[0].reshape(-1, args[0].shape[-1])                    # [tokens, in]
        ref = x @ module.weight.t()                                   # [tokens, out]
        norm[name] = norm.get(name, 0.0) + ref.pow(2).sum().item()
        for label, weights in candidates.items():
            err[label][name] = err[label].get(name, 0.0) + (x @ weights[name].t() - ref).pow(2).sum().item()

    names = next(iter(candidates.values())).keys()
    handles = [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: hook(m, a, n)) for n in names]
    for batch in held.split(batch_size):
        model.model(input_ids=batch, use_cache=False)                 # no lm_head: not measured
    for h in handles:
        h.remove()
    return {label: {n: e / norm[n] for n, e in errs.items()} for label, errs in err.items()}


@torch.no_grad()
def quantized_perplexity(model, weights: dict[str, torch.Tensor], held: torch.Tensor) -> float:
    """Held-out perplexity of `model` with every measured linear replaced by its W_q (restored after)."""
    from quantization.calibration import perplexity
    saved = {n: model.get_submodule(n).weight.detach().clone() for n in weights}
    for n, w in weights.items():
        model.get_submodule(n).weight.copy_(w)
    try:
        return perplexity(lambda b: model(input_ids=b, use_cache=False).logits, held)
    finally:
        for n, w in saved.items():
            model.get_submodule(n).weight.copy_(w)


def smoothed_model(model_path: Path, params: dict[str, torch.Tensor]):
    model = load_model(model_path)
    state = model.state_dict()
    missing = [k for k in params if k not in state]
    assert not missing, missing[:3]
    model.load_state_dict({**state, **params})
    return model


# ------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--n-samples", type=int, default=32, help="calibration samples (RTN ignores them)")
    ap.add_argument("--awq-samples", type=int, default=16, help="AWQ: the first this many of them")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--held-out", type=int, default=16, help="held-out samples of seq-len tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-perplexity", action="store_true")
    ap.add_argument("--out-name", default="quant_oracle")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}")
    if not QUANT_PYTHON.exists():
        print(f"quant_oracle skipped: no {QUANT_PYTHON} (llmcompressor's venv)", flush=True)
        return {"skipped": "no .venv-quant"}

    from transformers import AutoTokenizer

    from mini_vllm.default_model import default_model_path
    from quantization import calibration

    torch.set_num_threads(1)                  # the peer runs beside us with one thread too
    model_path = Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    samples = calibration.calibration_samples(tokenizer, args.n_samples, args.seq_len, args.seed)
    held = calibration.held_out_samples(tokenizer, args.held_out, args.seq_len, args.seed)
    BUILD.mkdir(parents=True, exist_ok=True)
    ids_path = {"rtn": BUILD / "calibration_ids.json", "gptq": BUILD / "calibration_ids.json",
                "awq": BUILD / "calibration_ids_awq.json"}
    ids_path["gptq"].write_text(json.dumps(samples.tolist()))
    ids_path["awq"].write_text(json.dumps(samples[: args.awq_samples].tolist()))
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    theirs, failures = {}, {}

    def peer():                                # llmcompressor's runs, one after another, beside ours
        for c in configs:
            try:
                theirs[c] = run_theirs(c, ids_path, model_path, log)
            except subprocess.CalledProcessError as e:
                failures[c] = f"exit {e.returncode}, see build/quant/llmc_{c}.log"
                log(f"llmcompressor {c} FAILED: {failures[c]}")

    thread = threading.Thread(target=peer)
    thread.start()
    ours = {c: run_ours(c, model_path, samples[: args.awq_samples] if CONFIGS[c][0] == "awq" else samples, log)
            for c in configs}
    thread.join()
    if failures:
        raise SystemExit(f"llmcompressor failed: {failures}")
    theirs = {c: read_theirs(theirs[c], c) for c in configs}

    log("measuring on held-out text")
    base = load_model(model_path)
    errors, perplexities = {}, {}
    if not args.no_perplexity:
        perplexities["fp32"] = quantized_perplexity(base, {}, held)
    for c in configs:
        sides = {"ours": ours[c], "llmcompressor": theirs[c]}
        for side, result in sides.items():
            model = smoothed_model(model_path, result["smoothed"]) if result["smoothed"] else base
            errors[(c, side)] = layer_errors(model, {side: result["weights"]}, held)[side]
            if not args.no_perplexity:
                perplexities[f"{c}/{side}"] = quantized_perplexity(model, result["weights"], held)
        log(f"{c}: measured")

    rows, summary = [], {}
    for c in configs:
        ratios = []
        for name in linear_names(base):
            a, b = errors[(c, "ours")][name], errors[(c, "llmcompressor")][name]
            rows.append({"config": c, "layer": name, "ours": a, "llmcompressor": b, "ratio": a / b})
            ratios.append((a / b, name))
        worst = max(ratios)
        summary[c] = {
            "median_ratio": statistics.median(r for r, _ in ratios), "worst_ratio": worst[0], "worst_layer": worst[1],
            "best_ratio": min(ratios)[0], "layers_within_10pct": sum(r <= 1.10 for r, _ in ratios) / len(ratios),
            "mean_error_ours": statistics.fmean(errors[(c, "ours")].values()),
            "mean_error_llmcompressor": statistics.fmean(errors[(c, "llmcompressor")].values()),
            "seconds_ours": ours[c]["seconds"], "seconds_llmcompressor": theirs[c]["seconds"],
            **({"perplexity_ours": perplexities[f"{c}/ours"],
                "perplexity_llmcompressor": perplexities[f"{c}/llmcompressor"],
                "perplexity_ours_vs_fp32": perplexities[f"{c}/ours"] / perplexities["fp32"],
                "perplexity_llmcompressor_vs_fp32": perplexities[f"{c}/llmcompressor"] / perplexities["fp32"]}
               if perplexities else {}),
        }
        log(f"{c}: ours/llmcompressor per-layer error, median {summary[c]['median_ratio']:.3f}, "
            f"worst {worst[0]:.3f} ({worst[1]}), within 10%: {summary[c]['layers_within_10pct']:.1%}")
    overall = statistics.median(r["ratio"] for r in rows)
    workload = {"model": "SmolLM2-135M-Instruct (fp32)", "calibration": "stdlib docstrings (quantization.calibration)",
                "n_samples": args.n_samples, "awq_samples": args.awq_samples, "seq_len": args.seq_len,
                "held_out_samples": args.held_out,
                "seed": args.seed, "configs": {c: [*CONFIGS[c][:4], "symmetric" if is_symmetric(c) else "asymmetric"]
                                         for c in configs},
                "threads": "1 each (ours in-process, llmcompressor in a subprocess, side by side)",
                "corpus": calibration.corpus_statistics()}
    peer_versions = next(iter(theirs.values()))["versions"]
    path = write_result(args.out_name, workload, rows, peer=peer_versions, summary=summary,
                        perplexity=perplexities, overall_median_ratio=overall)
    log(f"overall median ratio {overall:.3f}; wrote {path}")
    return {"summary": summary, "overall_median_ratio": overall}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
