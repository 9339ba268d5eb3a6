"""Micro-benchmarks of chapter 04's hot paths, side by side in one run.

1. n-gram prompt lookup, per request: our vectorised numpy search (`find_ngram`) vs the
   readable double loop (`find_ngram_reference`), on contexts of 256 .. 32768 tokens, for a
   context that copies an earlier passage (a match exists) and one with no repeat (the
   worst case: every suffix length is searched in vain). prompt_lookup 2..4, k = 5.
2. The rejection sampler for one step: batch B in {1, 8, 64} requests x k = 4 drafts, vocab
   49152 (SmolLM2), half greedy: batched torch vs the per-request reference loop (CPU), plus
   the Triton and CUDA kernels on a GPU.

Times are medians of the thread's CPU time (time.thread_time) on CPU, with torch limited to
one thread so that all the work is on the timed thread — the machines are shared, wall time
would count other processes — and of CUDA-synchronised wall time on a GPU. Contenders are
interleaved call by call, so both see the same load.

    .venv/bin/python -m benchmarks.bench_spec_decode_kernels [--smoke]
        -> benchmarks/results/spec_decode_kernels.{json,png}
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.common import RESULTS_DIR, environment, sync, write_result
from spec_decode.ngram_proposer import find_ngram, find_ngram_reference
from spec_decode.ops import rejection_sample
from spec_decode.synthetic import make_rejection_case


def interleaved(fns: dict, iters: int, warmup: int = 2, cpu_time: bool = True) -> dict[str, float]:
    clock = time.thread_time if cpu_time else time.perf_counter
    for _ in range(warmup):
        for f in fns.values():
            f()
    samples = {k: [] for k in fns}
    for _ in range(iters):
        for k, f in fns.items():
            sync()
            t0 = clock()
            f()
            sync()
            samples[k].append(clock() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_ngram(lengths: list[int], iters: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for L in lengths:
        doc = rng.integers(0, 49152, L // 2)
        workloads = {"copy": np.concatenate((doc, rng.integers(0, 49152, L - L // 2 - 64), doc[:64])),
                     "no_match": rng.integers(0, 49152, L)}
        for name, ctx in workloads.items():
            lst = ctx.tolist()
            ref_iters = max(1, min(iters, 20000 // L))
            assert find_ngram(ctx, 2, 4, 5).tolist() == find_ngram_reference(lst, 2, 4, 5)
            t = interleaved({"numpy": lambda: find_ngram(ctx, 2, 4, 5),
                             "reference": lambda: find_ngram_reference(lst, 2, 4, 5)}, ref_iters)
            rows.append(dict(bench="ngram", context=L, workload=name, numpy_us=round(t["numpy"] * 1e6, 1),
                             reference_us=round(t["reference"] * 1e6, 1),
                             speedup=round(t["reference"] / t["numpy"], 1)))
            print(rows[-1], flush=True)
    return rows


def bench_rejection(batches: list[int], vocab: int, iters: int) -> list[dict]:
    rows = []
    gpu = torch.cuda.is_available()
    for B in batches:
        case = make_rejection_case([4] * B, vocab, greedy=[i % 2 == 0 for i in range(B)], seed=B)
        fns = {"reference": lambda: rejection_sample(*case.args(), backend="reference", check_values=False),
               "torch": lambda: rejection_sample(*case.args(), backend="torch", check_values=False)}
        t = interleaved(fns, iters)
        row = dict(bench="rejection", batch=B, k=4, vocab=vocab, reference_cpu_ms=round(t["reference"] * 1e3, 3),
                   torch_cpu_ms=round(t["torch"] * 1e3, 3))
        if gpu:
            dev = case.to("cuda")
            g = interleaved({b: (lambda b=b: rejection_sample(*dev.args(), backend=b, check_values=False))
                             for b in ("torch", "triton", "cuda")}, iters, cpu_time=False)
            row.update({f"{b}_gpu_ms": round(v * 1e3, 4) for b, v in g.items()})
        rows.append(row)
        print(row, flush=True)
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for wl, style in (("copy", "-o"), ("no_match", "--s")):
        r = [x for x in rows if x["bench"] == "ngram" and x["workload"] == wl]
        ax[0].loglog([x["context"] for x in r], [x["numpy_us"] for x in r], style, label=f"numpy, {wl}")
        ax[0].loglog([x["context"] for x in r], [x["reference_us"] for x in r], style, alpha=0.5,
                     label=f"python loop, {wl}")
    ax[0].set(xlabel="context tokens", ylabel="µs per request (CPU time)", title="n-gram lookup (2..4, k=5)")
    ax[0].legend(fontsize=7)
    r = [x for x in rows if x["bench"] == "rejection"]
    for key in [k for k in r[0] if k.endswith("_ms")]:
        ax[1].loglog([x["batch"] for x in r], [x[key] for x in r], "-o", label=key)
    ax[1].set(xlabel="requests (k=4 drafts each)", ylabel="ms per step", title=f"rejection sampler, vocab {r[0]['vocab']}")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI: proves the script runs)")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)          # thread CPU time must see all of torch's work
    lengths = [256, 1024] if args.smoke else [256, 1024, 4096, 16384, 32768]
    batches = [1, 4] if args.smoke else [1, 8, 64]
    vocab = 1000 if args.smoke else 49152
    iters = 3 if args.smoke else 30
    rows = bench_ngram(lengths, iters) + bench_rejection(batches, vocab, iters)
    workload = dict(ngram="prompt_lookup_min=2, prompt_lookup_max=4, k=5; 'copy' repeats 64 tokens of an earlier "
                          "passage at the end, 'no_match' is random tokens", rejection=f"k=4 drafts per request, "
                          f"vocab {vocab}, half the requests greedy, draft_probs given", smoke=args.smoke,
                    timing="median CPU time of the calling thread (CPU) / synchronised wall time (GPU), interleaved")
    name = "spec_decode_kernels" + ("_smoke" if args.smoke else "")
    path = write_result(name, workload, rows, args.out_dir)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return rows


if __name__ == "__main__":
    main()
