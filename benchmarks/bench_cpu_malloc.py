"""The engine with and without `cpu_keep_freed_memory` (kernels_cpu/malloc.py), interleaved, each
run in a process of its own.

    python -m benchmarks.bench_cpu_malloc                # 2 rounds = 4 runs: ~7 min on 2 cores
    python -m benchmarks.bench_cpu_malloc --smoke        # tiny random model, seconds

malloc's configuration is process-wide and cannot be undone, so bench_engine cannot time an engine
without it beside ours in one process. Here every run is a fresh process, in the order off, on, on,
off, off, on, ... (each round reverses the last, so a machine drifting over minutes favours neither).
Same workload and engine settings as bench_engine (SmolLM2-135M fp32, 64 requests, prompts 32-512
tokens of real text, outputs 16-256, ignore_eos, 4096 batched tokens), greedy, stepped by hand
(engine_step_breakdown.breakdown): prefill and decode seconds, the minor page faults of each phase,
and a digest of every request's tokens (equal digests: identical outputs).
Writes benchmarks/results/cpu_malloc.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_engine import MAX_NUM_BATCHED_TOKENS, tiny_model_dir
from benchmarks.common import RESULTS_DIR, write_result
from benchmarks.engine_step_breakdown import breakdown_of, workload_shape

REPO = Path(__file__).resolve().parent.parent


def child(model_dir: str, keep_freed_memory: bool, smoke: bool) -> dict:
    """One run, in this (fresh) process: the engine's breakdown of bench_engine's workload."""
    return breakdown_of(model_dir, workload_shape(smoke), "auto", MAX_NUM_BATCHED_TOKENS,
                        cpu_keep_freed_memory=keep_freed_memory)


def run_in_fresh_process(model_dir: Path, keep_freed_memory: bool, smoke: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_cpu_malloc", "--child", "on" if keep_freed_memory else "off",
           "--model-dir", str(model_dir), *(["--smoke"] if smoke else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="pairs of runs (one with, one without)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model_dir, args.child == "on", args.smoke)), flush=True)
        return {}

    from mini_vllm import default_model_path

    tmp = tempfile.TemporaryDirectory()
    model_dir = tiny_model_dir(Path(tmp.name)) if args.smoke else default_model_path()
    rows = []
    for r in range(args.rounds):
        for keep in ((False, True) if r % 2 == 0 else (True, False)):
            row = dict(cpu_keep_freed_memory=keep, round=r, **run_in_fresh_process(model_dir, keep, args.smoke))
            print({k: row[k] for k in ("cpu_keep_freed_memory", "seconds", "prefill_seconds", "decode_seconds",
                                       "prefill_page_faults", "decode_page_faults") if k in row}, flush=True)
            rows.append(row)

    def speedups(phase_key: str) -> list[float]:         # per round: seconds without / seconds with
        return [round(next(x[phase_key] for x in rows if x["round"] == r and not x["cpu_keep_freed_memory"])
                      / next(x[phase_key] for x in rows if x["round"] == r and x["cpu_keep_freed_memory"]), 3)
                for r in range(args.rounds)]

    summary = dict(speedup_total=speedups("seconds"), speedup_prefill=speedups("prefill_seconds"),
                   speedup_decode=speedups("decode_seconds"))
    summary["speedup_total_median"] = statistics.median(summary["speedup_total"])
    summary["identical_tokens"] = len({row["output_tokens_sha256"] for row in rows}) == 1
    print(summary, flush=True)
    shape = workload_shape(args.smoke)
    path = write_result("cpu_malloc_smoke" if args.smoke else "cpu_malloc",
                        dict(model=Path(model_dir).name, dtype="float32", device="cpu", **shape, ignore_eos=True,
                             greedy=True, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, summary=summary,
                             command=" ".join(["python -m benchmarks.bench_cpu_malloc",
                                               *(argv if argv is not None else sys.argv[1:])])),
                        rows, args.out_dir)
    tmp.cleanup()
    return dict(summary=summary, rows=rows, path=path)


if __name__ == "__main__":
    main()
