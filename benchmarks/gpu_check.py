"""The prepared device check: everything a GPU lease should run, in one command, offline.

    make gpu-check                                  # on a GPU machine (installs nothing from the network)
    python -m benchmarks.gpu_check --out-dir DIR    # the same, results elsewhere
    python -m benchmarks.gpu_check --only bench_engine_gpu --only tests
    python -m benchmarks.gpu_check --smoke          # the driver itself on a CPU (tiny benchmarks, no tests)

Steps, each a subprocess with its own time limit, in this order (benchmarks first: a test run
compiles kernels on every core and would disturb the timings):
  1. bench_engine_gpu --profile-batch 256 : nano-vllm's workload, ours (synchronous and with async
     scheduling) vs HF, each in its own process; the decode sweep against the measured copy
     bandwidth, a profiled decode step
  2. bench_paged_attention --quick : decode attention rungs (SDPA, Triton v1/v2, CUDA v1/v2/v3)
  3. pytest -m gpu -n N : every gpu test, in parallel (the CUDA extensions build once, cached)
Writes gpu_check.json (device, versions, date, each step's status / seconds / output tail, the
tests' counts) next to the benchmarks' own JSON + PNG. A step that fails or times out is recorded
as such and the others still run. Sized for 8 minutes on an H200 (the step limits add up to more,
as a bound), so a 15-minute lease can run it and run it again — not yet run whole: the lease of
2026-11-28 ran the engine benchmark (226 s with 64 HF requests, no continuous batching), cut the
attention benchmark after 36 s and had no time left for the tests (gpu_check.json).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, environment

# Test folders and files that import packages a bare GPU machine lacks (nbformat, the serving
# stack) or hold no gpu test: left out of collection there, as `make test-gpu` does.
TEST_IGNORES = ("--ignore-glob=*/test_notebook.py", "--ignore=tests/course")


def steps(out_dir: Path, smoke: bool, workers: int, no_cb: bool = False,
          test_paths: list[str] | None = None) -> dict[str, tuple[list[str], float]]:
    """name -> (command, time limit in seconds), in the order they run."""
    py = sys.executable
    if smoke:
        return {
            "bench_engine_gpu": ([py, "-m", "benchmarks.bench_engine_gpu", "--smoke", "--no-cb", "--profile-batch", "4",
                                  "--out-dir", str(out_dir)], 300),
            "bench_paged_attention": ([py, "-m", "benchmarks.bench_paged_attention", "--smoke", "--out-dir",
                                       str(out_dir)], 300),
        }
    return {
        # HF needs ~1,000 steps for any subset (each static batch runs to its longest request; on
        # the H200, 2026-11-28: 93 s for 64 requests at batch 64): 32 requests keep both HF peers
        # inside the lease, and ours is timed on the same 32 for the ratio.
        "bench_engine_gpu": ([py, "-m", "benchmarks.bench_engine_gpu", "--profile-batch", "256", "--hf-num-seqs", "32",
                              "--child-timeout", "150", *(["--no-cb"] if no_cb else []), "--out-dir", str(out_dir)],
                             420),
        "bench_paged_attention": ([py, "-m", "benchmarks.bench_paged_attention", "--quick", "--out-dir", str(out_dir)],
                                  150),
        "tests": ([py, "-m", "pytest", *(test_paths or ["tests"]), "-m", "gpu", "-q", "-p", "no:cacheprovider",
                   "-n", str(workers), *TEST_IGNORES], 240),
    }


def test_counts(output: str) -> dict:
    """pytest's summary line -> {"passed": n, "failed": n, ...}."""
    lines = [l for l in output.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|deselected)",
                                             lines[-1])} if lines else {}


def run_step(name: str, cmd: list[str], limit: float, log_dir: Path) -> dict:
    """Run one step with its output streamed to gpu_check_<name>.log (kept even if the lease ends)."""
    t0 = time.perf_counter()
    log = log_dir / f"gpu_check_{name}.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = None
    output = log.read_text(errors="replace")
    seconds = round(time.perf_counter() - t0, 1)
    status = "timed out" if rc is None else ("ok" if rc == 0 else f"failed (exit {rc})")
    print(f"[gpu-check] {name}: {status} in {seconds} s", flush=True)
    print("\n".join(output.strip().splitlines()[-25:]), flush=True)
    row = dict(step=name, command=" ".join(cmd[1:]), status=status, seconds=seconds,
               tail=output.strip().splitlines()[-25:])
    if name == "tests":
        row["counts"] = test_counts(output)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--only", action="append", default=None, help="run only these steps (repeatable)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="pytest-xdist workers")
    ap.add_argument("--no-cb", action="store_true", help="leave out HF continuous batching (the slowest peer)")
    ap.add_argument("--tests", nargs="+", default=None, help="test paths for the gpu tests (default: tests)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole check: a step gets at most what is left (then it is 'timed out')")
    ap.add_argument("--smoke", action="store_true", help="the driver on a CPU: tiny benchmarks, no tests")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plan = steps(args.out_dir, args.smoke, args.workers, args.no_cb, args.tests)
    unknown = set(args.only or ()) - set(plan)
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; steps: {list(plan)}")
    t0 = time.perf_counter()
    path = args.out_dir / ("gpu_check_smoke.json" if args.smoke else "gpu_check.json")
    result = dict(environment=environment(), smoke=args.smoke, command=" ".join(sys.argv), steps=[])
    for name, (cmd, limit) in plan.items():
        if args.only is not None and name not in args.only:
            continue
        left = None if args.deadline is None else args.deadline - (time.perf_counter() - t0)
        if left is not None and left < 10:
            result["steps"].append(dict(step=name, status="not run (deadline)", seconds=0))
        else:
            result["steps"].append(run_step(name, cmd, limit if left is None else min(limit, left), args.out_dir))
        result["total_seconds"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(result, indent=2))         # after every step: a cut-off lease keeps the rest
    print(f"[gpu-check] {len(result['steps'])} steps in {result['total_seconds']} s -> {path}")
    return result


if __name__ == "__main__":
    main()
