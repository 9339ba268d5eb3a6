"""Swap and block-copy bandwidth by block size, every backend side by side with the
physical limit (one contiguous copy of the same bytes), next to the cost model of [vLLM 2.0 part 1, §4.1].

Why block size matters [Kwon 2025, §3.7.3, Fig. 3.19a]: a swap moves one block per layer per
K/V as a separate transfer, so small blocks mean many small transfers and a per-transfer
overhead that, not bandwidth, sets the cost. Contenders for swap (GPU -> pinned CPU):
  torch   gather on the GPU, one transfer, scatter (kvcache.reference)
  cuda    one cudaMemcpyAsync per block pair and cache, as vLLM (kernels_cuda/swap_blocks.cu)
  triton  one zero-copy kernel writing pinned host memory over PCIe (kvcache.triton_ops)
  limit   one contiguous pinned copy of the same number of bytes
and for copy_blocks (within the GPU): torch, triton, cuda vs one contiguous device copy.
Workload: SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64), fp16, scattered
random block ids, 64 MiB per call (16 MiB on CPU), block sizes 1..256 tokens.
On a CPU-only machine only the torch backend runs (CPU -> CPU: no PCIe to measure; Triton
would run in its interpreter), single-threaded (on a shared, oversubscribed CPU every
OpenMP parallel region of index_select/index_copy costs ~12 ms of barrier waiting), so
the GPU numbers are the ones that count.

    .venv/bin/python -m benchmarks.bench_kvcache_swap   # -> benchmarks/results/kvcache_swap_<cpu|gpu>.{json,png}
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import RESULTS_DIR, environment, time_fn, write_result
from kvcache.cache_engine import KVCacheSpec
from kvcache.ops import copy_blocks, swap_blocks

MODEL = dict(num_layers=30, num_kv_heads=3, head_dim=64)          # SmolLM2-135M
LLAMA_7B = dict(num_layers=32, num_kv_heads=32, head_dim=128)      # the example of [vLLM 2.0 part 1, §4.1]


def cost_model_rows(pcie_gbps: float = 32.0) -> list[dict]:
    """[vLLM 2.0 part 1, §4.1]: one block of 16 tokens of LLaMA-7B over PCIe at 32 GB/s. Its arithmetic
    (16 x 32 x 2 x 128 x 2 bytes = 262 KB) leaves out the 32 KV heads; KVCacheSpec counts them."""
    rows = []
    for name, shape in (("LLaMA-7B", LLAMA_7B), ("SmolLM2-135M", MODEL)):
        spec = KVCacheSpec(block_size=16, dtype=torch.float16, **shape)
        rows.append(dict(model=name, bytes_per_block=spec.bytes_per_block,
                         us_per_block_at_pcie=spec.bytes_per_block / (pcie_gbps * 1e9) * 1e6, pcie_gbps=pcie_gbps))
    rows.append(dict(model="LLaMA-7B (figure of [vLLM 2.0 part 1, §4.1], 1 head)", bytes_per_block=16 * 32 * 2 * 128 * 2,
                     us_per_block_at_pcie=16 * 32 * 2 * 128 * 2 / (pcie_gbps * 1e9) * 1e6, pcie_gbps=pcie_gbps))
    return rows


def make_caches(spec: KVCacheSpec, num_blocks: int, device, pin: bool) -> list[torch.Tensor]:
    k, v = spec.allocate(num_blocks, device, pin_memory=pin)
    return k + v


def bench(device: torch.device, block_sizes, total_bytes: int, iters: int) -> list[dict]:
    on_gpu = device.type == "cuda"
    backends = ["torch", "cuda", "triton"] if on_gpu else ["torch"]
    rows = []
    for bt in block_sizes:
        spec = KVCacheSpec(block_size=bt, dtype=torch.float16, **MODEL)
        num_pairs = max(1, total_bytes // spec.bytes_per_block)
        moved = num_pairs * spec.bytes_per_block
        g = torch.Generator().manual_seed(bt)
        src_ids = torch.randperm(2 * num_pairs, generator=g)[:num_pairs]
        dst_ids = torch.randperm(2 * num_pairs, generator=g)[:num_pairs]
        mapping = torch.stack([src_ids, dst_ids], 1)
        gpu = make_caches(spec, 2 * num_pairs, device, pin=False)
        host = make_caches(spec, 2 * num_pairs, "cpu", pin=on_gpu)
        flat_dev = torch.empty(moved, dtype=torch.uint8, device=device)
        flat_host = torch.empty(moved, dtype=torch.uint8, pin_memory=on_gpu)
        limit = time_fn(lambda: flat_host.copy_(flat_dev, non_blocking=on_gpu), iters=iters)
        row = dict(op="swap_out", block_tokens=bt, bytes_per_block=spec.bytes_per_block, num_pairs=num_pairs,
                   bytes=moved, limit_GBps=moved / limit / 1e9)
        for b in backends:
            t = time_fn(lambda: swap_blocks(gpu, host, mapping, backend=b, check_values=False), iters=iters)
            row[f"{b}_GBps"] = moved / t / 1e9
            row[f"{b}_vs_limit"] = limit / t
        rows.append(row)
        if on_gpu:                                   # copy-on-write copies within the GPU
            copy_map = torch.stack([torch.arange(num_pairs), torch.arange(num_pairs, 2 * num_pairs)], 1).to(device)
            flat2 = torch.empty_like(flat_dev)
            dlimit = time_fn(lambda: flat2.copy_(flat_dev), iters=iters)
            crow = dict(op="copy_blocks", block_tokens=bt, bytes_per_block=spec.bytes_per_block, num_pairs=num_pairs,
                        bytes=moved, limit_GBps=2 * moved / dlimit / 1e9)    # read + write
            half = len(gpu) // 2
            for b in backends:
                t = time_fn(lambda: copy_blocks(gpu[:half], gpu[half:], copy_map, backend=b, check_values=False), iters=iters)
                crow[f"{b}_GBps"] = 2 * moved / t / 1e9
                crow[f"{b}_vs_limit"] = dlimit / t
            rows.append(crow)
        del gpu, host, flat_dev, flat_host
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rs = [r for r in rows if r["op"] == op]
        x = [r["block_tokens"] for r in rs]
        for key in ["limit_GBps"] + [k for k in rs[0] if k.endswith("_GBps") and k != "limit_GBps"]:
            ax.plot(x, [r[key] for r in rs], "k--" if key == "limit_GBps" else "o-",
                    label=key.replace("_GBps", "").replace("limit", "contiguous copy (limit)"))
        ax.set(xscale="log", xlabel="block size (tokens)", ylabel="GB/s", title=op)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    total = (64 if device.type == "cuda" else 16) << 20
    for r in cost_model_rows():
        print(f"cost model: {r['model']:38s} {r['bytes_per_block'] / 2**10:8.0f} KiB/block -> "
              f"{r['us_per_block_at_pcie']:7.1f} us per block at {r['pcie_gbps']:.0f} GB/s")
    rows = bench(device, [1, 4, 16, 64, 256], total, args.iters)
    for r in rows:
        cells = "  ".join(f"{k[:-5]} {r[k]:6.2f}" for k in r if k.endswith("_GBps"))
        print(f"{r['op']:11s} block {r['block_tokens']:3d} tok ({r['bytes_per_block'] / 2**10:7.1f} KiB, {r['num_pairs']:5d} pairs)"
              f"  GB/s: {cells}")
    tag = "gpu" if device.type == "cuda" else "cpu"
    path = write_result(f"kvcache_swap_{tag}", dict(model_shape=MODEL, dtype="float16", bytes_per_call=total,
                                                     cost_model=cost_model_rows()), rows)
    plot(rows, RESULTS_DIR / f"kvcache_swap_{tag}.png")
    print(f"wrote {path} ({environment()['device']})")


if __name__ == "__main__":
    main()
