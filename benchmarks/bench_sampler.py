"""The sampler on the CPU: the fast path vs the readable reference, same logits, same run.

    python -m benchmarks.bench_sampler              # real SmolLM2 logits (~1 min on 2 cores)
    python -m benchmarks.bench_sampler --smoke      # random logits, a few seconds (CI)

Workload: [64, 49152] fp32 logits — the last-position logits of SmolLM2-135M-Instruct on 64
windows of real text (32-256 tokens of `pydoc_data.topics`), as one decode step of the engine
would see them. Cases (every row the same parameters):
    T 0.8, top-k 50, top-p 0.95  |  T 0.8, top-p 0.95  |  T 0.8  |  greedy
Sides: `Sampler()` (the fast path: cheap finiteness check, topk candidates, one uniform per
row) and `Sampler(reference=True)` (full sort of the vocabulary, V exponentials per row). The
pieces are timed too: the finiteness check (full isnan/isinf scan vs isfinite(amax)), top-k/top-p
(sort vs candidates), the draw (exponential race vs inverse CDF). Interleaved rounds, medians;
writes benchmarks/results/sampler_cpu.json.

Clocks: wall time, and with `--threads 1` also this thread's CPU time (`time.thread_time`),
which other jobs on a shared machine disturb far less than wall time.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.common import RESULTS_DIR, write_result

CASES = {
    "T 0.8, top-k 50, top-p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
    "T 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "T 0.8": dict(temperature=0.8),
    "greedy": dict(temperature=0.0),
}


def real_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    """[num_rows, vocab] fp32: SmolLM2's next-token logits after windows of real text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.bench_engine import real_text_corpus
    from mini_vllm import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(real_text_corpus()).input_ids
    rng = random.Random(seed)
    rows = []
    with torch.inference_mode():
        for _ in range(num_rows):
            n = rng.randint(32, 256)
            start = rng.randrange(0, len(ids) - n)
            rows.append(model(torch.tensor([ids[start:start + n]])).logits[0, -1].float())
    return torch.stack(rows)


def top_p_set_sizes(logits: torch.Tensor, temperature: float, p: float) -> list[int]:
    """How many tokens each row's top-p set holds (how far the candidates must reach)."""
    mass = (logits / temperature).softmax(-1).sort(-1, descending=True).values.cumsum(-1)
    return ((mass < p).sum(-1) + 1).tolist()


def timed(fn, reps: int) -> tuple[float, float]:
    """Median (wall seconds, this thread's CPU seconds) over reps calls, after one warm-up call."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> dict:
    from mini_vllm.sampler import Sampler, SamplingMetadata, nonfinite_rows
    from mini_vllm.sampling_params import SamplingParams
    from mini_vllm.topk_topp_sampler import apply_top_k_top_p, inverse_cdf_sample, random_sample, top_k_top_p_candidates

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each times every side once)")
    ap.add_argument("--reps", type=int, default=5, help="calls per side per round (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1: CPU time is meaningful)")
    ap.add_argument("--smoke", action="store_true", help="random logits, 1 round of 2 calls")
    ap.add_argument("--out-dir", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        logits, source = torch.randn(8, 49152, generator=torch.Generator().manual_seed(0)) * 4, "randn * 4"
        args.rounds, args.reps = 1, 2
    else:
        logits, source = real_logits(args.rows), "SmolLM2-135M-Instruct on pydoc_data.topics windows"
    n, vocab = logits.shape

    fast, reference = Sampler(torch.Generator().manual_seed(0)), Sampler(torch.Generator().manual_seed(0), reference=True)
    metadata = {name: SamplingMetadata.from_params([SamplingParams(**kw)] * n) for name, kw in CASES.items()}
    x = logits / 0.8
    probs = x.softmax(-1)
    k, p = torch.full((n,), 50), torch.full((n,), 0.95)
    u = torch.rand(n, dtype=torch.float64)
    pieces = {
        "finiteness check": (lambda: torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
                             | ~torch.isfinite(logits).any(-1), lambda: nonfinite_rows(logits)),
        "top-k 50 + top-p 0.95 mask": (lambda: apply_top_k_top_p(x, k, p), lambda: top_k_top_p_candidates(x, probs, k, p)),
        "top-p 0.95 mask": (lambda: apply_top_k_top_p(x, None, p), lambda: top_k_top_p_candidates(x, probs, None, p)),
        "draw (whole rows)": (lambda: random_sample(probs, {}), lambda: inverse_cdf_sample(probs, u)),
    }
    jobs = [(f"sampler: {name}", lambda md=md: reference(logits, md), lambda md=md: fast(logits, md))
            for name, md in metadata.items()] + [(f"piece: {name}", *fns) for name, fns in pieces.items()]

    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):                  # interleaved: this machine is shared and drifts
        for name, ref_fn, fast_fn in jobs:
            times.setdefault((name, "reference"), []).append(timed(ref_fn, args.reps))
            times.setdefault((name, "fast"), []).append(timed(fast_fn, args.reps))
    rows = []
    one_thread = torch.get_num_threads() == 1
    for name, _, _ in jobs:
        row = dict(name=name)
        for clock, i in (("wall", 0), ("cpu", 1)):
            if clock == "cpu" and not one_thread:
                continue
            ref_ms = statistics.median(t[i] for t in times[(name, "reference")]) * 1e3
            fast_ms = statistics.median(t[i] for t in times[(name, "fast")]) * 1e3
            row.update({f"reference_{clock}_ms": round(ref_ms, 2), f"fast_{clock}_ms": round(fast_ms, 2),
                        f"speedup_{clock}": round(ref_ms / fast_ms, 1),
                        f"fast_{clock}_ms_per_round": [round(t[i] * 1e3, 2) for t in times[(name, "fast")]]})
            print(f"{name:<44} {clock:4} reference {ref_ms:8.2f} ms   fast {fast_ms:7.2f} ms   {ref_ms / fast_ms:6.1f}x",
                  flush=True)
        rows.append(row)
    sizes = top_p_set_sizes(logits, 0.8, 0.95)
    workload = dict(logits=[n, vocab], dtype="float32", source=source, threads=torch.get_num_threads(),
                    rounds=args.rounds, reps=args.reps, cases=CASES,
                    top_p_095_set_size=dict(median=statistics.median(sizes), max=max(sizes)))
    try:
        import os
        workload["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    path = write_result("sampler_cpu_smoke" if args.smoke else "sampler_cpu", workload, rows, args.out_dir)
    return dict(rows=rows, path=path)


if __name__ == "__main__":
    main()
