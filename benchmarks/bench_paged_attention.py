"""Paged decode attention: every rung of our Triton and CUDA kernels vs PyTorch SDPA on the
same K/V stored contiguously, in one run, on one machine; and (--sweep) the Triton launch
configs grid at a handful of shapes.

Decode attention is memory-bound: each step reads every K/V byte of every request once and
does ~2 FLOPs per byte. So the figure of merit is achieved bandwidth = bytes of K/V read /
time, and the question PagedAttention must answer is what the block-table indirection
costs against attention over contiguous K/V (the thesis measured 20-26% kernel overhead
against FasterTransformer, [Kwon 2025, §3.7.1]). We report, per (dtype, batch, context) and rung:
  * time and achieved bandwidth, and the fraction of the GPU's peak;
  * ratio = SDPA time / our time (> 1: paged is faster than contiguous SDPA);
  * two timings: `time_us`, back-to-back eager calls (at small shapes this is the host's
    launch cost, not the kernel's), and `graph_time_us`, the same calls captured in one CUDA
    graph and replayed (the GPU time, as an engine that captures its decode step sees it).

Rungs (columns): "sdpa" (the peer), "torch" (CPU only), "triton" (the default: the launch
`choose_decode_config` picks), "triton:v1-tile16" (the launch before configs existed, for the
record), "triton:v1" / "triton:v2" (that kernel with the chooser's tile/warps/stages/splits),
"cuda" (vLLM's v1/v2 rule), "cuda:v1", "cuda:v2", "cuda:v3". A rung that is missing, fails to
build, or gives a wrong answer is recorded as FAILED with its error (no time) and the others go on.

Workload: Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), block
size 16, physical blocks shuffled, every request of a batch at the same context length (so
SDPA needs no padding). Every rung's output is checked against SDPA before timing.

    python -m benchmarks.bench_paged_attention            # GPU: every rung, fp16 + bf16 -> results/paged_attention.json/.png
    python -m benchmarks.bench_paged_attention --quick    # GPU: bf16 only, contexts >= 2k (the issue's goals)
    python -m benchmarks.bench_paged_attention --sweep    # GPU: Triton configs grid -> results/paged_attention_sweep.json
    python -m benchmarks.bench_paged_attention --smoke [--sweep]   # CPU: tiny sizes, torch + Triton interpreter
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import statistics
import time

import torch

from benchmarks.common import RESULTS_DIR, device_name, sync, time_fn, try_plot, write_result

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# Peak HBM bandwidth (bytes/s) by device name, for the "fraction of peak" column.
PEAK_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12}

CHECK_TOLERANCE = {"float16": dict(atol=4e-3, rtol=4e-3), "bfloat16": dict(atol=3e-2, rtol=3e-2)}

GPU_SWEEP = dict(dtypes=("float16", "bfloat16"), batches=(1, 8, 32, 128), contexts=(512, 2048, 8192, 32768),
                 max_tokens=1 << 20)
QUICK_SWEEP = dict(dtypes=("bfloat16",), batches=(1, 8, 32, 128), contexts=(2048, 8192, 32768), max_tokens=1 << 20)
SMOKE_SWEEP = dict(dtypes=("float16", "bfloat16"), batches=(1,), contexts=(24,), max_tokens=1 << 10)

TRITON_RUNGS = ("triton", "triton:v1-tile16", "triton:v1", "triton:v2")
CUDA_RUNGS = ("cuda", "cuda:v1", "cuda:v2", "cuda:v3")

# --sweep: the Triton launch grid (v2 kernel) at the shapes the goals name, bf16.
CONFIG_SHAPES = ((1, 32768), (8, 8192), (32, 2048), (128, 2048), (128, 8192), (256, 1024))   # (batch, context)
CONFIG_GRID = dict(tile=(16, 32, 64, 128), num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4))
SMOKE_CONFIG_SHAPES = ((1, 40),)
SMOKE_CONFIG_GRID = dict(tile=(16, 32), num_warps=(4,), num_stages=(1,))


def make_workload(batch: int, context: int, dtype: torch.dtype, device: str, seed: int = 0, dense: bool = True):
    """A paged cache holding `batch` requests of `context` tokens in shuffled blocks, and the
    same K/V gathered into contiguous [batch, kv_heads, context, head_dim] tensors for SDPA
    (None, None when not `dense`)."""
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

    if not dense:
        return query, key_cache, value_cache, block_tables, seq_lens, None, None
    return query, key_cache, value_cache, block_tables, seq_lens, contiguous(key_cache), contiguous(value_cache)


def sdpa_decode(query, k_dense, v_dense, scale):
    """The peer: PyTorch's fused attention on contiguous K/V (GQA without copying K/V)."""
    q = query.unsqueeze(2)                                              # [b, h, 1, d]
    out = torch.nn.functional.scaled_dot_product_attention(q, k_dense, v_dense, scale=scale, enable_gqa=True)
    return out.squeeze(2)                                               # [b, h, d]


