"""Paged decode attention: our Triton and CUDA kernels vs PyTorch SDPA on the same K/V stored
contiguously, in one run, on one machine.

Decode attention is memory-bound: each step reads every K/V byte of every request once and
does ~2 FLOPs per byte. So the figure of merit is achieved bandwidth = bytes of K/V read /
time, and the question PagedAttention must answer is what the block-table indirection
costs against attention over contiguous K/V (the thesis measured 20-26% kernel overhead
against FasterTransformer, [Kwon 2025, §3.7.1]). We report, per (dtype, batch, context):
  * time and achieved bandwidth of each backend, and the fraction of the GPU's peak;
  * ratio = SDPA time / our time (> 1: paged is faster than contiguous SDPA).

Workload: Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), block
size 16, physical blocks shuffled, every request of a batch at the same context length (so
SDPA needs no padding). Every backend's output is checked against SDPA before timing.

    python -m benchmarks.bench_paged_attention            # GPU: full sweep -> results/paged_attention.json/.png
    python -m benchmarks.bench_paged_attention --smoke    # CPU: tiny sizes, torch + Triton interpreter
"""
from __future__ import annotations

import argparse
import os
import pathlib

import torch

from benchmarks.common import RESULTS_DIR, device_name, sync, time_fn, write_result

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# Peak HBM bandwidth (bytes/s) by device name, for the "fraction of peak" column.
PEAK_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12}

CHECK_TOLERANCE = {"float16": dict(atol=4e-3, rtol=4e-3), "bfloat16": dict(atol=3e-2, rtol=3e-2)}

GPU_SWEEP = dict(dtypes=("float16", "bfloat16"), batches=(1, 8, 32, 128), contexts=(512, 2048, 8192, 32768),
                 max_tokens=1 << 20)
SMOKE_SWEEP = dict(dtypes=("float16", "bfloat16"), batches=(1,), contexts=(24,), max_tokens=1 << 10)


def make_workload(batch: int, context: int, dtype: torch.dtype, device: str, seed: int = 0):
    """A paged cache holding `batch` requests of `context` tokens in shuffled blocks, and the
    same K/V gathered into contiguous [batch, kv_heads, context, head_dim] tensors for SDPA."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device=device)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=g, device=device).to(dtype)

    def contiguous(cache):   # [b, kvh, context, d]
        return cache[block_tables.long()].reshape(batch, blocks_per_seq * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)[:, :context] \
            .transpose(1, 2).contiguous()

    return query, key_cache, value_cache, block_tables, seq_lens, contiguous(key_cache), contiguous(value_cache)


def sdpa_decode(query, k_dense, v_dense, scale):
    """The peer: PyTorch's fused attention on contiguous K/V (GQA without copying K/V)."""
    q = query.unsqueeze(2)                                              # [b, h, 1, d]
    out = torch.nn.functional.scaled_dot_product_attention(q, k_dense, v_dense, scale=scale, enable_gqa=True)
    return out.squeeze(2)                                               # [b, h, d]


def backends_for(device: str) -> list[str]:
    if device == "cuda":
        return ["triton", "cuda"]
    return ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]


