"""`make bench`: every side-by-side benchmark, one after another, each in its own process
(so one benchmark's threads and caches don't colour the next). Results land in
benchmarks/results/ as JSON + PNG.

On a CPU machine the kernel benchmarks run their smoke sizes only (interpreter Triton
timings mean nothing); the engine and the simulators run in full. On a GPU machine the
kernel and GPU-engine benchmarks run in full.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

import torch

HAS_CUDA = torch.cuda.is_available()

# (module, extra args on CPU, extra args on GPU); None = skip on that kind of machine.
BENCHMARKS: list[tuple[str, list[str] | None, list[str] | None]] = [
    ("benchmarks.bench_paged_attention", ["--smoke"], []),
    ("benchmarks.bench_unified_attention", [], []),
    ("benchmarks.bench_kvcache", [], []),
    ("benchmarks.bench_kvcache_swap", [], []),
    ("benchmarks.hit_rate", [], []),
    ("benchmarks.bench_scheduler", [], []),
    ("benchmarks.sim_batching", [], []),
    ("benchmarks.sim_policies", [], []),
    ("benchmarks.sim_preemption", [], []),
    ("benchmarks.sim_chunked_prefill", [], []),
    ("benchmarks.bench_cpu_gemm", [], None),
    ("benchmarks.bench_engine", [], None),
    ("benchmarks.bench_engine_gpu", None, []),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of module names to run")
    args = ap.parse_args()
    failed = []
    for module, cpu_args, gpu_args in BENCHMARKS:
        extra = gpu_args if HAS_CUDA else cpu_args
        if extra is None or (args.only and not any(s in module for s in args.only)):
            continue
        if importlib.util.find_spec(module) is None:
            print(f"[bench] {module}: not found, skipped", flush=True)
            continue
        print(f"[bench] python -m {module} {' '.join(extra)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", module, *extra], env=os.environ.copy())
        print(f"[bench] {module}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(module)
    if failed:
        print("[bench] failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