def rungs_for(device: str) -> list[str]:
    if device == "cuda":
        return list(TRITON_RUNGS + CUDA_RUNGS)
    return ["torch"] + (list(TRITON_RUNGS) if os.environ.get("TRITON_INTERPRET") == "1" else [])


def triton_config(rung: str, batch: int, context: int, dtype: torch.dtype):
    """The resolved DecodeConfig (num_kv_splits filled in) a Triton rung launches at this shape."""
    from paged_attention import triton_ops as T
    if rung == "triton:v1-tile16":
        cfg = T.V1_TILE16
    else:
        cfg = T.choose_decode_config(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype, BLOCK_SIZE)
        if rung != "triton":
            cfg = dataclasses.replace(cfg, version=rung.split(":")[1])
    if cfg.num_kv_splits is None:
        cfg = dataclasses.replace(cfg, num_kv_splits=T.choose_num_kv_splits(batch, NUM_KV_HEADS, context, cfg.tile))
    return cfg


def rung_fn(rung: str, q, kc, vc, bt, sl, scale: float, context: int):
    """A no-argument call of one rung (raises on a rung this build lacks)."""
    from paged_attention import ops
    if rung in ("torch", "triton", "cuda"):
        return lambda: ops.paged_decode_attention(q, kc, vc, bt, sl, scale, backend=rung, check_values=False,
                                                  max_seq_len=context)
    if rung.startswith("cuda:"):
        version = rung.split(":", 1)[1]
        return lambda: ops.paged_decode_attention(q, kc, vc, bt, sl, scale, backend="cuda", check_values=False,
                                                  max_seq_len=context, version=version)
    if rung in TRITON_RUNGS:
        from paged_attention import triton_ops
        cfg = triton_config(rung, q.shape[0], context, q.dtype)
        return lambda: triton_ops.paged_decode_attention(q, kc, vc, bt, sl, scale, False, max_seq_len=context,
                                                         config=cfg)
    raise ValueError(f"unknown rung {rung!r}")


# ----------------------------------------------------------------------------- timing

def time_eager(fn, reps: int, warmup: int, iters: int) -> float:
    """Seconds per call: median of `iters` samples of `reps` back-to-back calls."""
    return time_fn(lambda: [fn() for _ in range(reps)], warmup=warmup, iters=iters) / reps


def time_graph(fn, reps: int, iters: int) -> float:
    """Seconds per call with `reps` calls captured in one CUDA graph: the GPU's time, no launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm up on a side stream, as capture requires
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        graph.replay()
        sync()
        samples.append(time.perf_counter() - t0)
    del graph
    return statistics.median(samples) / reps


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


# ----------------------------------------------------------------------------- parallel precompile

def _precompile_worker(tasks: list) -> dict:
    """In a spawned process: launch each (dtype_name, DecodeConfig) once on a small workload with
    the same specialisation as the benchmark's (every stride and size a multiple of 16), so the
    compiled kernels land in Triton's on-disk cache; the benchmark process then only loads them."""
    from paged_attention import triton_ops
    errors, workloads = {}, {}
    for dtype_name, cfg in tasks:
        try:
            if dtype_name not in workloads:
                workloads[dtype_name] = make_workload(1, 1024, getattr(torch, dtype_name), "cuda", dense=False)[:5]
            q, kc, vc, bt, sl = workloads[dtype_name]
            triton_ops.paged_decode_attention(q, kc, vc, bt, sl, HEAD_DIM ** -0.5, False, max_seq_len=1024, config=cfg)
            torch.cuda.synchronize()
        except Exception as e:   # noqa: BLE001 - the benchmark records it when it runs that config
            # only what the config itself causes (shared memory, registers, a compile error) is
            # final; anything else (this process's CUDA state) is left to the benchmark to retry
            final = type(e).__name__ in ("OutOfResources", "CompilationError", "PTXASError")
            errors[repr((dtype_name, cfg))] = (final, _error(e))
    return errors


