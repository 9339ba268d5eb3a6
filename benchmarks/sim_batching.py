"""[Kwon 2025, Fig. 3.12] in the simulator: normalized latency versus request rate for static
batching, Orca (Max / Pow2 / Oracle) reservation and paged continuous batching (ours), on
ShareGPT-like and Alpaca-like traces, OPT-13B on one A100-40GB (cost model and KV capacity
of [Kwon 2025, Table 3.1]: 15.7K token slots, 16-token blocks, max_model_len 2048).

Side by side in one run, on the same traces; the ratio reported is the highest request rate
each system sustains with a mean normalized latency under the SLO, relative to ours.
Throughput, TTFT, ITL and the average number of batched requests [Kwon 2025, Fig. 3.13] too.

    .venv/bin/python -m benchmarks.sim_batching           # -> benchmarks/results/sim_batching.{json,png}
    .venv/bin/python -m benchmarks.sim_batching --quick   # fewer requests and rates
"""
from __future__ import annotations

import argparse
import json

from benchmarks.common import RESULTS_DIR, write_result
from scheduler.cost_model import OPT_13B_A100
from scheduler.experiments import BATCHING_KINDS, batching_sweep
from scheduler.traces import ALPACA, SHAREGPT

SLO_S_PER_TOKEN = 0.1      # "the latency explodes" threshold used for the sustainable-rate ratio
RATES = {"ShareGPT-like": [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
         "Alpaca-like": [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]}


def sustainable_rate(rows: list[dict], workload: str, kind: str) -> float:
    ok = [r["rate"] for r in rows if r["workload"] == workload and r["kind"] == kind
          and r["normalized_latency_s_per_tok"] <= SLO_S_PER_TOKEN]
    return max(ok, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((RESULTS_DIR / "sim_batching.json").read_text())["rows"], RESULTS_DIR / "sim_batching.png")
        return
    n = 150 if args.quick else args.num_requests
    rows = []
    for workload in (SHAREGPT, ALPACA):
        rates = RATES[workload.name][::2] if args.quick else RATES[workload.name]
        rows += batching_sweep(workload, rates, n, cost_model=OPT_13B_A100)
        for r in rows[-len(rates) * len(BATCHING_KINDS):]:
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                   if k in ("workload", "rate", "kind", "normalized_latency_s_per_tok", "throughput_req_s",
                            "mean_batched_requests")}, flush=True)
    capacity = {w: {k: sustainable_rate(rows, w, k) for k in BATCHING_KINDS} for w in RATES}
    ratios = {w: {k: (c["continuous"] / c[k] if c[k] else float("inf")) for k in BATCHING_KINDS}
              for w, c in capacity.items()}
    print("sustainable rate (req/s, normalized latency <= %.2f s/token):" % SLO_S_PER_TOKEN, capacity)
    print("ours / theirs:", ratios)
    workload = {"what": "serving simulation, normalized latency vs request rate [Kwon 2025, Fig. 3.12]",
                "model": OPT_13B_A100.name, "cost_model": vars(OPT_13B_A100), "kv_slots": 15_700, "block_size": 16,
                "max_model_len": 2048, "num_requests": n, "slo_s_per_token": SLO_S_PER_TOKEN,
                "sustainable_rate": capacity, "capacity_ratio_ours_over": ratios,
                "command": "python -m benchmarks.sim_batching" + (" --quick" if args.quick else "")}
    path = write_result("sim_batching", workload, rows)
    plot(rows, RESULTS_DIR / "sim_batching.png")
    print(f"wrote {path}")


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metrics = [("normalized_latency_s_per_tok", "normalized latency (s/token)", (0, 1.0)),
               ("throughput_tok_s", "throughput (output tokens/s)", None),
               ("ttft_p50_s", "median TTFT (s), log", "log")]
    fig, axes = plt.subplots(len(RATES), len(metrics), figsize=(14, 7))
    for row_axes, workload in zip(axes, RATES):
        for ax, (key, label, scale) in zip(row_axes, metrics):
            for kind in BATCHING_KINDS:
                pts = [(r["rate"], r[key]) for r in rows if r["workload"] == workload and r["kind"] == kind]
                name = "ours (paged, continuous)" if kind == "continuous" else kind
                ax.plot(*zip(*pts), "o-", ms=3, label=name)
            if key == "normalized_latency_s_per_tok":
                ax.axhline(SLO_S_PER_TOKEN, color="gray", lw=0.8, ls=":")
            if scale == "log":
                ax.set_yscale("log")
            elif scale:
                ax.set_ylim(*scale)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.set_title(f"{workload}, OPT-13B / A100 (simulated)", fontsize=9)
        row_axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
