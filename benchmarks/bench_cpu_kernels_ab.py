"""The engine with its CPU kernels (`cpu_kernels="auto"`) vs on torch ops alone (`"off"`), interleaved.

    python -m benchmarks.bench_cpu_kernels_ab --rounds 3        # ~15 min on 2 cores

What `kernels_cpu` buys end to end, and a check that it changes no token: bench_engine's workload
(SmolLM2-135M fp32, 64 requests, prompts 32-512 tokens of real text, outputs 16-256, greedy,
ignore_eos; every request admitted at once), each side in its own process (malloc's tuning is
process-wide: an "off" engine beside an "auto" one in the same process would inherit it),
interleaved auto, off, auto, ... so that a drift of the machine's speed hits both; per round the
ratio of the "off" run to the mean of its two "auto" neighbours. Writes
benchmarks/results/engine_cpu_kernels_ab.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.bench_engine import MAX_NUM_BATCHED_TOKENS, NUM_REQUESTS, OUTPUT_LEN, PROMPT_LEN, engine_args, make_workload
from benchmarks.common import RESULTS_DIR, write_result

KV_CACHE_GIB = 2


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help='"off" runs (each between two "auto" runs)')
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from mini_vllm import default_model_path
    from mini_vllm.engine_process import EngineProcess

    model_dir = default_model_path()
    workload = make_workload(AutoTokenizer.from_pretrained(model_dir), NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, 0)
    requests = [dict(request_id=f"r{i}", prompt_token_ids=p, max_tokens=n) for i, (p, n) in enumerate(workload)]
    warmup = [dict(request_id=f"w{i}", prompt_token_ids=p[:32], max_tokens=4) for i, (p, _) in enumerate(workload[:4])]
    total_out = sum(n for _, n in workload)
    settings = dict(model=str(model_dir), num_threads=torch.get_num_threads(),
                    **engine_args(NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, MAX_NUM_BATCHED_TOKENS,
                                  kv_cache_memory=KV_CACHE_GIB << 30))
    sides = {mode: EngineProcess(cpu_kernels=mode, **settings) for mode in ("auto", "off")}
    rows, tokens = [], {}
    try:
        for engine in sides.values():
            engine.generate(warmup)

        def run(mode: str) -> float:
            engine = sides[mode]
            assert engine.reset_prefix_cache(), "requests still hold KV blocks"   # every run computes everything
            t0 = time.perf_counter()
            results = engine.generate(requests, timeout=1800)
            seconds = time.perf_counter() - t0
            toks = [r["token_ids"] for r in results]
            assert sum(map(len, toks)) == total_out, "a request stopped early"
            tokens.setdefault(mode, toks)
            rows.append(dict(name=f"cpu_kernels={mode}", seconds=round(seconds, 3), output_tokens=total_out,
                             output_tokens_per_s=round(total_out / seconds, 2), order=len(rows)))
            print(f"cpu_kernels={mode:<5} {seconds:8.1f} s  {total_out / seconds:8.1f} output tok/s", flush=True)
            return total_out / seconds

        auto = [run("auto")]
        ratios = []
        for _ in range(args.rounds):
            off = run("off")
            auto.append(run("auto"))
            ratios.append(round((auto[-2] + auto[-1]) / 2 / off, 3))        # auto (mean of the neighbours) / off
    finally:
        for engine in sides.values():
            engine.close()
    summary = dict(speedup_auto_vs_off_per_round=ratios, speedup_auto_vs_off_median=statistics.median(ratios),
                   same_greedy_tokens=tokens["auto"] == tokens["off"])
    print(summary, flush=True)
    workload_info = dict(model=Path(model_dir).name, dtype="float32", device="cpu", num_requests=NUM_REQUESTS,
                         prompt_len=list(PROMPT_LEN), output_len=list(OUTPUT_LEN), ignore_eos=True, mode="greedy",
                         command=" ".join(["python -m benchmarks.bench_cpu_kernels_ab",
                                           *(argv if argv is not None else sys.argv[1:])]),
                         summary=summary)
    path = write_result("engine_cpu_kernels_ab", workload_info, rows, args.out_dir)
    return dict(summary=summary, path=path)


if __name__ == "__main__":
    main()
