"""Search many random chunked-prefill workloads for one the scheduler gets wrong.

    .venv/bin/python tests/05_chunked_prefill/search_workloads.py 30000 --seed 2   # ~7 min, 2 processes

The property test (`test_chunked_properties.py`) runs the same 50 workloads on every CI run, so
that CI is reproducible; this runs as many fresh ones as you ask for, drawn from the same
distribution (every knob, policy, preemption mode, a KV connector in 70 %), and prints the
argument tuples of those that fail — each one a ready regression test:
`run_chunked_workload(*args)`; exit status 1 when any failed. It found the idle-holder livelock
(`test_deferred_holders_of_loaded_kv_do_not_livelock_a_full_pool`): `10000 --seed 2` prints
several stuck workloads on the scheduler before the fix, and `30000 --seed 2` none after it.
"""
from __future__ import annotations

import argparse
import multiprocessing
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from test_chunked_properties import run_chunked_workload  # noqa: E402

from scheduler import POLICIES  # noqa: E402


def draw_workload(rng: random.Random) -> tuple:
    """The arguments of `run_chunked_workload`, from the property test's ranges."""
    max_num_seqs, partial = rng.randint(1, 6), rng.randint(1, 3)
    return (max_num_seqs, rng.randint(max(8, max_num_seqs), 40), rng.choice(POLICIES),
            rng.choice(["recompute", "swap"]), partial, rng.randint(1, partial), rng.choice([0, 4, 12, 30]),
            rng.randint(0, 2), rng.randint(8, 30), rng.choice([2, 4, 8]), rng.random() < 0.5,
            rng.randint(0, 2**32 - 1), rng.random() < 0.7, rng.randint(1, 30))


def try_one(job: tuple[int, int]) -> tuple[tuple, str] | None:
    seed, index = job
    workload = draw_workload(random.Random(1_000_003 * index + seed))
    try:
        run_chunked_workload(*workload)
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
        print(f"run_chunked_workload{workload!r}  # {error}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
