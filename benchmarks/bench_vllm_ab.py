"""Ours vs real vLLM (the CPU build), interleaved: ours, vLLM, ours, vLLM, ..., ours.

    python -m benchmarks.vllm_peer --setup          # once: real vLLM in .venv-vllm/
    python -m benchmarks.bench_vllm_ab              # greedy, both cores bound, 2 rounds: ~15 min on 2 cores
    python -m benchmarks.bench_vllm_ab --mode sampled --config default --rounds 3

bench_engine times each vLLM configuration once, beside one run of ours. On a shared machine whose
speed drifts by ~10% over minutes, one pair cannot tell 0.95x from 1.05x. Here every vLLM run sits
between two runs of ours, and its ratio is taken against the mean of those two neighbours; the median
over rounds is the result. Same workload and settings as bench_engine (SmolLM2-135M fp32, 64 requests,
prompts 32-512 tokens of real text, outputs 16-256, ignore_eos; 4096 batched tokens, 2 GiB of KV),
greedy tokens compared. Writes benchmarks/results/engine_vllm_ab_cpu.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks import vllm_peer
from benchmarks.bench_engine import (MAX_NUM_BATCHED_TOKENS, NUM_REQUESTS, OUTPUT_LEN, PROMPT_LEN, SAMPLED, agreement,
                                    engine_args, make_workload, run_ours, run_vllm)
from benchmarks.common import RESULTS_DIR, write_result

KV_CACHE_GIB = 2                    # ours: the CPU default; vLLM: VLLM_CPU_KVCACHE_SPACE


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="vLLM runs (each between two of ours)")
    ap.add_argument("--config", default="both cores", choices=list(vllm_peer.CONFIGS))
    ap.add_argument("--mode", default="greedy", choices=["greedy", "sampled"])
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    reason = vllm_peer.unavailable_reason()
    if reason:
        print(f"bench_vllm_ab skipped: {reason}", flush=True)
        return dict(skipped=reason)

    from transformers import AutoTokenizer

    from mini_vllm import LLM, default_model_path

    model_dir = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = make_workload(tokenizer, NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, 0)
    warmup = make_workload(tokenizer, 4, (16, 64), (4, 8), 1)
    total_out = sum(n for _, n in workload)
    llm = LLM(str(model_dir), **engine_args(NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, MAX_NUM_BATCHED_TOKENS,
                                            kv_cache_memory=KV_CACHE_GIB << 30))
    sampled = args.mode == "sampled"
    run_ours(llm, warmup, sampled=sampled)

    rows, tokens = [], {}

    def record(side: str, seconds: float, toks: list[list[int]]) -> float:
        tok_s = total_out / seconds
        rows.append(dict(name=side, mode=args.mode, seconds=round(seconds, 3), output_tokens=total_out,
                         output_tokens_per_s=round(tok_s, 2), order=len(rows)))
        tokens.setdefault(side, toks)
        print(f"{side:<8} {seconds:8.1f} s  {tok_s:8.1f} output tok/s", flush=True)
        return tok_s

    ours = [record("ours", *run_ours(llm, workload, sampled=sampled))]
    ratios = []
    for _ in range(args.rounds):
        result = run_vllm(model_dir, workload, warmup, args.config, KV_CACHE_GIB, MAX_NUM_BATCHED_TOKENS,
                          modes=(args.mode,))
        run = result["runs"][0]
        theirs = record("vLLM", run["seconds"], run["tokens"])
        ours.append(record("ours", *run_ours(llm, workload, sampled=sampled)))
        ratios.append(round((ours[-2] + ours[-1]) / 2 / theirs, 3))       # ours (mean of the neighbours) / vLLM
    summary = dict(ratio_ours_vs_vllm_per_round=ratios, ratio_ours_vs_vllm_median=statistics.median(ratios),
                   vllm=result["vllm"], vllm_env=result["env"])
    if not sampled:
        summary["greedy_token_agreement"] = agreement(tokens["ours"], tokens["vLLM"])
    print(summary, flush=True)
    workload_info = dict(model=Path(model_dir).name, dtype="float32", device="cpu", num_requests=NUM_REQUESTS,
                         prompt_len=list(PROMPT_LEN), output_len=list(OUTPUT_LEN), ignore_eos=True, mode=args.mode,
                         sampled_params=SAMPLED if sampled else None, vllm_config=args.config,
                         command=" ".join(["python -m benchmarks.bench_vllm_ab", *(argv if argv is not None else sys.argv[1:])]),
                         summary=summary)
    path = write_result("engine_vllm_ab_cpu", workload_info, rows, args.out_dir)
    return dict(summary=summary, path=path)


if __name__ == "__main__":
    main()
