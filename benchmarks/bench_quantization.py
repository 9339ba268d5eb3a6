"""Quantized weights in the engine: decode throughput of fp32 / int8 / int4 weights side by side, and
the same checkpoints on real vLLM — in one run, on this machine.

    python -m benchmarks.bench_quantization               # SmolLM2-135M, batch 1 and 64, ours + vLLM 0.32 CPU
    python -m benchmarks.bench_quantization --no-vllm     # without the real-vLLM peer (.venv-vllm/)
    python -m benchmarks.bench_quantization --smoke       # tiny random model, seconds (CI)

The checkpoints are made here from the float SmolLM2 with round-to-nearest (`quantization.quantize`,
compressed-tensors format): W8A16 (int8 per channel), W4A16 (int4, groups of 64: 576 = 9 x 64), W8A8
(int8 weights and per-token int8 activations); "+ lm_head": the same with the lm_head quantized too
(`--lm-head`: SmolLM2's tied embedding untied, its 28.3 M weights the largest matrix a step reads);
"W4A16 + int8 lm_head": int4 decoder linears, an int8 per-channel lm_head (`--lm-head-scheme W8A16`). Workloads: "batch 1" is one request of a 32-token
prompt decoding 64 greedy tokens; "batch 64" is 64 such requests at once, 32 tokens each. Sides:

    ours, fp32 activations    float / W8A16 / W4A16 / W8A8 weights, W8A16 / W4A16 + lm_head, W4A16 +
                              int8 lm_head (the C++ kernels read the integers)
    ours, bf16 activations    float / W4A16 / W4A16 + lm_head / W8A8: what vLLM's CPU kernels accept
                              (its CPU WNA16 kernels take int4 only: "uint8b128 not supported", so
                              no side with int8 weight-only layers runs there)
    vLLM 0.32 CPU, bf16       the same four checkpoints, both cores (its WNA16 and int8 GEMMs
                              refuse fp32 activations: "cpu_gemm_wna16 not implemented for 'Float'")

Each side runs `--rounds` times after a warm-up, in one engine (a process of its own for vLLM); its
figure is its best round (a shared machine only ever slows a run down). Reported per side: output tokens per second over the whole
generate (short prompts: decode dominates), the ratio to the float side of the same activations, and
the greedy tokens' agreement with the float side (ours) or with ours on the same checkpoint (vLLM).
Each weight-only checkpoint's held-out perplexity (16 windows of 256 tokens of stdlib modules no
calibration reads) is HF transformers' on its dequantized copy (`save_decompressed`): what the
rounding costs, measured by code nobody here wrote.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from benchmarks import vllm_peer
from benchmarks.bench_engine import make_workload, tiny_model_dir
from benchmarks.common import RESULTS_DIR, prefix_agreement, try_plot, write_result

# side -> (scheme, group size, the lm_head's: None in floats, "same" scheme, or a scheme of its own)
SCHEMES = {"W8A16": ("W8A16", None, None), "W4A16": ("W4A16", 64, None), "W8A8": ("W8A8", None, None),
           "W8A16 + lm_head": ("W8A16", None, "same"), "W4A16 + lm_head": ("W4A16", 64, "same"),
           "W4A16 + int8 lm_head": ("W4A16", 64, "W8A16")}
FP32_SIDES = ["float", "W8A16", "W4A16", "W8A16 + lm_head", "W4A16 + lm_head", "W4A16 + int8 lm_head", "W8A8"]
BF16_SIDES = ["float", "W4A16", "W4A16 + lm_head", "W8A8"]
WEIGHT_ONLY = ["float", "W8A16", "W4A16", "W8A16 + lm_head", "W4A16 + lm_head", "W4A16 + int8 lm_head"]


def make_checkpoints(model_dir: Path, out: Path) -> dict[str, Path]:
    """{side: checkpoint dir}: the float model and its RTN copies."""
    from quantization.quantize import main as quantize

    dirs = {"float": Path(model_dir)}
    for side, (scheme, group, lm_head) in SCHEMES.items():
        dirs[side] = out / side.replace(" + ", "_").replace(" ", "_")
        head = {None: [], "same": ["--lm-head"]}.get(lm_head, ["--lm-head-scheme", lm_head])
        quantize(["--model", str(model_dir), "--out", str(dirs[side]), "--scheme", scheme]
                 + (["--group-size", str(group)] if group else []) + head)
    return dirs


def held_out_perplexity(checkpoint: Path, quantized: bool, work_dir: Path, smoke: bool) -> float:
    """HF transformers' perplexity on held-out text of the checkpoint's dequantized float copy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantization import calibration
    from quantization.checkpoint import save_decompressed

    path = save_decompressed(checkpoint, work_dir / f"{checkpoint.name}_dequantized") if quantized else checkpoint
    held = calibration.held_out_samples(AutoTokenizer.from_pretrained(path), 2 if smoke else 16, 64 if smoke else 256)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return round(calibration.perplexity(lambda b: model(input_ids=b, use_cache=False).logits, held), 3)