def precompile(tasks: list, workers: int | None = None) -> dict:
    """Compile (dtype_name, DecodeConfig) tasks in parallel worker processes (Triton compiles one
    kernel at a time per process: a config grid would otherwise spend most of its time here).
    Best effort: anything that fails here is compiled, or fails, again where it is timed."""
    tasks = list(dict.fromkeys(tasks))
    if not tasks or not torch.cuda.is_available():
        return {}
    import concurrent.futures
    import multiprocessing
    # Tasks that build the same kernel go to the same worker (else two workers compile it):
    # v2 takes the split count at run time, and the JIT only tells apart 1, multiples of 16 and the rest.
    groups: dict = {}
    for dtype_name, cfg in tasks:
        s = cfg.num_kv_splits or 1
        split_class = s if cfg.version == "v1" else (1 if s == 1 else 16 if s % 16 == 0 else 2)
        key = (dtype_name, cfg.version, cfg.tile, cfg.num_warps, cfg.num_stages, split_class)
        groups.setdefault(key, []).append((dtype_name, cfg))
    workers = workers or max(1, min(len(groups), (os.cpu_count() or 2) - 1, 16))
    chunks = [[t for g in list(groups.values())[i::workers] for t in g] for i in range(workers)]
    t0 = time.perf_counter()
    errors = {}
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for result in pool.map(_precompile_worker, chunks):
                errors.update(result)
    except Exception as e:   # noqa: BLE001
        print(f"precompile skipped ({_error(e)}): kernels compile on first use")
    final = {k: msg for k, (is_final, msg) in errors.items() if is_final}
    print(f"precompiled {len(tasks)} Triton launch configs in {time.perf_counter() - t0:.1f} s "
          f"({workers} processes; {len(final)} cannot build, {len(errors) - len(final)} other errors, retried here"
          + (f", e.g. {next(msg for is_final, msg in errors.values() if not is_final)}" if len(errors) > len(final) else "")
          + ")")
    return final


# ----------------------------------------------------------------------------- rungs vs SDPA

def run(sweep: dict, device: str, reps: int, warmup: int, iters: int) -> list[dict]:
    rows = []
    peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in device_name()), None) if device == "cuda" else None
    scale = HEAD_DIM ** -0.5
    rungs = rungs_for(device)
    shapes = [(dt, b, c) for dt in sweep["dtypes"] for b in sweep["batches"] for c in sweep["contexts"]
              if b * c <= sweep["max_tokens"]]
    if device == "cuda":
        precompile([(dt, triton_config(r, b, c, getattr(torch, dt))) for dt, b, c in shapes
                    for r in rungs if r in TRITON_RUNGS])
    for dtype_name, batch, context in shapes:
        dtype = getattr(torch, dtype_name)
        q, kc, vc, bt, sl, kd, vd = make_workload(batch, context, dtype, device)
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kc.element_size()
        want = sdpa_decode(q, kd, vd, scale)
        results = {}
        for name in ["sdpa"] + rungs:
            row = dict(dtype=dtype_name, batch=batch, context=context, backend=name, kv_bytes=kv_bytes)
            if name in TRITON_RUNGS:
                row["config"] = dataclasses.asdict(triton_config(name, batch, context, dtype))
            try:
                fn = (lambda: sdpa_decode(q, kd, vd, scale)) if name == "sdpa" else rung_fn(name, q, kc, vc, bt, sl,
                                                                                            scale, context)
                # a fast wrong answer is worth nothing: check first
                torch.testing.assert_close(fn().float(), want.float(), **CHECK_TOLERANCE[dtype_name],
                                           msg=lambda m, n=name: f"{n} {dtype_name} b={batch} ctx={context}: {m}")
                row["time_us"] = time_eager(fn, reps, warmup, iters) * 1e6
            except Exception as e:   # noqa: BLE001 - recorded, never a time, never stops the other rungs
                row.update(status="FAILED", error=_error(e))
                rows.append(row)
                print(f"{dtype_name:8s} b={batch:4d} ctx={context:6d} {name:16s} FAILED  {row['error']}")
                continue
            row["status"] = "ok"
            if device == "cuda":
                try:
                    row["graph_time_us"] = time_graph(fn, reps, iters) * 1e6
                except Exception as e:   # noqa: BLE001
                    row["graph_error"] = _error(e)
            results[name] = row
            rows.append(row)
        base = results.get("sdpa", {})
        for name, row in results.items():
            t = row["time_us"] * 1e-6
            row.update(bandwidth_gbs=kv_bytes / t / 1e9, ratio_vs_sdpa=base["time_us"] / row["time_us"])
            if peak:
                row["fraction_of_peak"] = kv_bytes / t / peak
            if "graph_time_us" in row and "graph_time_us" in base:
                row.update(graph_bandwidth_gbs=kv_bytes / row["graph_time_us"] / 1e3,
                           graph_ratio_vs_sdpa=base["graph_time_us"] / row["graph_time_us"])
            graph = (f"  graph {row['graph_time_us']:9.1f} us x{row['graph_ratio_vs_sdpa']:5.2f}"
                     if "graph_ratio_vs_sdpa" in row else "")
            print(f"{dtype_name:8s} b={batch:4d} ctx={context:6d} {name:16s} {row['time_us']:9.1f} us "
                  f"{row['bandwidth_gbs']:8.1f} GB/s  x{row['ratio_vs_sdpa']:5.2f} vs sdpa{graph}")
        del q, kc, vc, bt, sl, kd, vd, want
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- --sweep: the config grid

