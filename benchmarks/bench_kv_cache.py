"""The 8-bit KV cache in the engine: blocks per GiB and throughput on a KV-heavy workload, float vs
int8 / fp8 K/V side by side, and real vLLM's fp8 cache on the same workload — in one run, here.

    python -m benchmarks.bench_kv_cache               # SmolLM2-135M, fp32 and bf16, ours + vLLM 0.32 CPU
    python -m benchmarks.bench_kv_cache --no-vllm     # without the real-vLLM peer (.venv-vllm/)
    python -m benchmarks.bench_kv_cache --smoke       # tiny random model, seconds (CI)

Workload: 16 requests of 1,024-token prompts (windows of the repo's text corpus), 64 greedy tokens
each (ignore_eos): every decode step reads 16 contexts of ~1k tokens, so K/V are a large share of
its bytes. Sides: kv_cache_dtype "auto" (the model's dtype), "int8_per_token_head", "fp8" (per-tensor
scales 1.0, as a checkpoint without scales gets), in fp32 and bf16; vLLM 0.32 CPU in bf16 with "auto"
and "fp8" (its CPU backend stores fp8 K/V on AVX-512 / AMX). Each side: one warm-up generate, then
its best of `--rounds` (a shared machine only slows a run down); output tok/s over the whole
generate; blocks the same 2 GiB holds; greedy agreement with the same dtype's float cache.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from benchmarks import vllm_peer
from benchmarks.bench_engine import make_workload, tiny_model_dir
from benchmarks.common import prefix_agreement, write_result

KV_DTYPES = ["auto", "int8_per_token_head", "fp8"]
KV_GIB = 2            # the memory each engine's cache gets (--smoke: 1/32 of it; a fresh 2 GiB per engine
                      # is most of a smoke run's time)


def run_ours(model: str, dtype: str, kv: str, prompts, max_tokens: int, rounds: int, kv_gib: float = KV_GIB) -> dict:
    from mini_vllm import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=int(kv_gib * (1 << 30)), max_num_seqs=len(prompts),
              max_model_len=max(map(len, prompts)) + max_tokens, seed=0)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], sp, use_tqdm=False)          # warm-up
    best, tokens = float("inf"), None
    for _ in range(rounds):
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    blocks = llm.llm_engine.engine_core.kv_cache_report.num_blocks
    del llm
    gc.collect()
    return dict(side="ours", dtype=dtype, kv_cache_dtype=kv, seconds=best, blocks=blocks,
                output_tok_s=len(prompts) * max_tokens / best, tokens=tokens)


def run_vllm(model: str, kv: str, prompts, max_tokens: int) -> dict:
    workload = dict(prompts=prompts, max_tokens=[max_tokens] * len(prompts), modes=["greedy"], dtype="bfloat16",
                    kv_cache_dtype=kv, warmup_prompts=prompts[:2], warmup_max_tokens=[max_tokens] * 2)
    out = vllm_peer.call(model, workload, "default", KV_GIB)
    run = out["runs"][0]
    return dict(side="vllm", dtype="bfloat16", kv_cache_dtype=kv, seconds=run["seconds"], vllm=out["vllm"],
                output_tok_s=len(prompts) * max_tokens / run["seconds"], tokens=run["tokens"])


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny random model, a few short requests")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from mini_vllm import default_model_path
    tmp = tempfile.TemporaryDirectory()
    model = str(tiny_model_dir(Path(tmp.name)) if args.smoke else default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    num, prompt_len, max_tokens = (4, 64, 8) if args.smoke else (16, 1024, 64)
    prompts = [p for p, _ in make_workload(tokenizer, num, (prompt_len, prompt_len), (max_tokens, max_tokens))]
    kv_gib = KV_GIB / 32 if args.smoke else KV_GIB
    rows = [run_ours(model, dtype, kv, prompts, max_tokens, 1 if args.smoke else args.rounds, kv_gib)
            for dtype in ("float32", "bfloat16") for kv in KV_DTYPES]
    if not args.no_vllm and not args.smoke and vllm_peer.unavailable_reason() is None:
        rows += [run_vllm(model, kv, prompts, max_tokens) for kv in ("auto", "fp8")]
    for row in rows:
        float_row = next(r for r in rows if r["side"] == row["side"] and r["dtype"] == row["dtype"]
                         and r["kv_cache_dtype"] == "auto")
        row["tok_s_vs_float_cache"] = row["output_tok_s"] / float_row["output_tok_s"]
        row["greedy_agreement_vs_float_cache"] = prefix_agreement(row["tokens"], float_row["tokens"])
        if "blocks" in row:
            row["blocks_vs_float_cache"] = row["blocks"] / float_row["blocks"]
        print(f"{row['side']:5} {row['dtype']:9} {row['kv_cache_dtype']:20} {row['output_tok_s']:8.1f} tok/s "
              f"x{row['tok_s_vs_float_cache']:.3f}  agreement {row['greedy_agreement_vs_float_cache']:.3f}"
              + (f"  blocks x{row['blocks_vs_float_cache']:.2f}" if "blocks" in row else ""), flush=True)
    for row in rows:
        del row["tokens"]
    workload = dict(model="tiny random" if args.smoke else "SmolLM2-135M-Instruct", requests=num,
                    prompt_tokens=prompt_len, output_tokens=max_tokens, greedy=True, kv_cache_gib=kv_gib)
    if not args.smoke:
        print(write_result("kv_cache_engine", workload, rows))
    return rows


if __name__ == "__main__":
    main()