def run(sweep: dict, device: str, reps: int, warmup: int, iters: int) -> list[dict]:
    from paged_attention import ops
    rows = []
    peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in device_name()), None) if device == "cuda" else None
    scale = HEAD_DIM ** -0.5
    for dtype_name in sweep["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for batch in sweep["batches"]:
            for context in sweep["contexts"]:
                if batch * context > sweep["max_tokens"]:
                    continue
                q, kc, vc, bt, sl, kd, vd = make_workload(batch, context, dtype, device)
                kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kc.element_size()
                fns = {"sdpa": lambda: sdpa_decode(q, kd, vd, scale)}
                for backend in backends_for(device):
                    fns[backend] = (lambda b=backend: ops.paged_decode_attention(
                        q, kc, vc, bt, sl, scale, backend=b, check_values=False, max_seq_len=context))
                want = fns["sdpa"]()
                for name, fn in fns.items():   # a fast wrong answer is worth nothing: check first
                    torch.testing.assert_close(fn().float(), want.float(), **CHECK_TOLERANCE[dtype_name],
                                               msg=lambda m, n=name: f"{n} {dtype_name} b={batch} ctx={context}: {m}")
                times = {name: time_fn(lambda fn=fn: [fn() for _ in range(reps)], warmup=warmup, iters=iters) / reps
                         for name, fn in fns.items()}
                for name, t in times.items():
                    row = dict(dtype=dtype_name, batch=batch, context=context, backend=name, time_us=t * 1e6,
                               kv_bytes=kv_bytes, bandwidth_gbs=kv_bytes / t / 1e9,
                               ratio_vs_sdpa=times["sdpa"] / t)
                    if peak:
                        row["fraction_of_peak"] = kv_bytes / t / peak
                    rows.append(row)
                    print(f"{dtype_name:8s} b={batch:4d} ctx={context:6d} {name:7s} {t * 1e6:10.1f} us "
                          f"{kv_bytes / t / 1e9:8.1f} GB/s  x{times['sdpa'] / t:5.2f} vs sdpa")
                del q, kc, vc, bt, sl, kd, vd
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dtypes = sorted({r["dtype"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6 * len(dtypes), 8), squeeze=False)
    styles = {"sdpa": "k--", "torch": "g-", "triton": "b-", "cuda": "r-"}
    for col, dt in enumerate(dtypes):
        for batch in batches:
            for backend in sorted({r["backend"] for r in rows}):
                pts = sorted((r["context"], r) for r in rows if r["dtype"] == dt and r["batch"] == batch and r["backend"] == backend)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                alpha = 0.35 + 0.65 * (batches.index(batch) + 1) / len(batches)
                axes[0, col].plot(xs, [p[1]["bandwidth_gbs"] for p in pts], styles.get(backend, "-"), alpha=alpha,
                                  marker="o", label=f"{backend} b={batch}")
                if backend != "sdpa":
                    axes[1, col].plot(xs, [p[1]["ratio_vs_sdpa"] for p in pts], styles.get(backend, "-"), alpha=alpha,
                                      marker="o", label=f"{backend} b={batch}")
        axes[0, col].set(title=f"{dt}: achieved K/V bandwidth", xscale="log", xlabel="context (tokens)", ylabel="GB/s")
        axes[1, col].axhline(1.0, color="k", lw=0.8)
        axes[1, col].set(title=f"{dt}: SDPA time / paged time (>1: paged faster)", xscale="log",
                         xlabel="context (tokens)", ylabel="ratio")
        for ax in axes[:, col]:
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> pathlib.Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: torch + Triton interpreter)")
    ap.add_argument("--out-dir", type=pathlib.Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before paged_attention imports triton
    sweep = SMOKE_SWEEP if device == "cpu" else GPU_SWEEP
    reps, warmup, iters = (1, 1, 1) if device == "cpu" else (20, 3, 10)
    rows = run(sweep, device, reps, warmup, iters)
    name = "paged_attention" if device == "cuda" else "paged_attention_cpu_smoke"
    workload = dict(op="paged decode attention", heads=NUM_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    block_size=BLOCK_SIZE, model_shapes="Llama-3-8B attention (32 q heads, 8 KV heads, d=128)",
                    peer="torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) on contiguous K/V",
                    layout="physical blocks shuffled; all requests of a batch at the same context length",
                    timing=f"median of {iters} samples of {reps} back-to-back calls, check_values=False",
                    command="python -m benchmarks.bench_paged_attention" + (" --smoke" if args.smoke else ""),
                    **sweep)
    path = write_result(name, workload, rows, out_dir=args.out_dir)
    plot(rows, path.with_suffix(".png"), f"paged decode attention vs SDPA on {device_name()}")
    sync()
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


if __name__ == "__main__":
    main()