def sweep_configs(batch: int, context: int, grid: dict, dtype: torch.dtype) -> list:
    """(label, DecodeConfig) to time at one shape: the chooser's pick, v1-tile16, and the v2 grid
    (tile x num_warps x num_stages x num_kv_splits around the chooser's split count)."""
    from paged_attention import triton_ops as T
    pick = T.choose_decode_config(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype, BLOCK_SIZE)
    s = pick.num_kv_splits or 1
    splits = sorted({max(1, s // 2), s, 2 * s}) if s > 1 else [1, 2]
    configs = [("chooser", pick), ("v1-tile16", triton_config("triton:v1-tile16", batch, context, dtype))]
    for tile, warps, stages, sp in itertools.product(grid["tile"], grid["num_warps"], grid["num_stages"], splits):
        configs.append(("grid", T.DecodeConfig("v2", tile, warps, stages, sp)))
    return configs


def run_config_sweep(shapes, grid: dict, device: str, reps: int, warmup: int, iters: int) -> tuple[list, dict]:
    from paged_attention import triton_ops
    dtype_name, dtype = "bfloat16", torch.bfloat16
    scale = HEAD_DIM ** -0.5
    per_shape = {shape: sweep_configs(*shape, grid, dtype) for shape in shapes}
    compile_errors = precompile([(dtype_name, cfg) for cfgs in per_shape.values() for _, cfg in cfgs]) \
        if device == "cuda" else {}
    timer = (lambda fn: time_graph(fn, reps, iters)) if device == "cuda" else (lambda fn: time_eager(fn, reps, warmup, iters))
    rows, best = [], {}
    for (batch, context), configs in per_shape.items():
        t_shape = time.perf_counter()
        q, kc, vc, bt, sl, kd, vd = make_workload(batch, context, dtype, device)
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kc.element_size()
        want = sdpa_decode(q, kd, vd, scale)
        sdpa_us = timer(lambda: sdpa_decode(q, kd, vd, scale)) * 1e6
        del kd, vd
        shape_rows = []
        for label, cfg in configs:
            row = dict(batch=batch, context=context, kind=label, **dataclasses.asdict(cfg))
            if repr((dtype_name, cfg)) in compile_errors:      # failed in a precompile worker: don't rebuild it here
                row.update(status="FAILED", error=compile_errors[repr((dtype_name, cfg))])
                shape_rows.append(row)
                continue
            try:
                fn = (lambda cfg=cfg: triton_ops.paged_decode_attention(q, kc, vc, bt, sl, scale, False,
                                                                        max_seq_len=context, config=cfg))
                torch.testing.assert_close(fn().float(), want.float(), **CHECK_TOLERANCE[dtype_name])
                t = timer(fn)
                row.update(status="ok", time_us=t * 1e6, bandwidth_gbs=kv_bytes / t / 1e9,
                           ratio_vs_sdpa=sdpa_us / (t * 1e6))
            except Exception as e:   # noqa: BLE001 - e.g. a config that fails to compile (shared memory, registers)
                row.update(status="FAILED", error=_error(e))
            shape_rows.append(row)
        rows += shape_rows
        ok = [r for r in shape_rows if r["status"] == "ok"]
        key = f"b{batch}_ctx{context}"
        if ok:
            win = min(ok, key=lambda r: r["time_us"])
            chooser = next((r for r in ok if r["kind"] == "chooser"), None)
            v1 = next((r for r in ok if r["kind"] == "v1-tile16"), None)
            best[key] = dict(batch=batch, context=context, sdpa_us=sdpa_us,
                             config={k: win[k] for k in ("version", "tile", "num_warps", "num_stages", "num_kv_splits")},
                             time_us=win["time_us"], bandwidth_gbs=win["bandwidth_gbs"], ratio_vs_sdpa=win["ratio_vs_sdpa"],
                             chooser_time_us=chooser and chooser["time_us"], v1_tile16_time_us=v1 and v1["time_us"])
            print(f"b={batch:4d} ctx={context:6d}: sdpa {sdpa_us:8.1f} us | best {win['time_us']:8.1f} us "
                  f"x{win['ratio_vs_sdpa']:.2f} {best[key]['config']} | chooser "
                  f"{chooser['time_us'] if chooser else float('nan'):8.1f} us | v1-tile16 "
                  f"{v1['time_us'] if v1 else float('nan'):8.1f} us | {len(ok)}/{len(shape_rows)} ok, "
                  f"{time.perf_counter() - t_shape:.1f} s")
        else:
            best[key] = dict(batch=batch, context=context, status="FAILED", error="no config ran")
        del q, kc, vc, bt, sl, want
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, best


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r.get("status") == "ok"]      # FAILED rungs have no time
    dtypes = sorted({r["dtype"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6 * len(dtypes), 8), squeeze=False)
    styles = {"sdpa": "k--", "torch": "g-", "triton": "b-", "triton:v1-tile16": "c:", "triton:v1": "c-",
              "triton:v2": "b:", "cuda": "r-", "cuda:v1": "m:", "cuda:v2": "m-", "cuda:v3": "r:"}
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
    ap.add_argument("--quick", action="store_true", help="GPU: bf16 only, contexts >= 2k (the issue's goal shapes)")
    ap.add_argument("--sweep", action="store_true", help="time the Triton launch configs grid instead of the rungs")
    ap.add_argument("--out-dir", type=pathlib.Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before paged_attention imports triton
    flags = "".join(f" --{f}" for f in ("smoke", "quick", "sweep") if getattr(args, f))
    command = "python -m benchmarks.bench_paged_attention" + flags
    t0 = time.perf_counter()
    if args.sweep:
        return _main_sweep(args, device, command, t0)
    sweep = SMOKE_SWEEP if device == "cpu" else QUICK_SWEEP if args.quick else GPU_SWEEP
    reps, warmup, iters = (1, 1, 1) if device == "cpu" else (10, 2, 5)
    rows = run(sweep, device, reps, warmup, iters)
    name = "paged_attention" if device == "cuda" else "paged_attention_cpu_smoke"
    workload = dict(op="paged decode attention", heads=NUM_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    block_size=BLOCK_SIZE, model_shapes="Llama-3-8B attention (32 q heads, 8 KV heads, d=128)",
                    peer="torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) on contiguous K/V",
                    layout="physical blocks shuffled; all requests of a batch at the same context length",
                    rungs=["sdpa"] + rungs_for(device),
                    timing=f"time_us: median of {iters} samples of {reps} back-to-back eager calls; graph_time_us: "
                           f"the same {reps} calls captured in one CUDA graph, median of {iters} replays; "
                           "check_values=False",
                    command=command, wall_s=None, **sweep)
    workload["wall_s"] = round(time.perf_counter() - t0, 1)
    path = write_result(name, workload, rows, out_dir=args.out_dir)
    try_plot(plot, rows, path.with_suffix(".png"), f"paged decode attention vs SDPA on {device_name()}")
    sync()
    print(f"wrote {path} and {path.with_suffix('.png')} ({workload['wall_s']} s)")
    return path


def _main_sweep(args, device: str, command: str, t0: float) -> pathlib.Path:
    shapes, grid = (SMOKE_CONFIG_SHAPES, SMOKE_CONFIG_GRID) if device == "cpu" else (CONFIG_SHAPES, CONFIG_GRID)
    reps, warmup, iters = (1, 0, 1) if device == "cpu" else (5, 0, 3)
    rows, best = run_config_sweep(shapes, grid, device, reps, warmup, iters)
    name = "paged_attention_sweep" if device == "cuda" else "paged_attention_sweep_cpu_smoke"
    workload = dict(op="paged decode attention, Triton launch configs", dtype="bfloat16", heads=NUM_HEADS,
                    kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                    shapes=[dict(batch=b, context=c) for b, c in shapes], grid=grid,
                    splits="num_kv_splits in {s/2, s, 2s} around the chooser's s; {1, 2} where s = 1",
                    baselines="'chooser' = choose_decode_config's pick; 'v1-tile16' = the launch before configs",
                    timing=(f"{reps} calls captured in one CUDA graph, median of {iters} replays (GPU time); "
                            "every config checked against SDPA first" if device == "cuda" else "interpreter, 1 call"),
                    command=command)
    path = write_result(name, workload, rows, out_dir=args.out_dir)
    result = json.loads(path.read_text())
    result["best"] = best
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['wall_s']} s)")
    return path


if __name__ == "__main__":
    main()
