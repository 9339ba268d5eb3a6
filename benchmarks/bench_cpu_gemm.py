"""CPU linear layers: `F.linear` (MKL, what HF runs) vs oneDNN on prepacked weights (what the
engine runs, `mini_vllm/models/cpu_gemm.py`), on SmolLM2-135M's shapes, in one run.

    python -m benchmarks.bench_cpu_gemm            # ~1-2 min on 2 cores
    python -m benchmarks.bench_cpu_gemm --smoke    # two row counts, seconds

Per row count (the tokens of one step: 1-64 for decode batches, 512-2048 for prefill chunks),
the time of one decoder layer's four matmuls (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576) plus the tied lm_head (576->49152), fp32, medians of interleaved repeats.
Writes benchmarks/results/cpu_gemm.json + .png.
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.repeats = [1, 64], 2

    from mini_vllm.models import cpu_gemm

    if not cpu_gemm.onednn_available():
        raise SystemExit("this torch build has no oneDNN: nothing to compare")
    torch.manual_seed(0)
    weights = {name: torch.randn(n_out, n_in) / n_in ** 0.5 for name, (n_in, n_out) in SHAPES.items()}
    packed = {name: cpu_gemm.pack_weight(w) for name, w in weights.items()}
    rows_out = []
    for m in args.rows:
        xs = {name: torch.randn(m, w.shape[1]) for name, w in weights.items()}
        for name in weights:                                   # same numbers, within fp32 rounding
            ref = F.linear(xs[name], weights[name])
            assert torch.allclose(cpu_gemm.packed_linear(xs[name], packed[name], None), ref, rtol=1e-4, atol=1e-4)
        samples = {"F.linear": {n: [] for n in weights}, "oneDNN packed": {n: [] for n in weights}}
        inner = max(1, 64 // max(1, m // 32))
        for _ in range(args.repeats):                          # interleaved: both see the same machine state
            for name in weights:
                for side, fn in (("F.linear", lambda: F.linear(xs[name], weights[name])),
                                 ("oneDNN packed", lambda: cpu_gemm.packed_linear(xs[name], packed[name], None))):
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fn()
                    samples[side][name].append((time.perf_counter() - t0) / inner)
        med = {side: {n: statistics.median(v) for n, v in d.items()} for side, d in samples.items()}
        layer = {side: sum(v for n, v in d.items() if n != "lm_head") for side, d in med.items()}
        row = dict(rows=m, **{f"{side} layer ms": round(1e3 * layer[side], 3) for side in layer},
                   **{f"{side} lm_head ms": round(1e3 * med[side]["lm_head"], 3) for side in med},
                   layer_speedup=round(layer["F.linear"] / layer["oneDNN packed"], 2),
                   lm_head_speedup=round(med["F.linear"]["lm_head"] / med["oneDNN packed"]["lm_head"], 2))
        rows_out.append(row)
        print(row, flush=True)
    workload = dict(model="SmolLM2-135M shapes", dtype="float32", shapes=SHAPES, repeats=args.repeats,
                    peer="F.linear (MKL)", ours="torch.ops.mkldnn._linear_pointwise on _reorder_linear_weight")
    name = "cpu_gemm_smoke" if args.smoke else "cpu_gemm"
    path = write_result(name, workload, rows_out, args.out_dir)
    if not args.smoke:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ms = [r["rows"] for r in rows_out]
        ax.plot(ms, [r["layer_speedup"] for r in rows_out], "o-", label="one decoder layer's 4 matmuls")
        ax.plot(ms, [r["lm_head_speedup"] for r in rows_out], "s-", label="lm_head 576 -> 49152")
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (tokens in the step)")
        ax.set_ylabel("F.linear time / packed time")
        ax.set_title(f"oneDNN prepacked vs F.linear, fp32, {environment()['device']}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
    return dict(rows=rows_out, path=path)


if __name__ == "__main__":
    main()