def workloads(tokenizer, smoke: bool) -> dict[str, list[tuple[list[int], int]]]:
    prompt, out1, out64 = (8, 8, 4) if smoke else (32, 64, 32)
    one = make_workload(tokenizer, 1, (prompt, prompt), (out1, out1), seed=1)
    many = make_workload(tokenizer, 8 if smoke else 64, (prompt, prompt), (out64, out64), seed=2)
    return {"batch 1": one, "batch 64": many}


def run_ours(model_dir: Path, dtype: str, work: dict, rounds: int) -> dict:
    """{workload: (best seconds, tokens)} for one engine on every workload, `rounds` times each."""
    from mini_vllm import LLM, SamplingParams

    longest = max(len(p) + n for w in work.values() for p, n in w)
    llm = LLM(str(model_dir), dtype=dtype, max_model_len=max(longest, 128), max_num_seqs=64,
              max_num_batched_tokens=2048, kv_cache_memory=1 << 30)
    out = {}
    try:
        for name, w in work.items():
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for _, n in w]
            llm.generate([p for p, _ in w], params, use_tqdm=False)                      # warm-up
            best = None
            for _ in range(rounds):
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                outputs = llm.generate([p for p, _ in w], params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                tokens = [o.outputs[0].token_ids for o in outputs]
                best = (seconds, tokens) if best is None or seconds < best[0] else best
            out[name] = best
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return out


def run_vllm(model_dir: Path, dtype: str, work: dict, rounds: int) -> dict:
    out = {}
    for name, w in work.items():
        workload = dict(prompts=[p for p, _ in w], max_tokens=[n for _, n in w], modes=["greedy"] * rounds,
                        warmup_prompts=[p for p, _ in w], warmup_max_tokens=[n for _, n in w], dtype=dtype)
        result = vllm_peer.call(model_dir, workload, "both cores", kvcache_gib=1)
        best = min(result["runs"], key=lambda r: r["seconds"])
        out[name] = (best["seconds"], best["tokens"])
        out["version"] = result["vllm"]
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return round(prefix_agreement(a, b), 4)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=4, help="best of this many timed runs per side (the machine drifts)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, CI-sized")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    if args.smoke:
        model = tiny_model_dir(root)
    else:
        from mini_vllm import default_model_path
        model = args.model or default_model_path()
    work = workloads(AutoTokenizer.from_pretrained(model), args.smoke)
    dirs = make_checkpoints(model, root)
    use_vllm = not (args.no_vllm or args.smoke) and vllm_peer.unavailable_reason() is None
    results: dict[tuple[str, str, str], tuple[float, list]] = {}
    versions = {}
    run_ours(dirs["float"], "float32", {"warm-up": work["batch 1"]}, 1)   # the first engine of a process runs slower
    for side in FP32_SIDES:
        for w, r in run_ours(dirs[side], "float32", work, args.rounds).items():
            results[("ours", "float32", side, w)] = r
    for side in BF16_SIDES:
        for w, r in run_ours(dirs[side], "bfloat16", work, args.rounds).items():
            results[("ours", "bfloat16", side, w)] = r
        if use_vllm:
            got = run_vllm(dirs[side], "bfloat16", work, args.rounds)
            versions["vllm"] = got.pop("version")
            for w, r in got.items():
                results[("vLLM 0.32 CPU", "bfloat16", side, w)] = r
    perplexities = {side: held_out_perplexity(dirs[side], side != "float", root, args.smoke) for side in WEIGHT_ONLY}
    print("held-out perplexity", perplexities, flush=True)
    tmp.cleanup()
    rows = []
    for (who, dtype, side, w), (seconds, tokens) in results.items():
        output_tokens = sum(map(len, tokens))
        base = results[(who, dtype, "float", w)]
        ours_same = results.get(("ours", dtype, side, w))
        rows.append(dict(name=f"{who}, {dtype}, {side}", who=who, dtype=dtype, weights=side, workload=w,
                         seconds=round(seconds, 3), output_tokens_per_s=round(output_tokens / seconds, 2),
                         vs_float=round(base[0] / seconds, 3),
                         greedy_agreement_with_float=agreement(tokens, base[1]),
                         **({"held_out_perplexity": perplexities[side]} if side in perplexities else {}),
                         **({"vs_ours_same_checkpoint": round(ours_same[0] / seconds, 3),
                             "greedy_agreement_with_ours": agreement(tokens, ours_same[1])}
                            if who != "ours" else {})))
        print(rows[-1], flush=True)
    add_peer_ratios(rows)
    path = write_result("quantization_engine", dict(
        model="tiny random Llama" if args.smoke else "SmolLM2-135M-Instruct",
        quantization="round-to-nearest, compressed-tensors: W8A16 per channel, W4A16 groups of 64, W8A8 dynamic per "
                     "token; '+ lm_head': the lm_head quantized too (untied); '+ int8 lm_head': W8A16 per channel",
        perplexity="HF transformers on each weight-only checkpoint's dequantized copy, held-out stdlib text, "
                   + ("2 x 64 tokens" if args.smoke else "16 x 256 tokens"),
        workloads={w: f"{len(x)} request(s), {len(x[0][0])}-token prompts, {x[0][1]} greedy tokens each (ignore_eos)"
                   for w, x in work.items()},
        rounds=args.rounds, vllm=versions.get("vllm"), command="python -m benchmarks.bench_quantization"
        + (" --smoke" if args.smoke else "")), rows, args.out_dir)
    try_plot(plot, rows, path.with_suffix(".png"))
    return dict(rows=rows, path=path)


def add_peer_ratios(rows: list[dict]) -> None:
    """Each of our rows that vLLM also ran gets `vs_vllm_same_checkpoint`: our tok/s ÷ vLLM's."""
    vllm = {(r["dtype"], r["weights"], r["workload"]): r for r in rows if r["who"] != "ours"}
    for r in rows:
        peer = vllm.get((r["dtype"], r["weights"], r["workload"]))
        if r["who"] == "ours" and peer is not None:
            r["vs_vllm_same_checkpoint"] = round(r["output_tokens_per_s"] / peer["output_tokens_per_s"], 3)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads_ = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads_), figsize=(6 * len(workloads_), 4.5))
    for ax, w in zip(axes if len(workloads_) > 1 else [axes], workloads_):
        sel = [r for r in rows if r["workload"] == w]
        ax.barh([r["name"] for r in sel], [r["output_tokens_per_s"] for r in sel],
                color=["tab:green" if r["who"] == "ours" else "tab:blue" for r in sel])
        ax.set_title(w)
        ax.set_xlabel("output tokens / s")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
