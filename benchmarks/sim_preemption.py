"""Recompute vs swap preemption across block sizes [Kwon 2025, §3.7.3, Fig. 3.19], in the
simulator: OPT-13B on one A100-40GB, ShareGPT-like trace at 4 req/s (enough to force
hundreds of preemptions in 15.7K KV slots), swap tier as large as the device cache.

Recompute pays prefill FLOPs for the victim's tokens when it resumes; swap pays PCIe time,
block bytes / 25 GB/s plus 5 us for each of the 80 copies (K and V of 40 layers) a block
needs — which is why small blocks make swapping slow. The ratio reported per block size:
end-to-end duration with swap / with recompute.

    .venv/bin/python -m benchmarks.sim_preemption      # -> benchmarks/results/sim_preemption.{json,png}
"""
from __future__ import annotations

from benchmarks.common import RESULTS_DIR, write_result
from scheduler.cost_model import OPT_13B_A100
from scheduler.experiments import preemption_sweep

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def main() -> None:
    rows = preemption_sweep(BLOCK_SIZES, rate=4.0, num_requests=300)
    by = {(r["block_size"], r["mode"]): r for r in rows}
    for r in rows:
        r["duration_vs_recompute"] = r["duration_s"] / by[r["block_size"], "recompute"]["duration_s"]
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
               if k in ("block_size", "mode", "num_preemptions", "swapped_blocks", "swap_time_s", "duration_s",
                        "normalized_latency_s_per_tok", "duration_vs_recompute")}, flush=True)
    workload = {"what": "recompute vs swap preemption per block size, ShareGPT-like at 4 req/s, 300 requests",
                "model": OPT_13B_A100.name, "kv_slots": 15_700, "swap": "25 GB/s + 80 copies x 5 us per block",
                "command": "python -m benchmarks.sim_preemption"}
    path = write_result("sim_preemption", workload, rows)
    plot(rows, RESULTS_DIR / "sim_preemption.png")
    print(f"wrote {path}")


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode in ("recompute", "swap"):
        sel = [r for r in rows if r["mode"] == mode]
        axes[0].plot([r["block_size"] for r in sel], [r["duration_s"] for r in sel], "o-", label=mode)
        axes[1].plot([r["block_size"] for r in sel], [r["normalized_latency_s_per_tok"] for r in sel], "o-", label=mode)
    for ax, label in zip(axes, ("time to serve the trace (s)", "normalized latency (s/token)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("Recompute vs swap, OPT-13B / A100, ShareGPT-like at 4 req/s (simulated)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
