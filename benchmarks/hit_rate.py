"""Prefix-cache hit rate by workload (the table of [v1 prefix caching]) and by eviction policy, on synthetic
workloads driven through KVCacheManager by a minimal FCFS continuous-batching loop
(`kvcache.simulate`). Side by side in one run, for each workload and cache size:

    vllm         LRU, tail-first free   (vLLM v1)
    forward      LRU, head-first free   (the timeline order of [vLLM 2.0 part 2, §6.3.3]: a chain's parent is
                                         evicted before its children, which become orphans)
    chain_aware  chain-aware eviction, head-first free (never evicts a block whose
                                         descendants are cached)

plus an unbounded cache ("ideal": everything ever computed stays cached) — the most any
policy could hit — and caching off, the baseline for savings. Two measures:
  hit rate       prefix-cache hit tokens / prompt tokens, on each request's FIRST admission
                 (the workload's own sharing; the notion of [v1 prefix caching]). vLLM's PrefixCacheStats also
                 counts re-admissions of preempted requests (column `hit_rate_all_admissions`).
  prefill saved  1 - prefill tokens computed / prefill tokens computed with caching off, over
                 everything including recomputation after preemption: the compute actually saved.
Workloads (kvcache.workloads, default parameters, seed 0): chatbot, multi_turn, rag,
summarization, random. Block size 16, max 16 running requests.

    .venv/bin/python -m benchmarks.hit_rate          # -> benchmarks/results/hit_rate.{json,png}
    .venv/bin/python -m benchmarks.hit_rate --quick  # smaller workloads (seconds)
"""
from __future__ import annotations

import argparse

from benchmarks.common import RESULTS_DIR, environment, write_result
from kvcache.simulate import SimConfig, simulate
from kvcache.workloads import WORKLOADS, Workload

BLOCK_SIZE = 16
MAX_RUNNING = 16
POLICIES = {"vllm": ("lru", "reverse"), "forward": ("lru", "forward"), "chain_aware": ("chain_aware", "forward")}
PUBLISHED_HIT_RATES = {  # the hit-rate table of [v1 prefix caching]
    "chatbot": "92-97%", "multi_turn": "80-95%", "rag": "25-40%", "summarization": "8-15%", "random": "0-2%"}


def unbounded_blocks(w: Workload) -> int:
    """Enough blocks that nothing is ever evicted."""
    tokens = sum(len(t.prompt) + len(t.output) for conv in w.conversations for t in conv)
    return tokens // BLOCK_SIZE + 2 * w.num_requests + 1


def min_blocks(w: Workload) -> int:
    """The largest single request (with its whole output) must fit."""
    return max(-(-(len(t.prompt) + len(t.output)) // BLOCK_SIZE) for conv in w.conversations for t in conv)


def _row(name, label, nb, frac, r, **extra) -> dict:
    return dict(workload=name, policy=label, num_blocks=nb, cache_fraction=frac,
                hit_rate=r.first_admission_hit_rate, hit_rate_all_admissions=r.hit_rate,
                prefill_computed_tokens=r.prefill_computed_tokens, preemptions=r.preemptions,
                evictions=r.evictions, mean_orphan_fraction=r.mean_orphan_fraction, **extra)


def run(quick: bool = False, fractions=(0.05, 0.1, 0.2, 0.4)) -> list[dict]:
    rows = []
    for name, make in WORKLOADS.items():
        w = make(**({"num_requests": 60} if quick and name != "multi_turn" else {"num_conversations": 12} if quick else {}))
        ideal = simulate(w, SimConfig(unbounded_blocks(w), BLOCK_SIZE, MAX_RUNNING))
        rows.append(_row(name, "ideal", ideal.config["num_blocks"], 1.0, ideal, seed_table=PUBLISHED_HIT_RATES[name],
                         params=w.params))
        for frac in fractions:
            nb = max(int(frac * unbounded_blocks(w)), min_blocks(w) + 1)
            base = simulate(w, SimConfig(nb, BLOCK_SIZE, MAX_RUNNING, enable_caching=False))
            rows.append(_row(name, "no_cache", nb, frac, base, prefill_saved=0.0))
            for label, (policy, order) in POLICIES.items():
                r = simulate(w, SimConfig(nb, BLOCK_SIZE, MAX_RUNNING, eviction_policy=policy, free_order=order,
                                          orphan_sample_every=25))
                rows.append(_row(name, label, nb, frac, r,
                                 prefill_saved=1 - r.prefill_computed_tokens / base.prefill_computed_tokens))
    return rows


def print_tables(rows: list[dict]) -> None:
    print(f"{'workload':14s} {'published':>9s} {'ideal':>6s}   at cache = x * unbounded size: "
          f"hit rate / prefill saved, for vllm | forward | chain_aware")
    for name in WORKLOADS:
        ideal = next(r for r in rows if r["workload"] == name and r["policy"] == "ideal")
        cells = []
        for frac in sorted({r["cache_fraction"] for r in rows if r["workload"] == name and r["policy"] != "ideal"}):
            h = {r["policy"]: r for r in rows if r["workload"] == name and r["cache_fraction"] == frac}
            cells.append(f"x={frac:.2f} " + " | ".join(f"{h[p]['hit_rate']:.2f}/{h[p]['prefill_saved']:.2f}" for p in POLICIES))
        print(f"{name:14s} {ideal['seed_table']:>9s} {ideal['hit_rate']:6.1%}   " + "   ".join(cells))


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(WORKLOADS)
    fig, axes = plt.subplots(2, len(names), figsize=(3.1 * len(names), 6), sharey="row", sharex=True)
    for col, name in enumerate(names):
        ideal = next(r for r in rows if r["workload"] == name and r["policy"] == "ideal")
        for row, key in enumerate(("hit_rate", "prefill_saved")):
            ax = axes[row, col]
            for label, style in (("vllm", "o-"), ("forward", "s--"), ("chain_aware", "^:")):
                pts = sorted((r["cache_fraction"], r[key]) for r in rows if r["workload"] == name and r["policy"] == label)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
            if key == "hit_rate":
                ax.axhline(ideal["hit_rate"], color="gray", lw=0.8, label="unbounded cache")
                ax.set_title(f"{name} (published: {ideal['seed_table']})", fontsize=9)
            fracs = sorted({r["cache_fraction"] for r in rows if r["policy"] not in ("ideal", "no_cache")})
            ax.set_xscale("log")
            ax.set_xticks(fracs, [f"{f:g}" for f in fracs])
            ax.minorticks_off()
        axes[1, col].set_xlabel("cache size / unbounded")
    axes[0, 0].set_ylabel("hit rate (first admissions)")
    axes[1, 0].set_ylabel("prefill compute saved vs no cache")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    rows = run(args.quick)
    print_tables(rows)
    name = "hit_rate_quick" if args.quick else "hit_rate"
    path = write_result(name, dict(block_size=BLOCK_SIZE, max_running=MAX_RUNNING, policies=POLICIES,
                                   note="simulated scheduling; no model runs; hit rate in tokens"), rows)
    plot(rows, RESULTS_DIR / f"{name}.png")
    print(f"wrote {path} and {RESULTS_DIR / f'{name}.png'} ({environment()['device']})")


if __name__ == "__main__":
    main()
