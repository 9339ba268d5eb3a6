"""[vLLM 2.0 part 2, §10.4.2] in the simulator: 8 requests decoding, one 4096-token prompt arrives;
the decoders' worst inter-token latency and the long prompt's TTFT, without chunked prefill
(chapter 03's scheduler, budget = max_model_len) and with it (chapter 05's), sweeping the
chunk size (= max_num_batched_tokens). Llama-3-8B on one H100 (cost model).

Ratios reported per chunk size, relative to no chunking: the decoders' stall (smaller is
better) and the long prompt's TTFT (chunking makes it a little worse, never better).

    .venv/bin/python -m benchmarks.sim_chunked_prefill  # -> benchmarks/results/chunked_prefill_ttft_itl.{json,png}
"""
from __future__ import annotations

from benchmarks.common import RESULTS_DIR, write_result
from chunked_prefill.experiments import TTFTITLSetup, sweep_ttft_itl
from scheduler.cost_model import LLAMA_3_8B_H100

CHUNK_SIZES = [128, 256, 512, 1024, 2048, 4096]


def main() -> None:
    setup = TTFTITLSetup()
    rows = sweep_ttft_itl(CHUNK_SIZES, setup, LLAMA_3_8B_H100)
    off = rows[0]
    for r in rows:
        r["stall_vs_unchunked"] = r["decoder_max_itl_s"] / off["decoder_max_itl_s"]
        r["long_ttft_vs_unchunked"] = r["long_ttft_s"] / off["long_ttft_s"]
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    workload = {"what": "decoders' max ITL and a long prompt's TTFT vs chunk size [vLLM 2.0 part 2, §10.4.2]",
                "model": LLAMA_3_8B_H100.name, "setup": vars(setup),
                "command": "python -m benchmarks.sim_chunked_prefill"}
    path = write_result("chunked_prefill_ttft_itl", workload, rows)
    plot(rows, RESULTS_DIR / "chunked_prefill_ttft_itl.png")
    print(f"wrote {path}")


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    off, chunked = rows[0], rows[1:]
    xs = [r["chunk_size"] for r in chunked]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["decoder_max_itl_s"] * 1e3 for r in chunked], "o-", label="decoders' max ITL, chunked")
    ax.plot(xs, [r["long_ttft_s"] * 1e3 for r in chunked], "s-", label="long prompt TTFT, chunked")
    ax.axhline(off["decoder_max_itl_s"] * 1e3, color="C0", ls=":", label="decoders' max ITL, no chunking")
    ax.axhline(off["long_ttft_s"] * 1e3, color="C1", ls=":", label="long prompt TTFT, no chunking")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size = max_num_batched_tokens")
    ax.set_ylabel("ms")
    ax.set_title("8 decoders + one 4096-token prompt, Llama-3-8B / H100 (simulated)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
