"""When does a remote prefix hit pay? Moving L tokens' K/V between two processes, through
both layers of chapter 06, beside computing those L tokens (prefill), in one run.

The question of [vLLM 2.0 part 2, §7.4.4], measured here instead of assumed:
  prefill   HF transformers' SmolLM2-135M forward over L tokens (CPU, fp32, 1 sequence, one
            thread), the work a hit skips. Median of 3 after a warm-up.
  transfer  L tokens of SmolLM2's K/V (30 layers x K,V x 3 heads x 64, fp32: 46,080 B/token,
            block size 16) from one node process into another's (shuffled) KV blocks, as the
            consumer's connector times its load (start to bytes verified), 3 fresh prompts each:
              scratch pool   our metadata server + our engine, the reader pulls (READ)
              scratch push   prefill node pushes into the decode node (WRITE via side channel)
              mooncake push  Mooncake TransferEngine batch_transfer_sync_write (TCP, loopback)
              mooncake pool  Mooncake Store get (mooncake_master on loopback)
  model     that source's formulas: prefill at 0.5 ms/token, transfer over 100 Gbit/s + 5 µs,
            for SmolLM2's K/V and for its LLaMA-7B-like K/V.
Loopback on a shared 2-core machine is not a network: the transfer numbers here are CPU
copies, crc32 checksums and Python; the ratio transfer/prefill per L is the result, and
it is taken in the same run (other jobs may share the cores: noisy, interleaved).

    .venv/bin/python -m benchmarks.bench_kv_transfer            # -> benchmarks/results/kv_transfer.{json,png}
    .venv/bin/python -m benchmarks.bench_kv_transfer --quick    # L in {16, 256}
    .venv/bin/python -m benchmarks.bench_kv_transfer --replot   # redraw the PNG from the JSON
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from benchmarks.common import RESULTS_DIR, write_result
from global_prefix_cache.cost_model import LLAMA_7B_FP16, SMOLLM2_135M, Link, prefill_seconds, transfer_seconds

BLOCK_SIZE = 16
SHAPE = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, block_size=BLOCK_SIZE)
REPEATS = 3


def measure_prefill(lengths: list[int]) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    from mini_vllm.default_model import default_model_path
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    # One thread: on a shared, oversubscribed 2-core box, two OpenMP threads spend most of a
    # forward waiting at barriers (measured here: 16 tokens 0.4 s with 1 thread, 1.6-10 s with 2).
    torch.set_num_threads(1)
    out = {}
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, 32)))                       # warm-up
        for n in lengths:
            ids = torch.randint(0, 49152, (1, n))
            samples = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                model(ids, use_cache=True)
                samples.append(time.perf_counter() - t0)
            out[n] = statistics.median(samples)
    return out


def _configs(layer: str, address: str) -> tuple[dict, dict]:
    big = {"model": "SmolLM2-135M", "load_timeout_s": 60.0, "send_capacity_blocks": 80}
    if layer == "scratch":
        base = {"kv_connector": "GlobalKVPoolConnector",
                "kv_connector_extra_config": {**big, "metadata_server": address, "pool_capacity_blocks": 80}}
    else:
        base = {"kv_connector": "MooncakeConnector",
                "kv_connector_extra_config": {**big, "master_server": address, "global_segment_size": 256 << 20,
                                              "local_buffer_size": 64 << 20}}
    return base, big


def measure_transfers(layer: str, mode: str, lengths: list[int]) -> dict[int, list[float]]:
    """Load times (s) for each L: the consumer's connector's own clock, REPEATS fresh prompts."""
    from global_prefix_cache.node import NodeProcess
    if layer == "scratch":
        from global_prefix_cache.metadata import MetadataServerProcess
        server = MetadataServerProcess()
    else:
        from global_prefix_cache.mooncake_layer import MooncakeMaster
        server = MooncakeMaster()
    base, _ = _configs(layer, server.address)
    rng = random.Random(0)
    node_kw = dict(num_blocks=80, max_model_len=80 * BLOCK_SIZE, **SHAPE)
    if mode == "pool":
        roles = ("kv_both", "kv_both")
    else:
        roles = ("kv_producer", "kv_consumer")
    extra_p = {} if mode == "pool" else {"save_to_pool": False}
    cfg_p = {**base, "kv_role": roles[0], "kv_connector_extra_config": {**base["kv_connector_extra_config"], **extra_p}}
    cfg_c = {**base, "kv_role": roles[1]}
    out: dict[int, list[float]] = {}
    try:
        with NodeProcess(kv_transfer_config=cfg_p, shuffle_seed=1, node_id="P", **node_kw) as p, \
             NodeProcess(kv_transfer_config=cfg_c, shuffle_seed=2, node_id="C", **node_kw) as c:
            seen = 0
            for n in lengths:
                for r in range(REPEATS):
                    prompt = [rng.randrange(49152) for _ in range(n + 1)]      # n tokens loadable
                    rid = f"L{n}-{r}"
                    if mode == "pool":
                        p.run(rid, prompt, timeout=120)
                        rec = c.run(rid, prompt + [7], timeout=120)
                    else:
                        rp = p.run(rid, prompt[:n], kv_transfer_params={"do_remote_decode": True}, timeout=120)
                        rec = c.run(rid, prompt[:n] + rp["output_token_ids"], kv_transfer_params=rp["kv_transfer_params"],
                                    timeout=120)
                    if rec["external_tokens"] < n or rec["failed_load"]:
                        raise RuntimeError(f"{layer} {mode} L={n}: loaded {rec['external_tokens']} ({rec['failed_load']})")
                    times = c.call("stats")["load_seconds"]
                    out.setdefault(n, []).append(times[seen])
                    seen += 1
    finally:
        server.stop()
    return out


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 5))
    xs = [r["tokens"] for r in rows]
    ax.plot(xs, [r["prefill_ms"] for r in rows], "k-o", lw=2, label="prefill, measured (HF SmolLM2, CPU fp32)")
    for key, style in (("scratch_pool_ms", "C0-s"), ("scratch_push_ms", "C0--^"),
                       ("mooncake_push_ms", "C1--^"), ("mooncake_pool_ms", "C1-s")):
        if key in rows[0]:
            ax.plot(xs, [r[key] for r in rows], style, label=key[:-3].replace("_", " ") + ", measured (loopback)")
    ax.plot(xs, [r["model_prefill_ms"] for r in rows], "k:", label="cost model: prefill 0.5 ms/token (70B, A100)")
    ax.plot(xs, [r["model_transfer_smollm2_ms"] for r in rows], "g:", label="cost model: SmolLM2 K/V over 100 Gbit/s")
    ax.plot(xs, [r["model_transfer_seed_ms"] for r in rows], "r:", label="cost model: LLaMA-7B K/V over 100 Gbit/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens loaded instead of computed (L)")
    ax.set_ylabel("ms")
    ax.set_title("A remote hit pays where its transfer line is below the prefill line", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON, measure nothing")
    args = parser.parse_args(argv)
    if args.replot:
        import json
        plot(json.loads((RESULTS_DIR / "kv_transfer.json").read_text())["rows"], RESULTS_DIR / "kv_transfer.png")
        return
    lengths = [16, 256] if args.quick else [16, 64, 256, 1024]
    prefill = measure_prefill(lengths)
    measured = {("scratch", "pool"): measure_transfers("scratch", "pool", lengths),
                ("scratch", "push"): measure_transfers("scratch", "push", lengths)}
    if not args.no_mooncake:
        measured[("mooncake", "push")] = measure_transfers("mooncake", "push", lengths)
        measured[("mooncake", "pool")] = measure_transfers("mooncake", "pool", lengths)
    link = Link()
    rows = []
    for n in lengths:
        row = {"tokens": n, "kv_bytes": n * SMOLLM2_135M.bytes_per_token, "prefill_ms": prefill[n] * 1e3,
               "model_prefill_ms": prefill_seconds(n) * 1e3,
               "model_transfer_smollm2_ms": transfer_seconds(n, SMOLLM2_135M, link) * 1e3,
               "model_transfer_seed_ms": transfer_seconds(n, LLAMA_7B_FP16, link) * 1e3}
        for (layer, mode), times in measured.items():
            ms = statistics.median(times[n]) * 1e3
            row[f"{layer}_{mode}_ms"] = ms
            row[f"{layer}_{mode}_over_prefill"] = ms / row["prefill_ms"]
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    workload = {"model": "SmolLM2-135M-Instruct (K/V shape; prefill via HF transformers)", "dtype": "float32",
                "block_size": BLOCK_SIZE, "kv_bytes_per_token": SMOLLM2_135M.bytes_per_token,
                "repeats": REPEATS, "statistic": "median",
                "transfer": "two node processes on loopback; consumer connector's load time (RPC + bytes + crc32)",
                "seed_model": "prefill 0.5 ms/token; transfer 5 us + bytes / 100 Gbit/s",
                "prefill_threads": 1, "load_average_at_end": os.getloadavg()}
    path = write_result("kv_transfer", workload, rows)
    plot(rows, RESULTS_DIR / "kv_transfer.png")
    print(f"wrote {path} and kv_transfer.png")


if __name__ == "__main__":
    main()
