"""Where the engine's time goes on the CPU workload of `bench_engine`: prefill vs decode steps,
and inside them the attention op (chapter 05's unified attention), for each CPU GEMM backend.

    python -m benchmarks.engine_step_breakdown            # ~5 min on 2 cores
    python -m benchmarks.engine_step_breakdown --smoke    # tiny random model, seconds

Same workload and engine settings as `python -m benchmarks.bench_engine` (SmolLM2 fp32, 64
requests, prompts 32-512 tokens of real text, outputs 16-256, ignore_eos, greedy). The engine
is stepped by hand; a step is "decode" when every scheduled request computes one token. The
attention time is measured by wrapping the attention function the model layers call.
Writes benchmarks/results/engine_step_breakdown.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.bench_engine import (MAX_NUM_BATCHED_TOKENS, NUM_REQUESTS, OUTPUT_LEN, PROMPT_LEN,
                                    SMOKE_KV_CACHE_MEMORY, make_workload, tiny_model_dir)
from benchmarks.common import RESULTS_DIR, write_result

SMOKE_SHAPE = dict(num_requests=6, prompt_len=(8, 40), output_len=(2, 12))     # with the tiny random model


def workload_shape(smoke: bool, num_requests: int = NUM_REQUESTS) -> dict:
    """bench_engine's workload (or the smoke one): number of requests, prompt and output length ranges."""
    return SMOKE_SHAPE if smoke else dict(num_requests=num_requests, prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN)


def breakdown_of(model_dir, shape: dict, cpu_gemm_backend: str, max_num_batched_tokens: int, **engine_kwargs) -> dict:
    """`breakdown` on the workload of `shape` (workload_shape), with bench_engine's engine limits
    (and with the smoke shape, its --smoke KV pool)."""
    from transformers import AutoTokenizer

    workload = make_workload(AutoTokenizer.from_pretrained(model_dir), shape["num_requests"], shape["prompt_len"],
                             shape["output_len"])
    max_model_len = shape["prompt_len"][1] + shape["output_len"][1]
    if shape == SMOKE_SHAPE:
        engine_kwargs.setdefault("kv_cache_memory", SMOKE_KV_CACHE_MEMORY)
    return breakdown(model_dir, workload, cpu_gemm_backend, max(max_num_batched_tokens, max_model_len), max_model_len,
                     **engine_kwargs)


def breakdown(model_dir, workload, cpu_gemm_backend: str, max_num_batched_tokens: int, max_model_len: int,
              **engine_kwargs) -> dict:
    """One greedy pass over `workload`, stepped by hand: seconds, attention seconds, tokens and minor
    page faults (the kernel mapping a fresh page into the process) per phase."""
    import resource

    import mini_vllm.models.attention as attention_module
    from mini_vllm import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_model_len=max_model_len, max_num_seqs=len(workload),
              max_num_batched_tokens=max_num_batched_tokens, cpu_gemm_backend=cpu_gemm_backend, **engine_kwargs)
    engine = llm.llm_engine
    attention_seconds = [0.0]
    original = attention_module.unified_attention

    def timed_attention(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        attention_seconds[0] += time.perf_counter() - t0
        return out

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in workload]
    llm.generate([p for p, _ in workload[:4]], params[:4], use_tqdm=False)          # warm-up
    llm.reset_prefix_cache()
    attention_module.unified_attention = timed_attention
    try:
        for i, ((prompt, _), p) in enumerate(zip(workload, params)):
            engine.add_request(f"b{i}", prompt, p)
        phases = defaultdict(lambda: dict(steps=0, seconds=0.0, attention_seconds=0.0, tokens=0, page_faults=0))
        outputs = {}
        t_all = time.perf_counter()
        while engine.has_unfinished_requests():
            attention_seconds[0] = 0.0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            finished = [out for out in engine.step() if out.finished]
            seconds = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            outputs.update((out.request_id, out.outputs[0].token_ids) for out in finished)
            so = engine.last_step.scheduler_output
            phase = phases["decode" if max(so.num_scheduled_tokens.values(), default=0) == 1 else "prefill"]
            phase["steps"] += 1
            phase["seconds"] += seconds
            phase["attention_seconds"] += attention_seconds[0]
            phase["tokens"] += so.total_num_scheduled_tokens
            phase["page_faults"] += faults
        total = time.perf_counter() - t_all
    finally:
        attention_module.unified_attention = original
    output_tokens = sum(n for _, n in workload)
    # One digest of every request's tokens, in request order: equal digests = identical greedy outputs.
    digest = hashlib.sha256(json.dumps([list(outputs[f"b{i}"]) for i in range(len(workload))]).encode()).hexdigest()
    return dict(cpu_gemm_backend=cpu_gemm_backend, seconds=round(total, 2),
                output_tokens_per_s=round(output_tokens / total, 2), output_tokens_sha256=digest[:16],
                **{f"{name}_{key}": round(v, 4) if isinstance(v, float) else v
                   for name, phase in phases.items() for key, v in phase.items()})


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    ap.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    from mini_vllm import default_model_path

    tmp = tempfile.TemporaryDirectory()
    model_dir = tiny_model_dir(Path(tmp.name)) if args.smoke else default_model_path()
    shape = workload_shape(args.smoke, args.num_requests)
    rows = []
    for backend in ("auto", "onednn", "torch"):
        row = breakdown_of(model_dir, shape, backend, args.max_num_batched_tokens)
        print(row, flush=True)
        rows.append(row)
    write_result("engine_step_breakdown_smoke" if args.smoke else "engine_step_breakdown",
                 dict(model=Path(model_dir).name, dtype="float32", device="cpu", num_requests=shape["num_requests"],
                      prompt_len=list(shape["prompt_len"]), output_len=list(shape["output_len"]), ignore_eos=True,
                      greedy=True, max_num_batched_tokens=args.max_num_batched_tokens,
                      note="cpu_gemm_backend auto = packed linears (our C++ kernel where it builds, else oneDNN); "
                           "onednn = oneDNN's matmul on its prepacked weights (vLLM's); torch = F.linear"), rows, args.out_dir)
    tmp.cleanup()
    return rows


if __name__ == "__main__":
    main()
