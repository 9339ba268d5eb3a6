"""Scheduling policies side by side [Kwon 2025, §4.5]: FCFS, priority, SRTF and two-level on
three traces built to expose their trade-offs, Llama-3-8B on one H100 (cost model), a
2048-token budget, 64 sequences, 32K KV slots:

  hol_blocking  4 long prompts (1900 tokens) queued just ahead of 32 short ones (40 tokens)
  starvation    a stream of 100-token prompts at 300 req/s (more than is served) and one
                1500-token prompt arriving at t = 0.2 s
  priority      the same kind of overloaded stream, every other request high priority

Ratios reported: mean TTFT of each policy relative to FCFS, and the long prompt's TTFT
under SRTF relative to two-level (the starvation two-level removes).

    .venv/bin/python -m benchmarks.sim_policies        # -> benchmarks/results/sim_policies.{json,png}
"""
from __future__ import annotations

from benchmarks.common import RESULTS_DIR, write_result
from scheduler.config import POLICIES
from scheduler.cost_model import LLAMA_3_8B_H100
from scheduler.experiments import policy_comparison


def main() -> None:
    rows = policy_comparison(cost_model=LLAMA_3_8B_H100)
    by = {(r["trace"], r["policy"]): r for r in rows}
    for r in rows:
        r["ttft_mean_vs_fcfs"] = r["ttft_mean_s"] / by[r["trace"], "fcfs"]["ttft_mean_s"]
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    starvation = by["starvation", "srtf"]["long_ttft_mean_s"] / by["starvation", "two_level"]["long_ttft_mean_s"]
    print(f"long prompt TTFT, SRTF / two-level: {starvation:.1f}x")
    workload = {"what": "TTFT per scheduling policy on HOL-blocking, starvation and priority traces",
                "model": LLAMA_3_8B_H100.name, "cost_model": vars(LLAMA_3_8B_H100), "max_num_batched_tokens": 2048,
                "max_num_seqs": 64, "kv_slots": 2048 * 16, "staging_size": 8,
                "long_prompt_ttft_srtf_over_two_level": starvation, "command": "python -m benchmarks.sim_policies"}
    path = write_result("sim_policies", workload, rows)
    plot(rows, RESULTS_DIR / "sim_policies.png")
    print(f"wrote {path}")


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("hol_blocking", ["short_ttft_mean_s", "long_ttft_mean_s"], "head-of-line blocking"),
              ("starvation", ["short_ttft_mean_s", "long_ttft_mean_s"], "starvation (one long prompt)"),
              ("priority", ["p0_ttft_mean_s", "p1_ttft_mean_s"], "priority 0 vs 1")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (trace, keys, title) in zip(axes, panels):
        sel = {r["policy"]: r for r in rows if r["trace"] == trace}
        width = 0.38
        for j, key in enumerate(keys):
            ax.bar([i + j * width for i in range(len(POLICIES))], [sel[p][key] * 1e3 for p in POLICIES], width,
                   label=key.replace("_ttft_mean_s", ""))
        ax.set_xticks([i + width / 2 for i in range(len(POLICIES))], POLICIES)
        ax.set_ylabel("mean TTFT (ms)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
