"""Search many random chunked-prefill workloads for one the scheduler gets wrong.

    .venv/bin/python tests/integration/search_workloads.py 10000 --seed 2   # ~2.5 min, 2 processes

The property test (`test_scheduler_properties.py`) runs the same 50 workloads on every CI run, so
that CI is reproducible; this runs as many fresh ones as you ask for on the engine's composed
scheduler, drawn from the same distribution (`draw_chunked_workload`: every knob, policy,
preemption mode, a KV connector in half), and prints the argument tuples of those that fail —
each one a ready regression test: `run_chunked_workload(make_scheduler, *args)`; exit status 1
when any failed. Such a search found the idle-holder
livelock (`test_deferred_holders_of_loaded_kv_do_not_livelock_a_full_pool`): `10000 --seed 2`
prints 8 stuck workloads on the scheduler before the fix, none after it.
"""
from __future__ import annotations

import argparse
import multiprocessing
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mini_vllm.engine_scheduler import make_scheduler  # noqa: E402
from scheduler_workloads import draw_chunked_workload, run_chunked_workload  # noqa: E402


def try_one(job: tuple[int, int]) -> tuple[tuple, str] | None:
    seed, index = job
    rng = random.Random(1_000_003 * index + seed)
    workload = draw_chunked_workload(rng.randint, rng.choice, lambda: rng.random() < 0.5)
    try:
        run_chunked_workload(make_scheduler, *workload)
    except Exception as e:  # noqa: BLE001 — any failure is a finding
        return workload, f"{type(e).__name__}: {str(e)[:200]}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("num_workloads", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    jobs = [(args.seed, i) for i in range(args.num_workloads)]
    with multiprocessing.Pool(args.processes) as pool:
        failures = [f for f in pool.imap_unordered(try_one, jobs, chunksize=20) if f]
    print(f"{len(failures)} of {args.num_workloads} workloads failed")
    for workload, error in failures:
        print(f"run_chunked_workload(make_scheduler, *{workload!r})  # {error}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
