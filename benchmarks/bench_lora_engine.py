"""Multi-LoRA serving throughput: many adapters in one batch vs the base model, vs one adapter at a time,
vs real vLLM — side by side, in one run, on this machine.

    python -m benchmarks.bench_lora_engine                 # SmolLM2-135M fp32, 64 requests over 8 adapters
    python -m benchmarks.bench_lora_engine --no-vllm       # without the real-vLLM peer (.venv-vllm/)
    python -m benchmarks.bench_lora_engine --smoke         # tiny random model, seconds (CI)

The workload: 64 requests (prompts are windows of the Python documentation, `--input-len` tokens),
`--output-len` greedy tokens each (ignore_eos), spread uniformly over 8 PEFT adapters made here (rank
8 on every linear layer, B not zero: PEFT's init_lora_weights=False), all submitted at once. Sides:

    ours, base model              the same requests without adapters (the engine without enable_lora)
    ours, 8 adapters mixed        LLM(enable_lora=True, max_loras=8): every batch mixes all eight
    ours, one adapter at a time   the same engine with max_loras=1: the scheduler runs one adapter per step
    PEFT, one adapter at a time   HF generate on a PeftModel, per adapter its 8 requests as one batch
                                  (set_adapter between them): how PEFT serves adapters
    vLLM 0.32 CPU, 8 adapters     real vLLM's enable_lora, max_loras=8 (punica_cpu), same requests and
    vLLM 0.32 CPU, base model     adapters, both cores; and the same engine without adapters

Each side runs `--rounds` times, interleaved; a side's figure is its best round (the machine is
shared: noise only ever slows a run down). Greedy tokens are compared between sides that run the
same model (ours vs PEFT and vs vLLM, per request).
"""
from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import vllm_peer
from benchmarks.bench_engine import make_workload, tiny_model_dir
from benchmarks.common import RESULTS_DIR, try_plot, with_throwaway_engine, write_result

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> tuple[object, list[Path]]:
    """`count` PEFT adapters on the model (random A and B), saved; returns (the PeftModel, directories)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft_model = None
    for i in range(count):
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        if peft_model is None:
            peft_model = get_peft_model(hf, config, adapter_name=f"adapter-{i}")
        else:
            peft_model.add_adapter(f"adapter-{i}", config)
    dirs = []
    for i in range(count):
        peft_model.save_pretrained(out, selected_adapters=[f"adapter-{i}"])
        dirs.append(out / f"adapter-{i}")
    return peft_model.eval(), dirs


def run_ours(llm, workload, adapter_of: list[int | None], requests) -> tuple[float, list[list[int]]]:
    from mini_vllm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for _, n in workload]
    assert llm.reset_prefix_cache(), "requests still hold KV blocks"
    loras = [None if a is None else requests[a] for a in adapter_of]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], params, use_tqdm=False,
                        lora_request=loras if any(loras) else None)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def run_peft(peft_model, workload, adapter_of: list[int], pad_id: int) -> tuple[float, list[list[int]]]:
    """PEFT's way: one adapter at a time, its requests as one left-padded batch through HF generate."""
    tokens: list[list[int] | None] = [None] * len(workload)
    t0 = time.perf_counter()
    for adapter in sorted(set(adapter_of)):
        rows = [i for i, a in enumerate(adapter_of) if a == adapter]
        peft_model.set_adapter(f"adapter-{adapter}")
        width = max(len(workload[i][0]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, i in enumerate(rows):
            prompt = workload[i][0]
            ids[j, width - len(prompt):] = torch.tensor(prompt)
            mask[j, width - len(prompt):] = 1
        new = max(workload[i][1] for i in rows)
        out = peft_model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=pad_id, eos_token_id=None)
        for j, i in enumerate(rows):
            tokens[i] = out[j, width:width + workload[i][1]].tolist()
    return time.perf_counter() - t0, tokens


def run_vllm(model_dir: Path, workload, adapter_of, dirs, max_loras: int, rank: int, rounds: int) -> dict:
    reason = vllm_peer.unavailable_reason()
    if reason:
        return {"skipped": reason}
    job = dict(prompts=[p for p, _ in workload], max_tokens=[n for _, n in workload],
               lora=dict(adapters=[str(d) for d in dirs], request_adapter=adapter_of, max_loras=max_loras,
                         max_lora_rank=rank, rounds=rounds))
    return vllm_peer.call(model_dir, job, "both cores", kvcache_gib=2)


def agreement(a, b) -> float:
    return round(sum(x == y for x, y in zip(a, b)) / len(a), 3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 8 requests, no peers")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from mini_vllm import LLM, LoRARequest, default_model_path

    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    if args.smoke:
        args.requests, args.adapters, args.input_len, args.output_len, args.rounds = 8, 2, 16, 4, 1
        args.no_vllm = args.no_peft = True
        model_dir = tiny_model_dir(root)
    else:
        model_dir = Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = make_workload(tokenizer, args.requests, (args.input_len, args.input_len),
                             (args.output_len, args.output_len))
    adapter_of = [i % args.adapters for i in range(args.requests)]      # uniform, interleaved
    random.Random(0).shuffle(adapter_of)
    peft_model, dirs = make_adapters(model_dir, root / "adapters", args.adapters, args.rank)
    requests = [LoRARequest(f"adapter-{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
    common = dict(dtype="float32", max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.requests,
                  max_num_batched_tokens=4096)
    if args.smoke:          # the default 2 GiB cache, zeroed for each of four engines, was most of a smoke run
        common["kv_cache_memory"] = 64 << 20
    lora = dict(enable_lora=True, max_lora_rank=max(8, args.rank), max_cpu_loras=args.adapters)
    sides = {
        "ours, base model": (dict(common), [None] * args.requests),
        f"ours, {args.adapters} adapters mixed": (dict(common, **lora, max_loras=args.adapters), adapter_of),
        "ours, one adapter at a time": (dict(common, **lora, max_loras=1), adapter_of),
    }
    with_throwaway_engine(lambda: LLM(str(model_dir), **common),          # no side is the first engine
                          lambda llm: run_ours(llm, workload[:8], [None] * 8, requests))
    engines = {name: LLM(str(model_dir), **kwargs) for name, (kwargs, _) in sides.items()}
    for name, (_, adapters) in sides.items():                           # warm-up: adapters loaded, first steps
        run_ours(engines[name], workload[:4], adapters[:4], requests)
    rows, tokens = [], {}
    for round_index in range(args.rounds):
        for name, (_, adapters) in sides.items():
            seconds, toks = run_ours(engines[name], workload, adapters, requests)
            tokens[name] = toks
            rows.append(dict(name=name, round=round_index, seconds=round(seconds, 3),
                             output_tokens_per_s=round(sum(map(len, toks)) / seconds, 2)))
            print(rows[-1], flush=True)
        if not args.no_peft:
            seconds, toks = run_peft(peft_model, workload, adapter_of, tokenizer.pad_token_id or 0)
            tokens["PEFT, one adapter at a time"] = toks
            rows.append(dict(name="PEFT, one adapter at a time", round=round_index, seconds=round(seconds, 3),
                             output_tokens_per_s=round(sum(map(len, toks)) / seconds, 2)))
            print(rows[-1], flush=True)
    for llm in engines.values():
        llm.shutdown()
    del engines, peft_model
    gc.collect()
    mixed = f"ours, {args.adapters} adapters mixed"
    vllm = {"skipped": "--no-vllm"} if args.no_vllm else run_vllm(model_dir, workload, adapter_of, dirs, args.adapters,
                                                                   args.rank, args.rounds)
    names = {"lora": f"vLLM 0.32 CPU, {args.adapters} adapters", "base": "vLLM 0.32 CPU, base model"}
    for run in vllm.get("runs", []):
        rows.append(dict(name=names[run["mode"]], round=run["round"], seconds=round(run["seconds"], 3),
                         output_tokens_per_s=round(sum(map(len, run["tokens"])) / run["seconds"], 2)))
        tokens[names[run["mode"]]] = run["tokens"]
    best = {r["name"]: max(x["output_tokens_per_s"] for x in rows if x["name"] == r["name"]) for r in rows}

    def ratio(a: str, b: str) -> float | None:
        return round(best[a] / best[b], 3) if a in best and b in best else None

    summary = dict(
        best_output_tokens_per_s=best,
        mixed_over_base=ratio(mixed, "ours, base model"),
        mixed_over_one_at_a_time=ratio(mixed, "ours, one adapter at a time"),
        mixed_over_peft=ratio(mixed, "PEFT, one adapter at a time"),
        mixed_over_vllm=ratio(mixed, names["lora"]),
        base_over_vllm_base=ratio("ours, base model", names["base"]),
        vllm_lora_over_vllm_base=ratio(names["lora"], names["base"]),
        same_greedy_tokens={other: agreement(tokens[mixed], tokens[other]) for other in
                            ("ours, one adapter at a time", "PEFT, one adapter at a time", names["lora"])
                            if other in tokens},
        vllm=vllm.get("vllm") or vllm.get("skipped"), vllm_env=vllm.get("env"))
    print(summary)
    workload_info = dict(model=str(model_dir.name), dtype="float32", device="cpu", requests=args.requests,
                         adapters=args.adapters, rank=args.rank, targets=TARGETS, input_len=args.input_len,
                         output_len=args.output_len, rounds=args.rounds, greedy=True, ignore_eos=True,
                         prompts="windows of pydoc_data.topics (make_workload)",
                         figure="best round per side (tokens/s)",
                         command="python -m benchmarks.bench_lora_engine" + (" --smoke" if args.smoke else ""))
    path = write_result("lora_engine_smoke" if args.smoke else "lora_engine", workload_info, rows, args.out_dir,
                        summary=summary)
    if not args.smoke:
        try_plot(plot, rows, path.with_suffix(".png"))
    tmp.cleanup()
    return dict(rows=rows, summary=summary, path=path)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in rows))
    values = [max(r["output_tokens_per_s"] for r in rows if r["name"] == n) for n in names]
    fig, ax = plt.subplots(figsize=(8.5, 0.9 + 0.5 * len(names)))
    colors = ["tab:green" if n.startswith("ours") else "tab:blue" if n.startswith("vLLM") else "tab:gray"
              for n in names]
    ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s (best round)")
    ax.set_title("Multi-LoRA serving, SmolLM2-135M fp32, CPU")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.0f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
