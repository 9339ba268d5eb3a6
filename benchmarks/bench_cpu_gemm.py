"""CPU linear layers: `F.linear` (MKL, what HF runs), oneDNN on prepacked weights (what vLLM's
CPU backend runs) and our C++ kernel on column panels (what the engine runs where it builds,
`kernels_cpu/gemm.py`, `kernels_cpu/csrc/gemm.cpp`), on SmolLM2-135M's shapes, in one run.

    python -m benchmarks.bench_cpu_gemm                     # ~2-3 min on 2 cores
    python -m benchmarks.bench_cpu_gemm --engine-rounds 2   # + the engine A/B, ours vs oneDNN (~10 min)
    python -m benchmarks.bench_cpu_gemm --smoke             # two row counts, seconds

Per row count (the tokens of one step: 1-64 for decode batches, 512-2048 for prefill chunks),
the time of one decoder layer's four matmuls (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576) plus the tied lm_head (576->49152), fp32, medians of interleaved repeats.
"Streamed" times the same matmuls over 30 layers' distinct weights (what a decode step does: 425 MB
that no cache holds) and reports the read rate of the weights. Writes benchmarks/results/
cpu_gemm.json + .png.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS_DIR, environment, write_result

# (in, out): SmolLM2-135M: hidden 576, 9 q + 2 x 3 kv heads of 64, intermediate 1536, vocab 49152
SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}
NUM_LAYERS = 30


def sides_for(weights: dict[str, torch.Tensor]) -> dict[str, dict]:
    """{side: {shape name: (fn(x) -> y)}}: F.linear, and each packed backend that runs here."""
    from kernels_cpu import gemm as cpu_gemm

    sides = {"F.linear": {n: (lambda x, w=w: F.linear(x, w)) for n, w in weights.items()}}
    if cpu_gemm.onednn_available():
        packed = {n: cpu_gemm.pack_weight(w) for n, w in weights.items()}
        sides["oneDNN packed"] = {n: (lambda x, p=p: cpu_gemm.packed_linear(x, p, None)) for n, p in packed.items()}
    if cpu_gemm.kernel_unavailable_reason(next(iter(weights.values()))) is None:
        panels = {n: cpu_gemm.pack_panels(w) for n, w in weights.items()}
        sides["ours (C++ panels)"] = {n: (lambda x, p=p: cpu_gemm.panel_linear(x, p, None)) for n, p in panels.items()}
        # The same kernel without its next-panel prefetch (kernels_cpu/csrc/gemm.cpp): what the prefetch buys.
        sides["ours, no prefetch"] = {n: (lambda x, p=p: cpu_gemm.panel_linear(x, p, None, prefetch_next_panel=False))
                                      for n, p in panels.items()}
    return sides


def time_one_layer(sides: dict, weights: dict, m: int, repeats: int, inner: int | None = None) -> dict:
    """Median seconds per side and shape (the weights stay in cache between calls); each sample
    times `inner` calls (default: 64 for decode row counts, fewer for prefill ones)."""
    xs = {name: torch.randn(m, w.shape[1]) for name, w in weights.items()}
    for name, w in weights.items():                        # same numbers first, within fp32 rounding
        ref = F.linear(xs[name], w)
        for side in sides.values():
            assert torch.allclose(side[name](xs[name]), ref, rtol=1e-4, atol=1e-4)
    samples = {side: {n: [] for n in weights} for side in sides}
    inner = inner or max(1, 64 // max(1, m // 32))
    for _ in range(repeats):                               # interleaved: every side sees the same machine state
        for name in weights:
            for side, fns in sides.items():
                fns[name](xs[name])
                t0 = time.perf_counter()
                for _ in range(inner):
                    fns[name](xs[name])
                samples[side][name].append((time.perf_counter() - t0) / inner)
    return {side: {n: statistics.median(v) for n, v in d.items()} for side, d in samples.items()}


def time_streamed(m: int, repeats: int) -> dict:
    """Median seconds per side of one decode step's linears: 30 layers of distinct weights + the lm_head."""
    torch.manual_seed(1)
    stacks = [{n: torch.randn(o, i) / i ** 0.5 for n, (i, o) in SHAPES.items() if n != "lm_head"}
              for _ in range(NUM_LAYERS)]
    head = {"lm_head": torch.randn(SHAPES["lm_head"][1], SHAPES["lm_head"][0]) / SHAPES["lm_head"][0] ** 0.5}
    layers = [sides_for(s) for s in stacks] + [sides_for(head)]
    xs = {n: torch.randn(m, i) for n, (i, _) in SHAPES.items()}
    samples = {side: [] for side in layers[0]}
    for _ in range(repeats):
        for side in samples:
            t0 = time.perf_counter()
            for layer in layers:
                for name, fn in layer[side].items():
                    fn(xs[name])
            samples[side].append(time.perf_counter() - t0)
    return {side: statistics.median(v) for side, v in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512, 2048])
    ap.add_argument("--streamed-rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine-rounds", type=int, default=0, help="also the engine A/B, ours vs oneDNN (SmolLM2)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    # --smoke runs every code path once, not the numbers: one call per sample (a 64-row lm_head call
    # alone is ~20 ms on 2 cores; 32 per sample x 4 sides x 2 repeats was most of the smoke run).
    inner = None
    if args.smoke:
        args.rows, args.streamed_rows, args.repeats, inner = [1, 64], [], 2, 1

    torch.manual_seed(0)
    weights = {name: torch.randn(n_out, n_in) / n_in ** 0.5 for name, (n_in, n_out) in SHAPES.items()}
    sides = sides_for(weights)
    if len(sides) == 1:
        raise SystemExit("neither oneDNN nor the C++ kernel runs here: nothing to compare")
    rows_out = []
    for m in args.rows:
        med = time_one_layer(sides, weights, m, args.repeats, inner)
        layer = {side: sum(v for n, v in d.items() if n != "lm_head") for side, d in med.items()}
        row = dict(rows=m, **{f"{side} layer ms": round(1e3 * layer[side], 3) for side in layer},
                   **{f"{side} lm_head ms": round(1e3 * med[side]["lm_head"], 3) for side in med})
        for side in sides:
            if side != "F.linear":
                row[f"{side}: layer speedup vs F.linear"] = round(layer["F.linear"] / layer[side], 2)
                row[f"{side}: lm_head speedup vs F.linear"] = round(med["F.linear"]["lm_head"] / med[side]["lm_head"], 2)
        rows_out.append(row)
        print(row, flush=True)
    streamed = []
    weight_bytes = 4 * sum(i * o * (1 if n == "lm_head" else NUM_LAYERS) for n, (i, o) in SHAPES.items())
    for m in args.streamed_rows:
        med = time_streamed(m, args.repeats)
        streamed.append(dict(rows=m, **{f"{side} step ms": round(1e3 * t, 1) for side, t in med.items()},
                             **{f"{side} GB/s of weights": round(weight_bytes / t / 1e9, 1) for side, t in med.items()}))
        print(streamed[-1], flush=True)
    workload = dict(model="SmolLM2-135M shapes", dtype="float32", shapes=SHAPES, repeats=args.repeats,
                    threads=torch.get_num_threads(), sides=list(sides),
                    streamed=dict(layers=NUM_LAYERS, weight_mb=round(weight_bytes / 1e6), rows=streamed),
                    peers="F.linear (MKL); oneDNN = torch.ops.mkldnn._linear_pointwise on _reorder_linear_weight",
                    ours="kernels_cpu/csrc/gemm.cpp panel_gemm on pack_panels")
    if args.engine_rounds:
        from benchmarks.bench_engine import engine_ab
        workload["engine_ab"] = engine_ab({"cpu": dict(cpu_gemm_backend="cpu"),
                                           "onednn": dict(cpu_gemm_backend="onednn")}, args.engine_rounds)
    name = "cpu_gemm_smoke" if args.smoke else "cpu_gemm"
    path = write_result(name, workload, rows_out, args.out_dir)
    if not args.smoke:
        plot(rows_out, sides, path.with_suffix(".png"))
    return dict(rows=rows_out, path=path)


def plot(rows_out: list[dict], sides: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ms = [r["rows"] for r in rows_out]
    for i, side in enumerate(s for s in sides if s != "F.linear"):
        ax.plot(ms, [r[f"{side}: layer speedup vs F.linear"] for r in rows_out], "o-", color=f"C{i}",
                label=f"{side}, one layer")
        ax.plot(ms, [r[f"{side}: lm_head speedup vs F.linear"] for r in rows_out], "s--", color=f"C{i}",
                label=f"{side}, lm_head")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel("F.linear time / packed time")
    ax.set_title(f"prepacked linears vs F.linear, fp32, {environment()['device']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
